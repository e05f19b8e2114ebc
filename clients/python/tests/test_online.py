"""Tests of layertap_client.online against the real server (the tiny test model) and small
local servers that misbehave on purpose.

Every test checks what came out against what was asked for: each sample once, in the order
the seed says, with the client's own answer for the same input; and, from the server's
``layertap_tokens_total``, that no sample was asked for twice. The torch dataset is tested
when torch is installed (skipped otherwise).
"""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import requests

from layertap_client import Client, LayertapError
from layertap_client.dataset import BulkFolder
from layertap_client.online import OnlineSource, SampleError, epoch_order, open_samples, share
from test_client import Server, _binary, stub  # noqa: F401  (stub: the fixture, shared)

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install 'layertap-client[torch]')")

LAYERS = [1, -1]


def _samples(n: int = 36):
    """ids, text and chats of 1 to about 30 tokens, each with an id."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append({"id": f"ids-{i}", "input_ids": [(7 * i + k) % 500 + 1 for k in range(1 + i % 23)]})
        elif i % 3 == 1:
            out.append({"id": f"text-{i}", "text": " ".join(["the quick brown fox", "jumps", "over"][: 1 + i % 3]) + f" {i}"})
        else:
            chat = [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": "answer " * (1 + i % 4)}]
            out.append({"id": f"chat-{i}", "messages": chat})
    return out


SAMPLES = _samples()
IDS = [s["id"] for s in SAMPLES]


def _input(s):
    return {k: v for k, v in s.items() if k != "id"}


@pytest.fixture(scope="module")
def srv():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(srv):
    """{id: (hidden_states float32, input_ids, loss_mask)} from Client.hidden_states, one input at a time,
    and {id: tokens of the input}."""
    out, tokens = {}, {}
    with Client(srv.url) as c:
        for s in SAMPLES:
            [r] = c.hidden_states([_input(s)], layers=LAYERS, dtype="float32")
            out[s["id"]] = (r.hidden_states, r.input_ids.tolist(), r.loss_mask.tolist())
            tokens[s["id"]] = len(r.input_ids)
    return out, tokens


def _metric(url: str, name: str) -> int:
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"no {name} in /metrics")


def _tokens_total(url: str) -> int:
    """The tokens the server has computed, once it is idle (requests a closed source left in
    flight may still be running: they count before, not after)."""
    deadline = time.monotonic() + 20
    seen = []
    while time.monotonic() < deadline:
        busy = _metric(url, 'layertap_in_flight_requests{route="/v1/hidden-states"}')
        seen = (seen + [_metric(url, "layertap_tokens_total")])[-3:] if busy == 0 else []
        if len(seen) == 3 and len(set(seen)) == 1:
            return seen[0]
        time.sleep(0.2)
    raise AssertionError(f"{url} did not settle")


def _check(sample, reference):
    want_hs, want_ids, want_mask = reference[0][sample["id"]]
    assert sample["input_ids"].tolist() == want_ids
    assert sample["loss_mask"].tolist() == want_mask
    assert sample["hidden_states"].dtype == np.float32 and sample["hidden_states"].shape == want_hs.shape
    # bitwise: a sequence's states do not depend on the requests it shares a batch with
    assert np.array_equal(sample["hidden_states"], want_hs), sample["id"]


def _source(url, **kw):
    kw.setdefault("layers", LAYERS)
    kw.setdefault("dtype", "float32")
    kw.setdefault("request_tokens", 48)
    kw.setdefault("backoff", 0.2)
    kw.setdefault("max_backoff", 1.0)
    samples = kw.pop("samples", SAMPLES)
    return OnlineSource(samples, url, **kw)


# -- order, shares, exactly once ---------------------------------------------------------------------


def test_share_deals_every_position_once_in_the_dataloaders_order():
    for n, offset, world, workers, batch in [(37, 0, 2, 2, 3), (10, 4, 3, 2, 1), (5, 0, 4, 3, 2), (0, 0, 1, 1, 1)]:
        got = [p for r in range(world) for w in range(workers) for p in share(n, offset, r, world, w, workers, batch)]
        assert sorted(got) == list(range(offset, n))
        for r in range(world):
            # a DataLoader takes one batch from each worker in turn: that is the rank's order
            per_worker = [share(n, offset, r, world, w, workers, batch) for w in range(workers)]
            chunks = [[c[i : i + batch] for i in range(0, len(c), batch)] for c in per_worker]
            merged = [p for k in range(max(map(len, chunks), default=0)) for w in range(workers) if k < len(chunks[w]) for p in chunks[w][k]]
            assert merged == list(range(offset + r, n, world))


def test_exactly_once_over_two_ranks_and_two_workers(srv, reference):
    before = _tokens_total(srv.url)
    order = epoch_order(len(SAMPLES), True, 5, 2)
    got = {}
    for rank in range(2):
        for worker in range(2):
            src = _source(srv.url, shuffle=True, seed=5, rank=rank, world_size=2, worker=worker, num_workers=2, batch_size=3)
            src.set_epoch(2)
            got[rank, worker] = list(src)
            want = [IDS[order[p]] for p in share(len(SAMPLES), 0, rank, 2, worker, 2, 3)]
            assert [s["id"] for s in got[rank, worker]] == want
            assert src.stats()["retries"] == 0 and src.stats()["failures"] == 0
    ids = [s["id"] for part in got.values() for s in part]
    assert Counter(ids) == Counter(IDS)  # every sample, once
    assert all(len(part) > 0 for part in got.values())
    for part in got.values():
        for s in part:
            _check(s, reference)
    # the server computed every token of the input once: nothing was asked for twice
    assert _tokens_total(srv.url) - before == sum(reference[1].values())


def test_two_runs_give_the_same_bytes_in_the_same_order(srv):
    runs = []
    for request_tokens, max_requests in ((24, 1), (512, 4)):
        src = _source(srv.url, dtype="bfloat16", shuffle=True, seed=9, request_tokens=request_tokens, max_requests=max_requests)
        runs.append([(s["id"], s["hidden_states"].tobytes(), s["input_ids"].tobytes(), s["loss_mask"].tobytes()) for s in src])
    assert runs[0] == runs[1]
    assert [r[0] for r in runs[0]] == [IDS[i] for i in epoch_order(len(SAMPLES), True, 9, 0)]
    assert [r[0] for r in runs[0]] != IDS  # shuffled
    assert len({r[1] for r in runs[0]}) == len(SAMPLES)


def test_resume_from_a_mid_epoch_state_asks_only_for_the_rest(srv, reference):
    full = [s["id"] for s in _source(srv.url, shuffle=True, seed=3)]
    src = _source(srv.url, shuffle=True, seed=3, max_requests=2)
    it = iter(src)
    first = [next(it)["id"] for _ in range(13)]
    state = json.loads(json.dumps(src.state_dict()))  # what a checkpoint holds
    src.close()
    assert state["position"] == 13 and state["epoch"] == 0
    before = _tokens_total(srv.url)
    again = _source(srv.url, shuffle=True, seed=0)  # the seed comes from the state
    again.load_state_dict(state)
    assert len(again) == len(SAMPLES) - 13
    rest = list(again)
    assert first + [s["id"] for s in rest] == full
    for s in rest:
        _check(s, reference)
    assert _tokens_total(srv.url) - before == sum(reference[1][i] for i in full[13:])
    assert again.state_dict()["position"] == len(SAMPLES)  # the epoch is done
    with pytest.warns(RuntimeWarning, match="set_epoch"):
        assert list(again) == []
    again.set_epoch(1)
    assert len(list(again)) == len(SAMPLES)

    # two ranks stepping together, then three: the remaining samples, once
    parts, states = [], []
    for rank in range(2):
        r = _source(srv.url, shuffle=True, seed=4, rank=rank, world_size=2)
        it = iter(r)
        parts += [next(it)["id"] for _ in range(5)]
        states.append(r.state_dict())
        r.close()
    assert states[0]["position"] == states[1]["position"] == 10
    for rank in range(3):
        r = _source(srv.url, rank=rank, world_size=3, shuffle=True)
        r.load_state_dict(states[rank % 2])
        parts += [s["id"] for s in r]
    assert Counter(parts) == Counter(IDS)

    with pytest.raises(ValueError, match="36 samples"):
        _source(srv.url, samples=SAMPLES[:-1], shuffle=True).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        _source(srv.url).load_state_dict(state)


# -- servers that fail ----------------------------------------------------------------------------------


def test_a_server_killed_mid_epoch_loses_and_duplicates_nothing(srv, reference):
    other = Server()
    try:
        src = _source([srv.url, other.url], shuffle=True, seed=7, request_tokens=16, max_requests=4)
        it = iter(src)
        got = [next(it) for _ in range(12)]
        assert src.stats()["servers"][other.url]["samples"] > 0
        other.proc.send_signal(signal.SIGKILL)
        other.proc.wait()
        got += list(it)
        stats = src.stats()
    finally:
        other.stop()
    assert [s["id"] for s in got] == [IDS[i] for i in epoch_order(len(SAMPLES), True, 7, 0)]
    for s in got:
        _check(s, reference)
    killed = stats["servers"][other.url]
    assert killed["failures"] >= 1 and killed["state"] != "out"
    assert stats["servers"][srv.url]["samples"] + killed["samples"] >= len(SAMPLES)
    assert stats["failures"] == 0


class _Hang:
    """A server that accepts requests and never answers them."""

    def __init__(self):
        self.release = threading.Event()
        self.requests = 0
        hang = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                hang.requests += 1
                hang.release.wait(60)

            do_GET = do_POST

            def log_message(self, *a):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def info(srv):
    """The real server's /v1/info, for stub servers to answer first."""
    return requests.get(srv.url + "/v1/info", timeout=10).content


def test_a_server_that_throttles_fails_its_selfcheck_or_hangs_is_routed_around(srv, reference, stub, info):
    throttle = stub([(429, {"Retry-After": "1"}, b'{"error": "queue full", "type": "overloaded"}')])
    selfcheck = stub([(503, {}, b'{"error": "the self-check failed", "type": "selfcheck_failed"}')])
    down = stub([(500, {}, b'{"error": "boom", "type": "internal"}')])
    hang = _Hang()
    try:
        for bad, key, timeout in ((throttle, "throttled", 600), (selfcheck, "failures", 600), (down, "failures", 600), (hang, "failures", 1.5)):
            t0 = time.monotonic()
            src = _source([bad.url, srv.url], shuffle=True, seed=1, timeout=timeout, max_requests=3)
            got = list(src)
            elapsed = time.monotonic() - t0
            stats = src.stats()
            assert [s["id"] for s in got] == [IDS[i] for i in epoch_order(len(SAMPLES), True, 1, 0)], bad.url
            for s in got:
                _check(s, reference)
            assert stats["servers"][bad.url][key] >= 1, stats
            assert stats["servers"][bad.url]["samples"] == 0 and stats["failures"] == 0
            assert elapsed < 30, f"{bad.url}: {elapsed:.1f} s"
        # out for good after its first answer: at most the requests already in flight then (3) reached it
        assert 1 <= [r[0] for r in selfcheck.requests].count("POST") <= 3
        assert stats["servers"][srv.url]["samples"] == len(SAMPLES)
    finally:
        hang.close()

    # every server out for good: a clear error, not a wait
    failed = stub([(200, {}, info), (503, {}, b'{"error": "the self-check failed", "type": "selfcheck_failed"}')])
    with pytest.raises(LayertapError, match="out for good: HTTP 503 selfcheck_failed") as e:
        list(_source([failed.url], timeout=5, max_requests=1))
    assert e.value.type == "no_server" and len(failed.requests) == 2
    # no server answers at all: the same, with each one's reason
    with pytest.raises(LayertapError, match="bad key") as e:
        list(_source([stub([(401, {}, b'{"error": "bad key", "type": "unauthorized"}')]).url]))
    assert e.value.status == 401 and e.value.type == "no_server"
    # a 4xx that is no sample's fault (a wrong URL, say) raises at once, naming the server
    wrong = stub([(200, {}, info), (404, {}, b"not found")])
    with pytest.raises(LayertapError, match="no sample causes") as e:
        list(_source([wrong.url], max_requests=1))
    assert e.value.status == 404 and len(wrong.requests) == 2


def test_a_sample_that_fails_every_retry_is_named(stub, info):
    down = stub([(200, {}, info), (503, {}, b'{"error": "draining", "type": "unavailable"}')])
    src = _source([down.url], retries=2, backoff=0.01, max_backoff=0.02, max_requests=1)
    with pytest.raises(SampleError, match=r"sample 'ids-0' \(row 0\): failed 3 times") as e:
        list(src)
    assert e.value.sample_id == "ids-0" and e.value.status == 503
    assert [r[1] for r in down.requests] == ["/v1/info"] + ["/v1/hidden-states"] * 3


# -- flow -----------------------------------------------------------------------------------------------


def test_the_buffer_bound_holds_when_the_consumer_stops(srv):
    samples = [{"id": f"n{i}", "input_ids": [(i + k) % 400 + 1 for k in range(8)]} for i in range(60)]
    row = len(LAYERS) * 64 * 4  # float32 rows of the tiny model
    bound = 40 * row * 3  # about 15 samples of 8 tokens
    before = _tokens_total(srv.url)
    src = _source(srv.url, samples=samples, request_tokens=16, max_requests=4, max_buffered_bytes=bound)
    it = iter(src)
    first = next(it)
    # wait for the fetching to stop (it must, with the consumer not taking anything)
    deadline = time.monotonic() + 20
    last = None
    while time.monotonic() < deadline:
        st = src.stats()
        assert st["buffered_bytes"] + st["reserved_bytes"] <= bound
        key = (st["buffered_samples"], st["in_flight"])
        if st["in_flight"] == 0 and key == last:
            break
        last = key
        time.sleep(0.3)
    st = src.stats()
    assert st["in_flight"] == 0 and 0 < st["buffered_samples"] < len(samples) - 1
    assert st["peak_bytes"] <= bound and st["buffered_bytes"] > bound // 3
    fetched = _tokens_total(srv.url) - before
    assert fetched == 8 * (1 + st["buffered_samples"])  # nothing more was asked for
    rest = list(it)
    assert [first["id"]] + [s["id"] for s in rest] == [s["id"] for s in samples]
    assert src._closed_stats["peak_bytes"] <= bound


def test_requests_are_sized_so_that_every_one_in_flight_fits_the_bound(srv):
    samples = [{"id": f"r{i}", "input_ids": [(i + k) % 400 + 1 for k in range(8)]} for i in range(24)]
    row = len(LAYERS) * 64 * 4 + 17  # float32 rows of the tiny model, with input_ids, loss_mask, cu_seqlens
    src = _source(srv.url, samples=samples, request_tokens=64, max_requests=2, max_buffered_bytes=2 * 17 * row)
    got = [s["id"] for s in src]
    assert got == [s["id"] for s in samples]
    # 17 tokens a request fit (2 samples of 8), not the 64 asked for: 12 requests, not 3
    assert src.stats()["servers"][srv.url]["requests"] == 12


@pytest.mark.parametrize("encoding", ["identity", "zstd"])
def test_answers_are_read_into_the_samples_never_held_whole(srv, encoding):
    """An answer streams into the samples' own buffers: the memory the source allocates while it
    reads one answer of 16 MB is that of the samples it holds, not twice or three times it (a
    body held whole, a decompressed copy)."""
    import tracemalloc

    samples = [{"id": f"m{i}", "input_ids": [(3 * i + k) % 500 + 1 for k in range(200)]} for i in range(80)]
    src = _source(srv.url, samples=samples, layers=[0, 1, 2, 3], request_tokens=16000, max_requests=1, encoding=encoding)
    src.info()  # /v1/info before the count starts
    tracemalloc.start()
    try:
        got = list(src)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    held = sum(v.nbytes for s in got for v in s.values() if isinstance(v, np.ndarray))
    assert [s["id"] for s in got] == [s["id"] for s in samples]
    assert held > 16_000 * 4 * 64 * 4 and src.stats()["servers"][srv.url]["requests"] == 1
    assert peak < held * 1.1 + (3 << 20), f"{encoding}: {peak / 2**20:.1f} MiB allocated for {held / 2**20:.1f} MiB of samples"
    with Client(srv.url) as c:
        [r] = c.hidden_states([_input(samples[37])], layers=[0, 1, 2, 3], dtype="float32")
    assert np.array_equal(got[37]["hidden_states"], r.hidden_states)


def _answer(url: str, inputs, encoding: str = "identity") -> bytes:
    r = requests.post(url + "/v1/hidden-states", json={"inputs": inputs, "layers": LAYERS, "dtype": "float32"}, headers={"accept-encoding": encoding}, timeout=60)
    assert r.status_code == 200 and r.headers.get("content-encoding", "identity") == encoding
    return r.raw.read() if False else r.content if encoding == "identity" else _raw(url, inputs)


def _raw(url: str, inputs) -> bytes:
    """The zstd body as sent (requests would decode it where it can)."""
    import urllib.request

    req = urllib.request.Request(url + "/v1/hidden-states", data=json.dumps({"inputs": inputs, "layers": LAYERS, "dtype": "float32"}).encode(), method="POST")
    req.add_header("content-type", "application/json")
    req.add_header("accept-encoding", "zstd")
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers.get("content-encoding") == "zstd"
        return r.read()


def _states_first(raw: bytes) -> bytes:
    """The same answer with its hidden states first in the data section (as older servers wrote it)."""
    import struct

    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: (k != "hidden_states", header[k]["data_offsets"][0]))
    out, at = [], 0
    for k in names:
        b, e = header[k]["data_offsets"]
        out.append(data[b:e])
        header[k]["data_offsets"] = [at, at + e - b]
        at += e - b
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(out)


def test_the_decoder_reads_either_tensor_order_and_refuses_a_damaged_answer(srv, reference):
    import zstandard

    from layertap_client._common import LayertapError as Err
    from layertap_client.online import _Decoder, _Short

    inputs = [_input(s) for s in SAMPLES[:3]]
    raw = _answer(srv.url, inputs)
    import struct

    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__") == header["hidden_states"]["data_offsets"][1]
    old = _states_first(raw)
    assert old != raw and header["hidden_states"]["data_offsets"][0] > 0
    dec = _Decoder(False, True, None)
    for body in (raw, old, zstandard.ZstdCompressor().compress(raw), zstandard.ZstdCompressor().compress(old), _raw(srv.url, inputs)):
        got = dec.decode(body, 3)
        assert len(got) == 3
        for (sample, nbytes, seen), s in zip(got, SAMPLES[:3]):
            _check({"id": s["id"], **sample}, reference)
            assert seen == len(sample["input_ids"]) and nbytes == sum(v.nbytes for v in sample.values())
        # each sample in a buffer of its own
        assert not np.shares_memory(got[0][0]["hidden_states"], got[1][0]["hidden_states"])
    for body, err in (
        (raw[:-1], _Short),  # cut
        (raw + b"\0", _Short),  # more than the header says
        (raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:], Err),  # a changed byte of the states
        (old[:-1], _Short),
    ):
        with pytest.raises(err) as e:
            dec.decode(body, 3)
        if err is Err:
            assert e.value.type == "checksum_mismatch" and "hidden_states" in e.value.message
    with pytest.raises(Err, match="cu_seqlens"):
        dec.decode(raw, 2)  # an answer of another number of inputs


@needs_torch
def test_in_a_dataloader_worker_samples_are_read_into_shared_memory(srv, reference):
    """A worker's samples are read straight into torch shared memory, every tensor of a sample a
    view of its one buffer, so the DataLoader hands them to the main process without a copy."""
    from layertap_client.online import _Decoder

    raw = _answer(srv.url, [_input(s) for s in SAMPLES[:3]])
    dec = _Decoder(True, True, None)
    dec._worker_flag = True  # as get_worker_info() says inside a worker
    for (sample, _, _), s in zip(dec.decode(raw, 3), SAMPLES[:3]):
        storages = {t.untyped_storage().data_ptr() for t in sample.values()}
        assert len(storages) == 1 and all(t.is_shared() for t in sample.values())
        _check({"id": s["id"], **{k: v.numpy() for k, v in sample.items()}}, reference)
    dec._worker_flag = False
    sample = dec.decode(raw, 3)[0][0]
    assert not sample["hidden_states"].is_shared()


class _HostTorch:
    """torch's allocation as the pinned arena uses it, in plain host memory (no GPU here): what
    it allocates is counted."""

    uint8 = np.uint8

    def __init__(self):
        self.allocated = []
        self.pinned = []

    def empty(self, n, dtype, pin_memory):
        self.allocated.append(n)
        self.pinned.append(pin_memory)
        return np.zeros(n, dtype=dtype)


def test_the_pinned_arena_cuts_buffers_from_slabs_and_takes_them_back():
    """Pinned memory is allocated in slabs, up front or when the slabs are full, never per
    sample: buffers held together never overlap, buffers given back are merged and reused
    without a new allocation, a sample larger than a slab gets a buffer of its own that is
    reused by size, and a buffer comes back only once its copy's event says it is done."""
    from layertap_client.online import _PinnedArena

    fake = _HostTorch()
    slab = 64 * _PinnedArena.ALIGN
    arena = _PinnedArena(fake, slab)
    arena.warm(2 * slab)
    arena._warming.join()
    assert fake.allocated == [slab, slab] and arena.bytes == 2 * slab and arena.buffers == 2
    assert fake.pinned == [True, True]
    pageable = _HostTorch()  # pin_memory=False: the same slabs, in pageable memory
    other = _PinnedArena(pageable, slab, pinned=False)
    other.warm(2 * slab)
    other._warming.join()
    other.give(other.take(slab + 1)[1])
    assert pageable.allocated == [slab, slab, 2 * slab] and pageable.pinned == [False, False, False]
    rng = np.random.default_rng(0)
    held = []
    for _ in range(400):
        if held and (rng.random() < 0.45 or len(held) > 12):
            buf, token = held.pop(int(rng.integers(len(held))))
            assert (buf == buf[0]).all()  # nobody else wrote into it while it was held
            arena.give(token)
            continue
        n = int(rng.integers(1, 10 * _PinnedArena.ALIGN))
        buf, token = arena.take(n)
        assert len(buf) == n
        buf[:] = len(held) + 1
        held.append((buf, token))
        views = [(b.__array_interface__["data"][0], len(b)) for b, _ in held]
        views.sort()
        assert all(a + n_a <= b for (a, n_a), (b, _) in zip(views, views[1:]))  # no two overlap
    for _, token in held:
        arena.give(token)
    assert arena.free == [[(0, slab)]] * len(arena.slabs)  # everything merged back
    grown = len(fake.allocated)
    for _ in range(50):  # the arena as it is now serves these without allocating
        arena.give(arena.take(3 * _PinnedArena.ALIGN)[1])
    assert len(fake.allocated) == grown
    big, token = arena.take(slab + 1)
    assert len(big) == slab + 1 and fake.allocated[-1] == 2 * slab
    arena.give(token)
    assert arena.take(slab + 5)[0].__array_interface__["data"][0] == big.__array_interface__["data"][0]
    assert len(fake.allocated) == grown + 1

    class Event:
        done = False

        def query(self):
            return self.done

    arena2 = _PinnedArena(_HostTorch(), slab)
    buf, token = arena2.take(slab)  # the whole slab
    ev = Event()
    arena2.after(ev, token)
    arena2.take(1)  # its copy not done: a second slab
    assert len(arena2.slabs) == 2
    ev.done = True
    arena2.take(slab)  # done: the first slab is taken again
    assert len(arena2.slabs) == 2 and arena2.free[0] == []


@needs_torch
def test_a_failing_answer_gives_its_pinned_buffers_back(srv):
    """An answer cut or damaged mid-read gives the buffers it took back to the arena (its thread
    was their only writer), so failed requests do not use the pinned memory up."""
    import torch

    from layertap_client._common import LayertapError as Err
    from layertap_client.online import _Decoder, _PinnedArena, _Short

    class CpuTorch:  # pinned memory needs a GPU: ordinary torch tensors stand in for it
        uint8 = torch.uint8

        def empty(self, n, dtype, pin_memory):
            return torch.zeros(n, dtype=dtype)

    raw = _answer(srv.url, [_input(s) for s in SAMPLES[:3]])
    arena = _PinnedArena(CpuTorch(), 1 << 20)
    dec = _Decoder(True, True, None)
    dec.device, dec.arena = "a GPU", arena  # the arena's path, without the copy to a device
    for body, err in ((raw[:-1], _Short), (raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:], Err)):
        with pytest.raises(err):
            dec.decode(body, 3)
        assert arena.slabs and arena.free == [[(0, 1 << 20)]] * len(arena.slabs)


def test_identity_and_zstd_give_the_same_samples(srv):
    runs = [[(s["id"], s["hidden_states"].tobytes()) for s in _source(srv.url, dtype="bfloat16", encoding=e, request_tokens=64)] for e in ("identity", "zstd")]
    assert runs[0] == runs[1] and len(runs[0]) == len(SAMPLES)
    with pytest.raises(ValueError, match="encoding"):
        _source(srv.url, encoding="gzip")
    with pytest.raises(ValueError, match="not a server URL"):
        _source("ftp://127.0.0.1:1")


# -- samples refused --------------------------------------------------------------------------------------


def test_a_refused_sample_raises_naming_it_or_is_replaced_and_counted(srv, reference):
    bad = {"id": "too-big", "input_ids": [3, 4, 100000]}  # past the tiny model's vocabulary: 422
    samples = SAMPLES[:5] + [bad] + SAMPLES[5:]
    src = _source(srv.url, samples=samples)
    got = []
    with pytest.raises(SampleError, match=r"sample 'too-big' \(row 5\): .*422") as e:
        for s in src:
            got.append(s["id"])
    assert got == IDS[:5]  # everything before it was handed out first
    assert e.value.sample_id == "too-big" and e.value.row == 5 and e.value.status == 422

    src = _source(srv.url, samples=samples, on_error="replace")
    out = list(src)
    assert [s["id"] for s in out] == IDS[:5] + [IDS[5]] + IDS[5:]  # the next of the order took its place
    for s in out:
        _check(s, reference)
    st = src.stats()
    assert st["replacements"] == 1 and st["failures"] == 1
    assert st["replaced"][0]["id"] == "too-big" and st["replaced"][0]["replaced_by"] == IDS[5]
    assert "422" in st["replaced"][0]["error"]


# -- the input, as `layertap bulk` reads it -----------------------------------------------------------


def test_chat_template_kwargs_go_to_every_chat_under_its_own(srv):
    from layertap_client.online import _with_template_kwargs

    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "thinking": "Two and two."}]
    samples = [
        {"id": "a", "messages": chat},
        {"id": "b", "messages": chat, "chat_template_kwargs": {"enable_thinking": True}},
        {"id": "c", "text": "plain text"},
    ]
    kw = {"reasoning_effort": "high", "enable_thinking": False}
    merged = _with_template_kwargs({"messages": chat, "chat_template_kwargs": {"enable_thinking": True}}, kw)
    assert merged["chat_template_kwargs"] == {"reasoning_effort": "high", "enable_thinking": True}
    assert _with_template_kwargs({"text": "x"}, kw) == {"text": "x"}
    # The server takes them (the test model's template reads neither: the same states as without).
    plain = {s["id"]: s for s in OnlineSource(samples, srv.url, layers=LAYERS, dtype="float32")}
    got = {s["id"]: s for s in OnlineSource(samples, srv.url, layers=LAYERS, dtype="float32", chat_template_kwargs=kw)}
    for k in "abc":
        assert np.array_equal(got[k]["hidden_states"], plain[k]["hidden_states"])
        assert np.array_equal(got[k]["loss_mask"], plain[k]["loss_mask"])
    with pytest.raises(ValueError, match="sets 'messages'"):
        OnlineSource(samples, srv.url, layers=LAYERS, chat_template_kwargs={"messages": []})
    with pytest.raises(TypeError, match="mapping"):
        OnlineSource(samples, srv.url, layers=LAYERS, chat_template_kwargs=["enable_thinking"])


def test_jsonl_and_sharegpt_inputs_match_layertap_bulk(srv, tmp_path):
    lines = [json.dumps(s) for s in SAMPLES[:9]] + ["", json.dumps({"text": "no id here"})]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    sharegpt = [
        {"id": "sg-0", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
        {"id": 17, "conversations": [{"from": "system", "value": "Be brief."}, {"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}]},
    ]
    sg_path = tmp_path / "sharegpt.jsonl"
    sg_path.write_text("".join(json.dumps(s) + "\n" for s in sharegpt))
    for inp, extra, kw in ((path, [], {}), (sg_path, ["--messages-column", "conversations"], {"messages_column": "conversations"})):
        out = tmp_path / f"bulk-{inp.stem}"
        cmd = [str(_binary()), "bulk", "--server", srv.url, "--input", str(inp), "--out", str(out), "--layers", "1,-1", "--dtype", "float32", *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        folder = BulkFolder(out)
        want = {folder.entries[i]["id"]: folder.load(i) for i in range(len(folder))}
        got = {s["id"]: s for s in OnlineSource(str(inp), srv.url, layers=LAYERS, dtype="float32", **kw)}
        assert set(got) == set(want) and len(got) == len([x for x in inp.read_text().splitlines() if x.strip()])
        for k, w in want.items():
            for key in ("hidden_states", "input_ids", "loss_mask"):
                assert np.array_equal(got[k][key], w[key]), (k, key)
        # ids as bulk makes them: numbers as text, a line without one by its number from 1
        assert ("17" if inp == sg_path else "line-11") in got

    # rows that cannot be requests, with bulk's messages
    rows = [
        '{"id": "a", "messages": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}',
        "not json",
        '{"id": "c", "input_ids": [1, 2]}',
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    s = open_samples(str(bad))
    with pytest.raises(SampleError, match=r"sample 'a' \(row 0\): line 1: message 1: its from is \"bot\", not one of human"):
        s.get(0)
    with pytest.raises(SampleError, match=r"sample 'line-2' \(row 1\): line 2: not JSON"):
        s.get(1)
    assert s.get(2) == ("c", {"input_ids": [1, 2]})
    with pytest.raises(SampleError, match=r"sample 'a'"):
        list(OnlineSource(str(bad), srv.url, layers=LAYERS))
    out = list(OnlineSource(str(bad), srv.url, layers=LAYERS, on_error="replace"))
    assert [x["id"] for x in out] == ["c", "c", "c"]


def test_parquet_and_datasets_inputs(srv, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": ["p0", "p1", "p2"],
            "conversations": [
                [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
                [{"from": "user", "value": "x"}, {"from": "assistant", "value": "y"}],
                None,
            ],
            "other": [1, 2, 3],
        }
    )
    path = tmp_path / "chats.parquet"
    pq.write_table(table, path)
    s = open_samples(str(path), messages_column="conversations")
    assert s.get(0) == ("p0", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
    with pytest.raises(SampleError, match=r"sample 'p2' \(row 2\): column \"conversations\": the value is null"):
        s.get(2)
    got = list(OnlineSource(str(path), srv.url, layers=LAYERS, dtype="float32", messages_column="conversations", on_error="replace"))
    assert [x["id"] for x in got] == ["p0", "p1", "p0"]
    with Client(srv.url) as c:
        [r] = c.hidden_states([s.get(1)[1]], layers=LAYERS, dtype="float32")
    assert np.array_equal(got[1]["hidden_states"], r.hidden_states)
    with pytest.raises(ValueError, match="exactly one of"):
        open_samples(str(path))


def test_fp8_selection_and_logprobs_are_the_clients(srv):
    samples = SAMPLES[1:13]  # with target, a request of one-token inputs only is refused (no row has a next token)
    kw = dict(layers=[2, "final_prenorm"], dtype="fp8", tokens={"last": 3}, logprobs={"top_k": 4, "target": True})
    got = list(OnlineSource(samples, srv.url, request_tokens=40, tokens="last:3", **{k: v for k, v in kw.items() if k != "tokens"}))
    raw = list(OnlineSource(samples, srv.url, dequantize=False, **kw))
    with Client(srv.url) as c:
        want = c.hidden_states([_input(s) for s in samples], **kw)
    for g, q, w in zip(got, raw, want):
        assert g["hidden_states"].dtype == np.float32
        np.testing.assert_array_equal(g["hidden_states"], w.hidden_states)
        for key in ("input_ids", "loss_mask", "positions", "topk_ids", "topk_logprobs", "target_logprobs"):
            np.testing.assert_array_equal(g[key], getattr(w, key), err_msg=key)
        assert "hidden_states_scale" not in g and q["hidden_states_scale"].shape == (len(w.input_ids), 2)
        deq = np.asarray(q["hidden_states"]).astype(np.float32) if q["hidden_states"].dtype != np.uint8 else None
        if deq is not None:
            np.testing.assert_array_equal(deq * q["hidden_states_scale"][..., None], g["hidden_states"])
    assert [len(g["input_ids"]) for g in got] == [min(3, len(w.input_ids)) for w in want]


# -- torch ---------------------------------------------------------------------------------------------


@needs_torch
def test_torch_dataloader_workers_give_the_ranks_order_and_resume(srv, reference):
    from torch.utils.data import DataLoader

    from layertap_client.online import OnlineIterableDataset

    order = [IDS[i] for i in epoch_order(len(SAMPLES), True, 2, 0)]
    ds = OnlineIterableDataset(SAMPLES, srv.url, layers=LAYERS, dtype="float32", shuffle=True, seed=2, batch_size=4, request_tokens=48)
    assert len(ds) == len(SAMPLES)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list)
    batches = list(loader)
    assert [s["id"] for b in batches for s in b] == order
    assert all(len(b) == 4 for b in batches)  # 36 samples: no short batch
    s = batches[0][0]
    assert isinstance(s["hidden_states"], torch.Tensor) and s["hidden_states"].dtype == torch.float32
    assert s["input_ids"].dtype == torch.int64 and s["loss_mask"].dtype == torch.uint8
    _check({k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}, reference)

    # a crash after 3 steps: the state says 12 samples, and the resumed loader gives the rest
    state = ds.state_dict(consumed=3 * 4)
    assert state["position"] == 12
    again = OnlineIterableDataset(SAMPLES, srv.url, layers=LAYERS, dtype="float32", shuffle=True, batch_size=4)
    again.load_state_dict(state)
    rest = [s["id"] for b in DataLoader(again, batch_size=4, num_workers=2, collate_fn=list) for s in b]
    assert rest == order[12:]


def test_the_online_drafter_example_runs(srv):
    example = Path(__file__).resolve().parents[1] / "examples" / "drafter_online.py"
    cmd = [sys.executable, str(example), "--server", srv.url, "--steps", "4", "--log-every", "2", "--top-k", "4", "--buffer-mib", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if torch is None:
        assert p.returncode == 2 and "needs torch" in p.stderr, p.stderr
        return
    assert p.returncode == 0, p.stdout + p.stderr
    assert "done: 4 steps" in p.stdout and "layers [2, 1, 0] of 3" in p.stdout, p.stdout
    if not torch.cuda.is_available():  # --device names a GPU torch does not see: said, not a traceback
        p = subprocess.run(cmd + ["--device", "cuda:0"], capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and "torch sees no CUDA device" in p.stderr, p.stderr


class _FakeDataset:
    """What open_samples reads of a Hugging Face datasets.Dataset: column_names and columns by name."""

    def __init__(self, columns):
        self.columns = columns
        self.column_names = list(columns)

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, key):
        return self.columns[key]


def test_datasets_and_lists_are_read_by_column():
    ds = _FakeDataset({"id": [5, "b"], "conversations": [[{"from": "gpt", "value": "x"}], [{"from": "alien", "value": "y"}]], "n": [1, 2]})
    s = open_samples(ds, messages_column="conversations")
    assert len(s) == 2 and s.get(0) == ("5", {"messages": [{"role": "assistant", "content": "x"}]})
    with pytest.raises(SampleError, match=r"sample 'b' \(row 1\): column \"conversations\": message 0: its from is \"alien\""):
        s.get(1)
    assert open_samples(_FakeDataset({"text": ["a", "b"], "other": [1, 2]})).get(1) == ("1", {"text": "b"})
    with pytest.raises(ValueError, match="name the input column"):
        open_samples(_FakeDataset({"text": ["a"], "messages": [None]}))
    lst = open_samples(["hello", [1, 2, 3], {"id": "c", "prompt": "p"}, {"input_ids": []}], text_column="prompt")
    assert [lst.get(i) for i in range(3)] == [("0", {"text": "hello"}), ("1", {"input_ids": [1, 2, 3]}), ("c", {"text": "p"})]
    with pytest.raises(SampleError, match=r"sample '3' \(row 3\): no key \"prompt\""):
        lst.get(3)
