"""Tests of layertap_client against the real layertap server and small stub servers.

The server binary is $LAYERTAP_BIN, or target/debug/layertap under the
repository root; the model is the tiny Qwen3 fixture the Rust tests use.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import zstandard

import layertap_client
from layertap_client import Client, LayertapError, _safetensors
from layertap_client._common import decompress, normalize_inputs

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "tests" / "fixtures" / "tiny" / "qwen3_qknorm"
REFERENCE = MODEL / "reference.safetensors"
NUM_LAYERS = 3
HIDDEN = 64

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


# -- the real server ----------------------------------------------------------------------


def _binary() -> Path:
    b = Path(os.environ.get("LAYERTAP_BIN", "target/debug/layertap"))
    if not b.is_absolute():
        b = REPO / b
    if not b.exists():
        pytest.fail(f"layertap binary not found at {b}: build it first or set LAYERTAP_BIN")
    return b


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A layertap server on a free port, stopped with SIGTERM."""

    def __init__(self, *extra: str):
        self.log = tempfile.TemporaryFile()
        last = ""
        for _ in range(3):  # the free port may be taken between probing and binding
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [str(_binary()), "serve", "--model", str(MODEL), "--host", "127.0.0.1", "--port", str(self.port)]
            self.proc = subprocess.Popen(cmd + list(extra), cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if requests.get(self.url + "/ready", timeout=2).status_code == 200:
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.1)
            last = self.output()
            self.stop()
        pytest.fail(f"layertap did not become ready:\n{last}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    s.stop()
    assert s.proc.returncode == 0, f"server exited with {s.proc.returncode} after SIGTERM:\n{s.output()}"


@pytest.fixture(scope="session")
def client(server):
    with Client(server.url) as c:
        yield c


def _reference():
    tensors, _ = layertap_client.load_safetensors_file(str(REFERENCE))
    n = len([k for k in tensors if k.endswith(".input_ids")])
    assert n > 0
    return [(tensors[f"seq{i}.input_ids"], tensors[f"seq{i}.hidden_states"]) for i in range(n)]


# -- mixed inputs, tokenization, loss mask ------------------------------------------------


def test_split_special_tokens_spells_control_text_out(client):
    text = "<|im_start|>assistant\nhi<|im_end|>"
    default = client.tokenize([text])[0]["input_ids"]
    plain = client.tokenize([text], split_special_tokens=True)[0]["input_ids"]
    assert len(plain) > len(default) + 4
    r = client.hidden_states([text], layers=[1], dtype="float32", split_special_tokens=True)[0]
    assert r.input_ids.tolist() == plain


def test_mixed_inputs_shapes_ids_and_loss_mask(client):
    inputs = [[5, 6, 7, 8], "Hello, world!", CHAT]
    results = client.hidden_states(inputs, layers=[0, 2, -1], dtype="float32")
    tok = client.tokenize(inputs)
    assert len(results) == 3 and len(tok) == 3
    for r, t in zip(results, tok):
        n = len(t["input_ids"])
        assert r.hidden_states.shape == (n, 3, HIDDEN)
        assert r.hidden_states.dtype == np.float32
        assert r.input_ids.dtype == np.int64 and r.loss_mask.dtype == np.uint8
        assert r.input_ids.tolist() == t["input_ids"]
        assert r.loss_mask.tolist() == t["loss_mask"]
        assert r.layers == [0, 2, NUM_LAYERS]
        assert r.metadata["dtype"] == "float32"
        assert json.loads(r.metadata["layers"]) == [0, 2, NUM_LAYERS]
        assert np.isfinite(r.hidden_states).all()
    assert results[0].input_ids.tolist() == [5, 6, 7, 8]
    assert results[0].loss_mask.tolist() == [1, 1, 1, 1]  # plain ids train on every token

    # The chat's mask is 1 exactly on each assistant turn's content and end-of-turn
    # text: rebuild the expected ids and mask from the ChatML pieces, tokenized alone.
    pieces = []
    for m in CHAT:
        if m["role"] == "assistant":
            pieces += [("<|im_start|>assistant\n", 0), (m["content"] + "<|im_end|>\n", 1)]
        else:
            pieces.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", 0))
    piece_ids = client.tokenize([p for p, _ in pieces])
    ids = [i for t in piece_ids for i in t["input_ids"]]
    mask = [k for t, (_, k) in zip(piece_ids, pieces) for _ in t["input_ids"]]
    chat = results[2]
    assert chat.input_ids.tolist() == ids
    assert chat.loss_mask.tolist() == mask
    assert 0 < sum(mask) < len(mask)

    # The same sequence gives the same states whether sent as messages or as its ids.
    [again] = client.hidden_states([ids], layers=[0, 2, -1], dtype="float32")
    np.testing.assert_allclose(again.hidden_states, chat.hidden_states, rtol=1e-5, atol=1e-6)


def test_input_forms_are_normalized():
    assert normalize_inputs("hi") == [{"text": "hi"}]
    assert normalize_inputs([np.array([1, 2])]) == [{"input_ids": [1, 2]}]
    assert normalize_inputs([{"input_ids": np.array([3])}]) == [{"input_ids": [3]}]
    assert normalize_inputs([[{"role": "user", "content": "x"}]]) == [{"messages": [{"role": "user", "content": "x"}]}]
    with pytest.raises(TypeError):
        normalize_inputs([1, 2, 3])  # a flat list of ids is ambiguous
    with pytest.raises(ValueError):
        normalize_inputs([{"role": "user", "content": "x"}])  # a message, not a conversation
    with pytest.raises(ValueError):
        normalize_inputs([])


# -- numerical agreement with the Hugging Face reference ----------------------------------


def test_float32_matches_reference(client):
    ref = _reference()
    layers = list(range(NUM_LAYERS + 1))
    results = client.hidden_states([ids for ids, _ in ref], layers=layers, dtype="float32")
    assert len(results) == len(ref)
    for r, (ids, hs) in zip(results, ref):
        assert hs.shape == (NUM_LAYERS + 1, len(ids), HIDDEN)
        assert r.input_ids.tolist() == ids.tolist()
        got = r.hidden_states.transpose(1, 0, 2)  # [T, L, H] -> [L, T, H]
        np.testing.assert_allclose(got, hs, rtol=1e-5, atol=1e-5)
    # Negative indices count from the final state.
    [last] = client.hidden_states([ref[-1][0]], layers=[-1, -NUM_LAYERS - 1], dtype="float32")
    assert last.layers == [NUM_LAYERS, 0]
    np.testing.assert_allclose(last.hidden_states[:, 0], ref[-1][1][NUM_LAYERS], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(last.hidden_states[:, 1], ref[-1][1][0], rtol=1e-5, atol=1e-5)


def test_parser_agrees_with_safetensors_package():
    st = pytest.importorskip("safetensors.numpy")
    ours, _ = layertap_client.load_safetensors_file(str(REFERENCE))
    theirs = st.load_file(str(REFERENCE))
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
        assert np.array_equal(ours[k], theirs[k])


def _write_safetensors(tensors, metadata=None) -> bytes:
    """A minimal safetensors writer for the stub servers: {name: (dtype, shape, raw bytes)}."""
    header, chunks, pos = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + len(raw)]}
        chunks.append(raw)
        pos += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(chunks)


def test_parser_rejects_malformed_files():
    good = _write_safetensors({"a": ("F32", [2], np.array([1.5, -2], "<f4").tobytes())})
    assert _safetensors.load(good)[0]["a"].tolist() == [1.5, -2.0]
    with pytest.raises(_safetensors.SafetensorsError):
        _safetensors.parse(good[:-1])  # truncated data
    with pytest.raises(_safetensors.SafetensorsError):
        _safetensors.parse(good + b"\0")  # trailing bytes
    with pytest.raises(_safetensors.SafetensorsError):
        _safetensors.parse(b"\xff" * 8 + good[8:])  # header longer than the file
    bad_shape = _write_safetensors({"a": ("F32", [3], np.zeros(2, "<f4").tobytes())})
    with pytest.raises(_safetensors.SafetensorsError):
        _safetensors.parse(bad_shape)


# -- dtypes and torch ---------------------------------------------------------------------


def test_bfloat16_and_float16(client, monkeypatch):
    inputs = [[1, 2, 3, 4, 5], "some text"]
    f32 = client.hidden_states(inputs, layers=[1, -1], dtype="float32")
    # Without ml_dtypes, bfloat16 arrives as float32 holding bf16 values exactly.
    monkeypatch.setattr(_safetensors, "_ml_dtypes", None)
    bf = client.hidden_states(inputs, layers=[1, -1])  # bfloat16 is the default
    monkeypatch.undo()
    f16 = client.hidden_states(inputs, layers=[1, -1], dtype="float16")
    for a, b, h in zip(f32, bf, f16):
        assert b.metadata["dtype"] == "bfloat16" and h.metadata["dtype"] == "float16"
        assert b.hidden_states.dtype == np.float32 and b.hidden_states.shape == a.hidden_states.shape
        assert not (b.hidden_states.view(np.uint32) & 0xFFFF).any(), "not bfloat16 values"
        np.testing.assert_allclose(b.hidden_states, a.hidden_states, rtol=2**-8, atol=1e-6)
        assert not np.array_equal(b.hidden_states, a.hidden_states)
        assert h.hidden_states.dtype == np.float16
        np.testing.assert_allclose(h.hidden_states.astype(np.float32), a.hidden_states, rtol=2**-10, atol=1e-4)
        assert b.input_ids.tolist() == a.input_ids.tolist()

    if _safetensors.has_numpy_bfloat16():
        import ml_dtypes

        native = client.hidden_states(inputs, layers=[1, -1], dtype="bfloat16")
        for n, b in zip(native, bf):
            assert n.hidden_states.dtype == ml_dtypes.bfloat16
            assert np.array_equal(n.hidden_states.astype(np.float32), b.hidden_states)


def test_torch_output(client):
    torch = pytest.importorskip("torch")
    inputs = [[1, 2, 3], CHAT]
    f32 = client.hidden_states(inputs, layers=[0, -1], dtype="float32")
    bf = client.hidden_states(inputs, layers=[0, -1], dtype="bfloat16", as_torch=True)
    t32 = client.hidden_states(inputs, layers=[0, -1], dtype="float32", as_torch=True)
    for a, b, c in zip(f32, bf, t32):
        assert isinstance(b.hidden_states, torch.Tensor)
        assert b.hidden_states.dtype == torch.bfloat16
        assert b.input_ids.dtype == torch.int64 and b.loss_mask.dtype == torch.uint8
        assert b.input_ids.tolist() == a.input_ids.tolist()
        assert torch.equal(b.hidden_states, torch.from_numpy(a.hidden_states).to(torch.bfloat16))
        assert c.hidden_states.dtype == torch.float32
        assert torch.equal(c.hidden_states, torch.from_numpy(a.hidden_states))


# -- errors and auth ----------------------------------------------------------------------


def test_invalid_layer_is_422(client):
    with pytest.raises(LayertapError) as e:
        client.hidden_states([[1, 2, 3]], layers=[NUM_LAYERS + 1])
    assert e.value.status == 422
    assert e.value.type == "invalid_request"
    assert e.value.message


@pytest.fixture(scope="module")
def locked_server():
    s = Server("--api-key", "s3cret", "--max-input-tokens", "16", "--max-queue-tokens", "16")
    yield s
    s.stop()


def test_api_key(locked_server):
    with pytest.raises(LayertapError) as e:
        Client(locked_server.url).hidden_states([[1, 2]], layers=[-1])
    assert e.value.status == 401
    with pytest.raises(LayertapError) as e:
        Client(locked_server.url, api_key="wrong").info()
    assert e.value.status == 401
    c = Client(locked_server.url, api_key="s3cret")
    assert c.info()["num_layers"] == NUM_LAYERS
    [r] = c.hidden_states([[1, 2]], layers=[-1])
    assert r.hidden_states.shape == (2, 1, HIDDEN)


def test_too_long_input_is_413_without_retries(locked_server):
    c = Client(locked_server.url, api_key="s3cret")
    t0 = time.monotonic()
    with pytest.raises(LayertapError) as e:
        c.hidden_states([list(range(1, 30))], layers=[-1])
    assert e.value.status == 413
    assert time.monotonic() - t0 < 1.0


def test_real_queue_full_is_retried(locked_server):
    """16 concurrent requests into a queue that holds one: every one succeeds, retried when refused."""
    session = requests.Session()
    statuses = []
    session.hooks["response"].append(lambda r, *a, **k: statuses.append(r.status_code))
    c = Client(locked_server.url, api_key="s3cret", max_retries=50, session=session)
    seqs = [[(i * 7 + j) % 500 + 1 for j in range(16)] for i in range(16)]
    out = [None] * len(seqs)
    start = threading.Barrier(len(seqs))

    def work(i):
        start.wait(30)  # fire together so that the queue overflows
        out[i] = c.hidden_states([seqs[i]], layers=[-1], dtype="float32")[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(seqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(o is not None for o in out)
    for o, s in zip(out, seqs):
        assert o.input_ids.tolist() == s
    assert statuses.count(200) == len(seqs)
    # Whether the queue overflowed depends on timing; the stub-server tests below pin the retry logic.
    assert set(statuses) <= {200, 429}, statuses


# -- retries against a stub server --------------------------------------------------------


class _Stub:
    """A local HTTP server that answers from a script: a list of (status, headers, body)."""

    def __init__(self, script):
        self.script = list(script)
        self.requests = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                stub.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                status, headers, out = stub.script[min(len(stub.requests), len(stub.script)) - 1]
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = _answer

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    made = []

    def make(script):
        s = _Stub(script)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _answer(streamed_zstd=False):
    """A two-input hidden-states answer with bf16 values that need exact handling."""
    hs = np.array([1.0, -2.5, 3.140625, 1e-3, 65280.0, -0.0], np.float32).reshape(3, 1, 2)
    bits = (hs.view(np.uint32) >> 16).astype("<u2")  # exact for these values except 1e-3 (truncated)
    raw = _write_safetensors(
        {
            "hidden_states": ("BF16", [3, 1, 2], bits.tobytes()),
            "input_ids": ("I64", [3], np.array([7, 8, 9], "<i8").tobytes()),
            "cu_seqlens": ("I64", [3], np.array([0, 1, 3], "<i8").tobytes()),
            "loss_mask": ("U8", [3], bytes([1, 0, 1])),
        },
        {"layers": "[3]", "dtype": "bfloat16", "model": "stub"},
    )
    expect = (bits.astype(np.uint32) << 16).view(np.float32)
    if streamed_zstd:  # a frame without a content size, as streaming encoders write
        buf = zstandard.ZstdCompressor().compressobj()
        body = buf.compress(raw) + buf.flush()
    else:
        body = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    return body, raw, expect


def _check_answer(results, expect):
    assert [r.input_ids.tolist() for r in results] == [[7], [8, 9]]
    assert [r.loss_mask.tolist() for r in results] == [[1], [0, 1]]
    assert np.array_equal(np.concatenate([r.hidden_states.astype(np.float32) for r in results]), expect)
    assert results[0].layers == [3] and results[0].metadata["model"] == "stub"


def test_retries_429_honouring_retry_after(stub):
    body, _, expect = _answer()
    busy = (429, {"Retry-After": "1", "Content-Type": "application/json"}, b'{"error":"full","type":"overloaded"}')
    s = stub([busy, busy, (200, {"Content-Encoding": "zstd"}, body)])
    t0 = time.monotonic()
    results = Client(s.url, backoff=0.01).hidden_states([[7], [8, 9]], layers=[-1])
    elapsed = time.monotonic() - t0
    assert len(s.requests) == 3
    assert elapsed >= 2.0, f"Retry-After: 1 not honoured ({elapsed:.2f} s for two retries)"
    _check_answer(results, expect)
    method, path, headers, sent = s.requests[-1]
    assert (method, path) == ("POST", "/v1/hidden-states")
    assert headers.get("accept-encoding") == "zstd"
    assert json.loads(sent) == {
        "inputs": [{"input_ids": [7]}, {"input_ids": [8, 9]}],
        "layers": [-1],
        "dtype": "bfloat16",
    }


def test_gives_up_after_max_retries(stub):
    s = stub([(503, {"Retry-After": "0"}, b'{"error":"loading","type":"unavailable"}')])
    with pytest.raises(LayertapError) as e:
        Client(s.url, max_retries=2).info()
    assert e.value.status == 503 and e.value.type == "unavailable" and e.value.message == "loading"
    assert len(s.requests) == 3


def test_other_errors_are_not_retried(stub):
    s = stub([(422, {}, b'{"error":"bad layer","type":"invalid_request"}'), (200, {}, b"{}")])
    with pytest.raises(LayertapError) as e:
        Client(s.url).hidden_states(["x"], layers=[9])
    assert (e.value.status, e.value.type, e.value.message) == (422, "invalid_request", "bad layer")
    assert len(s.requests) == 1


def test_connection_errors_are_retried_then_raised():
    c = Client(f"http://127.0.0.1:{_free_port()}", max_retries=2, backoff=0.01)
    with pytest.raises(LayertapError) as e:
        c.info()
    assert e.value.status is None and e.value.type == "connection_error"
    assert not c.ready()


def test_uncompressed_and_streamed_zstd_answers(stub):
    body, raw, expect = _answer(streamed_zstd=True)
    assert decompress(body) == raw
    s = stub([(200, {"Content-Encoding": "zstd"}, body), (200, {}, raw)])
    c = Client(s.url)
    _check_answer(c.hidden_states([[7], [8, 9]], layers=[-1]), expect)  # zstd, no content size
    _check_answer(c.hidden_states([[7], [8, 9]], layers=[-1]), expect)  # plain safetensors


# -- the async client ---------------------------------------------------------------------


def test_async_matches_sync(client, server):
    pytest.importorskip("httpx")
    from layertap_client import AsyncClient

    inputs = [[9, 10, 11], "async text", CHAT]

    async def run():
        async with AsyncClient(server.url) as ac:
            assert await ac.ready()
            info = await ac.info()
            tok = await ac.tokenize(inputs)
            many = await asyncio.gather(
                ac.hidden_states(inputs, layers=[0, 2, -1], dtype="float32"),
                ac.hidden_states(inputs, layers=[0, 2, -1], dtype="bfloat16"),
                *[ac.hidden_states([[i + 1, i + 2]], layers=[-1], dtype="float32") for i in range(8)],
            )
            with pytest.raises(LayertapError) as e:
                await ac.hidden_states(inputs, layers=[17])
            assert e.value.status == 422
            return info, tok, many

    info, tok, many = asyncio.run(run())
    assert info == client.info()
    assert tok == client.tokenize(inputs)
    for dtype, got in (("float32", many[0]), ("bfloat16", many[1])):
        want = client.hidden_states(inputs, layers=[0, 2, -1], dtype=dtype)
        assert len(got) == len(want) == 3
        for a, b in zip(got, want):
            assert a.hidden_states.dtype == b.hidden_states.dtype
            assert np.array_equal(a.hidden_states, b.hidden_states)
            assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
            assert a.layers == b.layers
    for i, [r] in enumerate(many[2:]):
        assert r.input_ids.tolist() == [i + 1, i + 2]


def test_async_retries(stub):
    pytest.importorskip("httpx")
    from layertap_client import AsyncClient

    body, _, expect = _answer()
    busy = (429, {"Retry-After": "0"}, b'{"error":"full","type":"overloaded"}')
    s = stub([busy, busy, (200, {"Content-Encoding": "zstd"}, body)])

    async def run():
        async with AsyncClient(s.url) as ac:
            return await ac.hidden_states([[7], [8, 9]], layers=[-1])

    _check_answer(asyncio.run(run()), expect)
    assert len(s.requests) == 3
    assert s.requests[-1][2].get("accept-encoding") == "zstd"
