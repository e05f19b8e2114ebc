"""Tests of layertap_client against the real layertap server and small stub servers.

The server binary is $LAYERTAP_BIN, or target/debug/layertap under the
repository root; the model is the tiny Qwen3 fixture the Rust tests use.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
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
import xxhash
import zstandard

import layertap_client
from layertap_client import Client, LayertapError, _safetensors
from layertap_client._common import (
    decompress,
    hidden_states_body,
    normalize_dtype,
    normalize_inputs,
    parse_hidden_states,
    tokenize_body,
)

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


def run_bulk(url: str, samples, out: Path, flags) -> Path:
    """`layertap bulk` of the binary under test: ``samples`` (dicts, one JSONL line each) from
    the server at ``url`` into ``out``, with ``flags``; fails the test on a non-zero exit."""
    data = out.parent / f"{out.name}.input.jsonl"
    data.write_text("".join(json.dumps(s) + "\n" for s in samples))
    cmd = [str(_binary()), "bulk", "--server", url, "--input", str(data), "--out", str(out), *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


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


def test_a_chat_carries_its_template_variables_and_reasoning(client):
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "Two and two."}]
    with_kwargs = {"messages": chat, "chat_template_kwargs": {"reasoning_effort": "high"}}
    a, b = client.tokenize([chat, with_kwargs])
    assert a == b and 1 in a["loss_mask"]  # the test model's template reads neither
    with pytest.raises(Exception, match="sets itself"):
        client.tokenize([{"messages": chat, "chat_template_kwargs": {"bos_token": "x"}}])


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


# == issue 13: fp8, token selection, final_prenorm, checksums ===============================

def _ml_dtypes():
    return pytest.importorskip("ml_dtypes")


# -- fp8 decoding without a server ---------------------------------------------------------


def test_fp8_table_matches_ml_dtypes_for_all_256_patterns(monkeypatch):
    mld = _ml_dtypes()
    bits = np.arange(256, dtype=np.uint8)
    ours = _safetensors.f8_e4m3_bits_to_float32(bits)
    theirs = bits.view(mld.float8_e4m3fn).astype(np.float32)
    assert ours.dtype == np.float32 and ours.shape == (256,)
    nan = np.isnan(theirs)
    assert nan.sum() == 2 and np.array_equal(np.isnan(ours), nan)  # 0x7F and 0xFF
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.array_equal(np.signbit(ours[~nan]), np.signbit(theirs[~nan]))  # -0.0 included
    # A few patterns straight from the definition, independent of ml_dtypes.
    assert ours[0x38] == 1.0 and ours[0x7E] == 448.0 and ours[0xFE] == -448.0
    assert ours[0x01] == 2.0**-9 and ours[0x08] == 2.0**-6 and ours[0x07] == 7 * 2.0**-9
    assert np.isinf(ours).sum() == 0
    # load() widens F8_E4M3 through the table when ml_dtypes is missing, keeps it fp8 otherwise.
    raw = _write_safetensors({"q": ("F8_E4M3", [16, 16], bits.tobytes())})
    assert _safetensors.load(raw)[0]["q"].dtype == mld.float8_e4m3fn
    monkeypatch.setattr(_safetensors, "_ml_dtypes", None)
    widened = _safetensors.load(raw)[0]["q"]
    assert widened.dtype == np.float32 and widened.shape == (16, 16)
    assert np.array_equal(widened.reshape(-1), ours, equal_nan=True)


def _st_bytes(arrays, metadata) -> bytes:
    """safetensors bytes written by the reference implementation (the safetensors package)."""
    st = pytest.importorskip("safetensors")
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    specs = {
        k: st.TensorSpec(dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
        for k, a in arrays.items()
    }
    return bytes(st.serialize(specs, metadata=metadata))


def _checksums(arrays) -> str:
    return json.dumps({k: xxhash.xxh64(np.ascontiguousarray(a).tobytes()).hexdigest() for k, a in arrays.items()})


def _fp8_arrays(lengths=(2, 0, 3), n_layers=2, hidden=8, seed=0):
    """An fp8 answer as the server would quantise it: (arrays, float32 originals)."""
    mld = _ml_dtypes()
    rng = np.random.default_rng(seed)
    rows = sum(lengths)
    x = rng.standard_normal((rows, n_layers, hidden)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-3, 4, size=(rows, n_layers, 1)).astype(np.float32)
    x[0, 1] = 0.0  # an all-zero row: scale 0
    amax = np.abs(x).max(axis=-1)
    scale = (amax / np.float32(448)).astype(np.float32)
    safe = np.where(scale > 0, scale, 1).astype(np.float32)
    q = (x / safe[..., None]).astype(mld.float8_e4m3fn)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = np.concatenate([np.arange(n) + 3 for n in lengths]).astype(np.int64)
    arrays = {
        "hidden_states": q,
        "hidden_states_scale": scale,
        "input_ids": np.arange(100, 100 + rows, dtype=np.int64),
        "loss_mask": (np.arange(rows) % 2).astype(np.uint8),
        "cu_seqlens": cu,
        "positions": positions,
    }
    return arrays, x


def _fp8_metadata(arrays, **extra):
    md = {
        "model": "stub",
        "dtype": "float8_e4m3fn",
        "layers": '[1,"final_prenorm"]',
        "tokens": "ranges",
        "format": "layertap/1",
        "nonfinite": '{"final_prenorm":2}',
        "checksum_algorithm": "xxh64",
        "checksums": _checksums(arrays),
    }
    md.update(extra)
    return {k: v for k, v in md.items() if v is not None}


def _tensor_span(raw: bytes, name: str):
    """(begin, end) of a tensor's bytes within a safetensors file."""
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _flip(raw: bytes, name: str, k: int = 0) -> bytes:
    begin, end = _tensor_span(raw, name)
    assert end - begin > k
    out = bytearray(raw)
    out[begin + k] ^= 0x01
    return bytes(out)


def _rel_err_per_row(got, want):
    """max over rows and layers of ||got - want|| / ||want|| (rows of zeros must stay zero)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    num = np.linalg.norm(got - want, axis=-1)
    den = np.linalg.norm(want, axis=-1)
    assert np.all(num[den == 0] == 0)
    return float((num[den > 0] / den[den > 0]).max()) if (den > 0).any() else 0.0


def test_synthetic_fp8_answer_dequantises_and_splits(stub, monkeypatch):
    mld = _ml_dtypes()
    arrays, x = _fp8_arrays()
    raw = _st_bytes(arrays, _fp8_metadata(arrays))
    body = zstandard.ZstdCompressor().compress(raw)
    s = stub([(200, {"Content-Encoding": "zstd"}, body)])
    c = Client(s.url)
    ranges = [[[3, 5]], [], [[3, 6]]]
    results = c.hidden_states(
        [[1] * 5, [2] * 4, [3] * 6], layers=[1, "final_prenorm"], dtype="fp8", tokens=ranges, allow_nonfinite=True
    )
    assert json.loads(s.requests[-1][3]) == {
        "inputs": [{"input_ids": [1] * 5}, {"input_ids": [2] * 4}, {"input_ids": [3] * 6}],
        "layers": [1, "final_prenorm"],
        "dtype": "float8_e4m3fn",
        "tokens": [[[3, 5]], [], [[3, 6]]],
        "allow_nonfinite": True,
    }
    assert [len(r) for r in results] == [2, 0, 3]
    assert [r.positions.tolist() for r in results] == [[3, 4], [], [3, 4, 5]]
    assert [r.input_ids.tolist() for r in results] == [[100, 101], [], [102, 103, 104]]
    assert [r.loss_mask.tolist() for r in results] == [[0, 1], [], [0, 1, 0]]
    want = arrays["hidden_states"].astype(np.float32) * arrays["hidden_states_scale"][..., None]
    got = np.concatenate([r.hidden_states for r in results])
    assert got.dtype == np.float32 and got.shape == (5, 2, 8)
    assert np.array_equal(got, want)
    assert _rel_err_per_row(got, x) < 1 / 16
    assert not got[0, 1].any()  # the all-zero row
    for r in results:
        assert r.layers == [1, "final_prenorm"]
        assert r.hidden_states_scale is None
        assert r.nonfinite == {"final_prenorm": 2}
        assert r.hidden_states.shape[1:] == (2, 8)
    assert results[1].hidden_states.shape == (0, 2, 8)

    # dequantize=False: the fp8 values and their scales, split the same way.
    s = stub([(200, {}, raw)])
    results = Client(s.url).hidden_states([[1]] * 3, layers=[1, "final_prenorm"], dtype="fp8", dequantize=False)
    assert [len(r) for r in results] == [2, 0, 3]
    assert all(r.hidden_states.dtype == mld.float8_e4m3fn for r in results)
    q = np.concatenate([r.hidden_states for r in results])
    assert np.array_equal(q.view(np.uint8), arrays["hidden_states"].view(np.uint8))
    sc = np.concatenate([r.hidden_states_scale for r in results])
    assert sc.dtype == np.float32 and np.array_equal(sc, arrays["hidden_states_scale"])
    assert results[1].hidden_states_scale.shape == (0, 2)
    # Without ml_dtypes the raw fp8 values come as their uint8 bits.
    monkeypatch.setattr(_safetensors, "_ml_dtypes", None)
    bits = parse_hidden_states(raw, dequantize=False)
    assert all(r.hidden_states.dtype == np.uint8 for r in bits)
    assert np.array_equal(np.concatenate([r.hidden_states for r in bits]), arrays["hidden_states"].view(np.uint8))
    # ... and dequantising does not need ml_dtypes at all.
    assert np.array_equal(np.concatenate([r.hidden_states for r in parse_hidden_states(raw)]), want)


def test_answer_without_selection_has_no_positions():
    arrays, _ = _fp8_arrays(lengths=(3, 1))
    del arrays["positions"]
    raw = _st_bytes(arrays, _fp8_metadata(arrays, tokens="all", nonfinite=None))
    results = parse_hidden_states(raw)
    assert [len(r) for r in results] == [3, 1]
    assert all(r.positions is None and r.nonfinite == {} for r in results)


def test_fp8_answer_without_scale_is_refused():
    arrays, _ = _fp8_arrays()
    del arrays["hidden_states_scale"]
    with pytest.raises(LayertapError) as e:
        parse_hidden_states(_st_bytes(arrays, _fp8_metadata(arrays)))
    assert e.value.type == "bad_answer" and "hidden_states_scale" in e.value.message


# -- checksums without a server ------------------------------------------------------------


def test_flipped_byte_is_a_checksum_mismatch(stub):
    arrays, _ = _fp8_arrays()
    md = _fp8_metadata(arrays)
    raw = _st_bytes(arrays, md)
    assert len(parse_hidden_states(raw)) == 3
    bad = _flip(raw, "hidden_states", 5)
    begin, end = _tensor_span(bad, "hidden_states")
    got = xxhash.xxh64(bad[begin:end]).hexdigest()
    want = json.loads(md["checksums"])["hidden_states"]
    assert got != want
    s = stub([(200, {"Content-Encoding": "zstd"}, zstandard.ZstdCompressor().compress(bad))])
    with pytest.raises(LayertapError) as e:
        Client(s.url).hidden_states([[1]], layers=[1])
    assert (e.value.status, e.value.type) == (200, "checksum_mismatch")
    assert "hidden_states" in e.value.message and got in e.value.message and want in e.value.message
    assert len(s.requests) == 1  # not retried
    # Every tensor is covered, not only hidden_states.
    for name in arrays:
        with pytest.raises(LayertapError) as e:
            parse_hidden_states(_flip(raw, name), status=None)
        assert e.value.type == "checksum_mismatch" and repr(name) in e.value.message and e.value.status is None


def test_missing_extra_or_unknown_checksums_are_errors():
    arrays, _ = _fp8_arrays()
    sums = json.loads(_checksums(arrays))
    missing = dict(sums)
    del missing["positions"]
    cases = {
        "no entry": _fp8_metadata(arrays, checksums=json.dumps(missing)),
        "not in it": _fp8_metadata(arrays, checksums=json.dumps(dict(sums, extra="0" * 16))),
        "unknown": _fp8_metadata(arrays, checksum_algorithm="sha256"),
        "no checksums": _fp8_metadata(arrays, checksums=None),
        "unknown checksum_algorithm None": _fp8_metadata(arrays, checksum_algorithm=None),
        "not JSON": _fp8_metadata(arrays, checksums="{"),
    }
    for why, md in cases.items():
        with pytest.raises(LayertapError) as e:
            parse_hidden_states(_st_bytes(arrays, md))
        assert e.value.type == "checksum_mismatch", why
        assert why in e.value.message, (why, e.value.message)
    assert "'positions'" in _raised(parse_hidden_states, _st_bytes(arrays, cases["no entry"])).message
    # An answer without any checksum metadata (an older server) is accepted unverified.
    plain = _fp8_metadata(arrays, checksum_algorithm=None, checksums=None)
    assert len(parse_hidden_states(_st_bytes(arrays, plain))) == 3


def _raised(f, *a, **k) -> LayertapError:
    with pytest.raises(LayertapError) as e:
        f(*a, **k)
    return e.value


def test_verify_file(tmp_path):
    arrays, _ = _fp8_arrays()
    md = _fp8_metadata(arrays)
    raw = _st_bytes(arrays, md)
    good = tmp_path / "good.safetensors"
    good.write_bytes(raw)
    assert layertap_client.verify_file(good) == md
    assert layertap_client.verify_file(str(good)) == md
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_flip(raw, "loss_mask"))
    e = _raised(layertap_client.verify_file, bad)
    assert (e.status, e.type) == (None, "checksum_mismatch") and "'loss_mask'" in e.message and str(bad) in e.message
    bare = tmp_path / "bare.safetensors"
    bare.write_bytes(_st_bytes(arrays, {"model": "stub"}))
    assert _raised(layertap_client.verify_file, bare).type == "checksum_mismatch"
    assert layertap_client.verify_file(bare, require=False) == {"model": "stub"}
    with pytest.raises(_safetensors.SafetensorsError):
        truncated = tmp_path / "truncated.safetensors"
        truncated.write_bytes(raw[:-1])
        layertap_client.verify_file(truncated)


# -- request arguments without a server ----------------------------------------------------


def test_new_request_arguments_are_normalised():
    class FakeTorchDtype:  # what str(torch.float8_e4m3fn) looks like, without torch
        def __str__(self):
            return "torch.float8_e4m3fn"

    for d in ("float8_e4m3fn", "fp8", "f8_e4m3", "FP8", FakeTorchDtype()):
        assert normalize_dtype(d) == "float8_e4m3fn"
    assert normalize_dtype(np.float32) == "float32"
    mld = pytest.importorskip("ml_dtypes")
    assert normalize_dtype(mld.float8_e4m3fn) == "float8_e4m3fn"
    assert normalize_dtype(np.dtype(mld.float8_e4m3fn)) == "float8_e4m3fn"
    assert normalize_dtype(mld.bfloat16) == "bfloat16"
    with pytest.raises(ValueError):
        normalize_dtype("float8_e5m2")
    try:
        import torch
    except ImportError:
        pass
    else:
        assert normalize_dtype(torch.float8_e4m3fn) == "float8_e4m3fn"

    def body(**k):
        return hidden_states_body([[1, 2]], k.pop("layers", [-1]), None, **k)

    assert body() == {"inputs": [{"input_ids": [1, 2]}], "layers": [-1]}  # nothing new unless asked
    assert body(allow_nonfinite=False) == body()
    assert body(allow_nonfinite=True)["allow_nonfinite"] is True
    assert body(layers=[2, np.int64(3), -1, "final_prenorm"])["layers"] == [2, 3, -1, "final_prenorm"]
    assert body(layers="final_prenorm")["layers"] == ["final_prenorm"]
    assert body(layers=[1, "other_label"])["layers"] == [1, "other_label"]  # the server judges labels
    for bad in ([1.0], [True], [None], {"final_prenorm": 1}):
        with pytest.raises(TypeError):
            body(layers=bad)
    assert body(tokens="all")["tokens"] == "all"
    assert body(tokens="assistant")["tokens"] == "assistant"
    assert body(tokens={"last": np.int64(2)})["tokens"] == {"last": 2}
    assert body(tokens=[[(0, 4)], np.array([[2, 5], [7, 9]])])["tokens"] == [[[0, 4]], [[2, 5], [7, 9]]]
    # Only the shape is checked here; the values (k >= 1, bounds, order, count) are the server's to judge.
    assert body(tokens={"last": 0})["tokens"] == {"last": 0}
    assert body(tokens=[[[5, 2]]])["tokens"] == [[[5, 2]]]
    for bad in ("none", {"first": 2}, {"last": "2"}, {"last": 2, "x": 1}, 3, [[1, 2]], [[[1, 2, 3]]], [[[0.5, 2]]]):
        with pytest.raises((TypeError, ValueError)):
            body(tokens=bad)


# -- against the real server ---------------------------------------------------------------

INPUTS = [list(range(1, 11)), "Hello, world! again", CHAT, [{"role": "user", "content": "no answer here"}]]


def test_fp8_round_trip_is_close_to_float32(client):
    mld = _ml_dtypes()
    layers = [0, 2, -1, "final_prenorm"]
    f32 = client.hidden_states(INPUTS, layers=layers, dtype="float32")
    fp8 = client.hidden_states(INPUTS, layers=layers, dtype="fp8")
    raw = client.hidden_states(INPUTS, layers=layers, dtype="float8_e4m3fn", dequantize=False)
    assert len(f32) == len(fp8) == len(raw) == len(INPUTS)
    for a, b, q in zip(f32, fp8, raw):
        assert b.metadata["dtype"] == q.metadata["dtype"] == "float8_e4m3fn"
        assert a.layers == b.layers == q.layers == [0, 2, NUM_LAYERS, "final_prenorm"]
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
        assert b.hidden_states.dtype == np.float32 and b.hidden_states.shape == a.hidden_states.shape
        assert b.hidden_states_scale is None
        err = _rel_err_per_row(b.hidden_states, a.hidden_states)
        assert err < 1 / 16, err
        assert not np.array_equal(b.hidden_states, a.hidden_states)  # it really went through fp8
        # The raw answer: fp8 values and one scale per row and layer, amax / 448.
        assert q.hidden_states.dtype == mld.float8_e4m3fn and q.hidden_states.shape == a.hidden_states.shape
        assert q.hidden_states_scale.dtype == np.float32
        assert q.hidden_states_scale.shape == a.hidden_states.shape[:2]
        amax = np.abs(a.hidden_states).max(axis=-1)
        np.testing.assert_allclose(q.hidden_states_scale, amax / 448, rtol=1e-5, atol=0)
        values = q.hidden_states.astype(np.float32)
        assert np.isfinite(values).all()
        live = q.hidden_states_scale > 0
        assert np.array_equal(np.abs(values).max(axis=-1)[live], np.full(live.sum(), 448, np.float32))
        assert np.array_equal(values * q.hidden_states_scale[..., None], b.hidden_states)


def test_fp8_as_torch(client):
    torch = pytest.importorskip("torch")
    [deq] = client.hidden_states([CHAT], layers=[1, -1], dtype=torch.float8_e4m3fn, as_torch=True)
    [raw] = client.hidden_states([CHAT], layers=[1, -1], dtype="fp8", as_torch=True, dequantize=False)
    [ref] = client.hidden_states([CHAT], layers=[1, -1], dtype="fp8")
    assert deq.hidden_states.dtype == torch.float32
    assert torch.equal(deq.hidden_states, torch.from_numpy(ref.hidden_states))
    assert raw.hidden_states.dtype == torch.float8_e4m3fn and raw.hidden_states_scale.dtype == torch.float32
    assert torch.equal(raw.hidden_states.float() * raw.hidden_states_scale[..., None], deq.hidden_states)


def _check_selection(full, sel, positions):
    """sel holds exactly the rows of full at positions, in order."""
    positions = np.asarray(positions, dtype=np.int64)
    assert sel.positions is not None and sel.positions.dtype == np.int64
    assert sel.positions.tolist() == positions.tolist()
    assert sel.input_ids.tolist() == full.input_ids[positions].tolist()
    assert sel.loss_mask.tolist() == full.loss_mask[positions].tolist()
    assert sel.hidden_states.shape == (len(positions),) + full.hidden_states.shape[1:]
    np.testing.assert_allclose(sel.hidden_states, full.hidden_states[positions], rtol=1e-5, atol=1e-6)
    assert sel.layers == full.layers


def test_token_selections(client):
    inputs = INPUTS + [[7]]
    layers = [1, -1]
    full = client.hidden_states(inputs, layers=layers, dtype="float32")
    lengths = [len(r) for r in full]
    assert lengths[-1] == 1 and all(n >= 8 for n in lengths[:-1])
    for r in full:
        assert r.positions is None and r.metadata["tokens"] == "all"
    for r in client.hidden_states(inputs, layers=layers, dtype="float32", tokens="all"):
        assert r.positions is None and r.metadata["tokens"] == "all"

    masks = [r.loss_mask for r in full]
    assert masks[3].sum() == 0 and 0 < masks[2].sum() < lengths[2] and masks[0].all()
    assistant = client.hidden_states(inputs, layers=layers, dtype="float32", tokens="assistant")
    assert len(assistant) == len(inputs)
    for f, r in zip(full, assistant):
        assert r.metadata["tokens"] == "assistant"
        _check_selection(f, r, np.nonzero(f.loss_mask)[0])
        assert r.loss_mask.all()
    assert len(assistant[3]) == 0 and assistant[3].hidden_states.shape == (0, 2, HIDDEN)

    last = client.hidden_states(inputs, layers=layers, dtype="float32", tokens={"last": 2})
    for f, r, n in zip(full, last, lengths):
        assert r.metadata["tokens"] == "last:2"
        _check_selection(f, r, range(max(0, n - 2), n))
    assert len(last[-1]) == 1  # shorter than k: all its tokens

    ranges = [[[0, 2], [5, 7]], [[1, 3]], [[0, 1], [lengths[2] - 2, lengths[2]]], [[0, lengths[3]]], [[0, 1]]]
    picked = client.hidden_states(inputs, layers=layers, dtype="float32", tokens=ranges)
    for f, r, rs in zip(full, picked, ranges):
        assert r.metadata["tokens"] == "ranges"
        _check_selection(f, r, [p for a, b in rs for p in range(a, b)])


def test_invalid_token_selections_are_422(client):
    inputs = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    bad = {
        "end past the input": [[[0, 1]], [[0, 2]], [[1, 4]]],
        "overlapping": [[[0, 1]], [[0, 1]], [[0, 2], [1, 3]]],
        "descending": [[[0, 1]], [[0, 1]], [[2, 3], [0, 1]]],
        "empty range": [[[0, 1]], [[0, 1]], [[1, 1]]],
    }
    for why, tokens in bad.items():
        e = _raised(client.hidden_states, inputs, layers=[-1], tokens=tokens)
        assert (e.status, e.type) == (422, "invalid_request"), why
        assert re.search(r"\b2\b", e.message), (why, e.message)  # names the input (index 2)
    for tokens in ([[[0, 1]], [[0, 1]]], {"last": 0}):  # one entry short; k < 1
        e = _raised(client.hidden_states, inputs, layers=[-1], tokens=tokens)
        assert (e.status, e.type) == (422, "invalid_request"), tokens


def _rms_norm(x, weight, eps):
    x = np.asarray(x, np.float64)
    return weight * x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)


def test_final_prenorm(client):
    config = json.loads((MODEL / "config.json").read_text())
    weights, _ = layertap_client.load_safetensors_file(str(MODEL / "model.safetensors"))
    norm = weights["model.norm.weight"].astype(np.float64)
    results = client.hidden_states(INPUTS, layers=[-1, "final_prenorm", NUM_LAYERS - 1], dtype="float32")
    for r in results:
        assert r.layers == [NUM_LAYERS, "final_prenorm", NUM_LAYERS - 1]
        assert json.loads(r.metadata["layers"]) == [NUM_LAYERS, "final_prenorm", NUM_LAYERS - 1]
        final, pre, before = r.hidden_states[:, 0], r.hidden_states[:, 1], r.hidden_states[:, 2]
        assert np.isfinite(pre).all()
        assert not np.allclose(pre, final, rtol=1e-2, atol=1e-3)
        assert not np.allclose(pre, before, rtol=1e-2, atol=1e-3)
        # The final state is the final norm of the pre-norm state.
        np.testing.assert_allclose(_rms_norm(pre, norm, config["rms_norm_eps"]), final, rtol=1e-4, atol=1e-5)
    [only] = client.hidden_states([INPUTS[0]], layers="final_prenorm", dtype="float32")
    np.testing.assert_allclose(only.hidden_states[:, 0], results[0].hidden_states[:, 1], rtol=1e-5, atol=1e-6)
    for layers in (["final_prenorm", 1, "final_prenorm"], [1, "final_postnorm"]):  # twice; unknown label
        e = _raised(client.hidden_states, [[1, 2]], layers=layers)
        assert (e.status, e.type) == (422, "invalid_request"), layers


def _post_raw(server, body) -> bytes:
    r = requests.post(
        server.url + "/v1/hidden-states", json=body, headers={"Accept-Encoding": "zstd"}, timeout=60, stream=True
    )
    assert r.status_code == 200, r.text
    assert r.headers["Content-Encoding"] == "zstd"
    compressed = r.raw.read(decode_content=False)
    raw = decompress(compressed)
    # The server's frames record the file's size, so decoders can allocate once.
    assert zstandard.frame_content_size(compressed) == len(raw)
    return raw


def test_frames_with_and_without_their_size_and_concatenated_frames():
    a, b = b"first frame " * 1000, b"second frame " * 500
    sized = zstandard.ZstdCompressor(level=1, write_content_size=True)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False)
    one = sized.compress(a)
    assert zstandard.frame_content_size(one) == len(a)
    assert decompress(one) == a
    # Two frames that both record their size: every frame is read, not just the first.
    assert decompress(one + sized.compress(b)) == a + b
    assert decompress(unsized.compress(a) + unsized.compress(b)) == a + b
    assert decompress(a) == a  # not zstd: as is


def test_checksums_on_real_answers(server, client, tmp_path):
    bodies = [
        {"inputs": normalize_inputs(INPUTS), "layers": [0, -1], "dtype": "bfloat16"},
        {
            "inputs": normalize_inputs(INPUTS),
            "layers": [2, "final_prenorm"],
            "dtype": "fp8",
            "tokens": {"last": 3},
        },
    ]
    for body in bodies:
        raw = _post_raw(server, body)
        tensors, md, stored = _safetensors.parse_raw(raw)
        assert md["checksum_algorithm"] == "xxh64"
        sums = json.loads(md["checksums"])
        assert sorted(sums) == sorted(tensors)
        for name, digest in sums.items():
            assert re.fullmatch(r"[0-9a-f]{16}", digest), digest
            assert digest == xxhash.xxh64(bytes(stored[name])).hexdigest(), name
        assert json.loads(md["nonfinite"]) == {}
        results = parse_hidden_states(raw)
        assert len(results) == len(INPUTS) and all(r.nonfinite == {} for r in results)
        for name in tensors:
            if _tensor_span(raw, name)[1] > _tensor_span(raw, name)[0]:
                e = _raised(parse_hidden_states, _flip(raw, name))
                assert e.type == "checksum_mismatch" and repr(name) in e.message
        f = tmp_path / "answer.safetensors"
        f.write_bytes(raw)
        assert layertap_client.verify_file(f) == md
    assert "positions" in tensors and "hidden_states_scale" in tensors  # the fp8 selection's extras are covered


def test_bulk_files_verify(server, tmp_path):
    data = tmp_path / "data.jsonl"
    lines = [{"id": "a", "input_ids": [1, 2, 3]}, {"id": "b", "text": "bulk text"}, {"id": "c", "messages": CHAT}]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "hs"
    cmd = [str(_binary()), "bulk", "--server", server.url, "--input", str(data), "--out", str(out)]
    p = subprocess.run(cmd + ["--layers", "1,-1", "--dtype", "float32"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    manifest = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(m["id"] for m in manifest) == ["a", "b", "c"]
    for m in manifest:
        md = layertap_client.verify_file(out / m["file"])
        assert md["checksum_algorithm"] == "xxh64"
        assert set(json.loads(md["checksums"])) >= {"hidden_states", "input_ids", "loss_mask"}
    f = out / manifest[0]["file"]
    f.write_bytes(_flip(f.read_bytes(), "hidden_states", 3))
    assert _raised(layertap_client.verify_file, f).type == "checksum_mismatch"


def test_async_new_arguments(client, server):
    pytest.importorskip("httpx")
    from layertap_client import AsyncClient

    kw = dict(layers=[1, "final_prenorm"], dtype="fp8", tokens="assistant")

    async def run():
        async with AsyncClient(server.url) as ac:
            return await asyncio.gather(
                ac.hidden_states(INPUTS, **kw), ac.hidden_states(INPUTS, dequantize=False, **kw)
            )

    deq, raw = asyncio.run(run())
    want = client.hidden_states(INPUTS, **kw)
    for a, b, w in zip(deq, raw, want):
        assert a.layers == w.layers == [1, "final_prenorm"]
        assert np.array_equal(a.hidden_states, w.hidden_states) and np.array_equal(a.positions, w.positions)
        assert b.hidden_states_scale is not None and b.hidden_states_scale.shape == (len(w), 2)
        assert np.array_equal(b.hidden_states.astype(np.float32) * b.hidden_states_scale[..., None], w.hidden_states)


# -- next-token log-probabilities -----------------------------------------------------------


def _logprob_reference():
    tensors, _ = layertap_client.load_safetensors_file(str(MODEL / "logprobs.safetensors"))
    n = len([k for k in tensors if k.endswith(".topk_ids")])
    assert n > 0
    return [{k: tensors[f"seq{i}.{k}"] for k in ("input_ids", "positions", "topk_ids", "topk_logprobs", "target_logprobs")} for i in range(n)]


def test_logprobs_match_transformers_for_the_rows_returned(client):
    ref = _logprob_reference()
    inputs = [[int(x) for x in r["input_ids"]] for r in ref]
    ranges = [[[int(p), int(p) + 1] for p in r["positions"]] for r in ref]
    out = client.hidden_states(inputs, layers=[], dtype="float32", tokens=ranges, logprobs={"top_k": 16, "target": True})
    for r, res in zip(ref, out):
        assert res.hidden_states.shape == (len(r["positions"]), 0, HIDDEN)
        assert res.topk_ids.shape == (len(r["positions"]), 16) and res.topk_ids.dtype == np.int64
        assert res.topk_ids.tolist() == r["topk_ids"].tolist()
        np.testing.assert_allclose(res.topk_logprobs, r["topk_logprobs"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(res.target_logprobs, r["target_logprobs"], rtol=0, atol=1e-5, equal_nan=True)
    # An int asks for the top k alone; layers and logprobs mix.
    one = client.hidden_states([inputs[1]], layers=[-1], dtype="float32", logprobs=3)[0]
    assert one.topk_ids.shape == (len(inputs[1]), 3) and one.target_logprobs is None
    assert one.hidden_states.shape == (len(inputs[1]), 1, HIDDEN)
    plain = client.hidden_states([inputs[1]], layers=[-1], dtype="float32")[0]
    assert plain.topk_ids is None and plain.topk_logprobs is None
    assert client.info()["max_top_k"] == 64


def test_logprobs_arguments_are_checked_and_refusals_explained(client):
    assert hidden_states_body([[1]], [], None, logprobs=4)["logprobs"] == {"top_k": 4}
    assert hidden_states_body([[1]], [], None, logprobs={"top_k": 2, "target": True})["logprobs"] == {"top_k": 2, "target": True}
    with pytest.raises(ValueError):
        hidden_states_body([[1]], [], None, logprobs={"k": 2})
    with pytest.raises(TypeError):
        hidden_states_body([[1]], [], None, logprobs="8")
    with pytest.raises(LayertapError) as e:
        client.hidden_states([[1, 2]], layers=[1], logprobs=65)
    assert e.value.status == 422 and "--max-top-k" in str(e.value)
    with pytest.raises(LayertapError) as e:
        client.hidden_states([[1, 2]], layers=[1], tokens={"last": 1}, logprobs={"top_k": 2, "target": True})
    assert e.value.status == 422 and "target" in str(e.value)


def test_boolean_options_must_be_bools_not_truthy_values():
    # The string "false" is truthy: judged by bool() it would be sent as true. Each option the
    # client sends as a JSON boolean takes True or False and nothing else, naming itself.
    for bad in ("false", "true", "", 0, 1, None, [False]):
        with pytest.raises(TypeError, match=r'logprobs\["target"\]'):
            hidden_states_body([[1]], [], None, logprobs={"top_k": 2, "target": bad})
        with pytest.raises(TypeError, match="allow_nonfinite"):
            hidden_states_body([[1]], [], None, allow_nonfinite=bad)
        with pytest.raises(TypeError, match="split_special_tokens"):
            hidden_states_body([[1]], [], None, split_special_tokens=bad)
        with pytest.raises(TypeError, match="split_special_tokens"):
            tokenize_body([[1]], split_special_tokens=bad)
    for flag in (False, True, np.bool_(False), np.bool_(True)):
        sent = hidden_states_body([[1]], [], None, split_special_tokens=flag, allow_nonfinite=flag,
                                  logprobs={"top_k": 2, "target": flag})
        assert sent.get("allow_nonfinite", False) is bool(flag)
        assert sent.get("split_special_tokens", False) is bool(flag)
        assert sent["logprobs"].get("target", False) is bool(flag)
        assert tokenize_body([[1]], split_special_tokens=flag).get("split_special_tokens", False) is bool(flag)
    assert hidden_states_body([[1]], [], None, logprobs={"top_k": 2})["logprobs"] == {"top_k": 2}


def test_async_client_returns_logprobs(server):
    pytest.importorskip("httpx")
    import asyncio

    from layertap_client import AsyncClient

    async def run():
        async with AsyncClient(server.url) as ac:
            return await ac.hidden_states([[5, 6, 7]], layers=[], logprobs={"top_k": 2, "target": True})

    r = asyncio.run(run())[0]
    assert r.topk_ids.shape == (3, 2) and r.topk_logprobs.shape == (3, 2)
    assert np.isnan(r.target_logprobs[-1]) and not np.isnan(r.target_logprobs[0])
