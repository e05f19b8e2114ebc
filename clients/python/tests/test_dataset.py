"""Tests of layertap_client.dataset on folders written by the real `layertap bulk`.

The core (BulkFolder: manifests, loading, checksums, sharding, shuffling) is
tested with numpy alone; the torch datasets and the example script need torch
and are skipped without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from layertap_client import ChecksumMismatch, Client, LayertapError
from layertap_client.dataset import BulkFolder, BulkFolderError, manifest_paths, shard_indices
from test_client import CHAT, HIDDEN, Server, _flip, run_bulk

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "drafter_data.py"

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install 'layertap-client[torch]')")

SAMPLES = [
    {"id": "ids-a", "input_ids": [5, 6, 7, 8, 9]},
    {"id": "text-b", "text": "The quick brown fox"},
    {"id": "chat-c", "messages": CHAT},
    {"id": "ids-d", "input_ids": list(range(1, 24))},
    {"id": "text-e", "text": "jumps over the lazy dog, twice."},
    {"id": "chat-f", "messages": [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "yo"}]},
    {"id": "ids-g", "input_ids": [42]},
    *({"id": f"n{k}", "input_ids": [k + 1, 2 * k + 3, 7]} for k in range(5)),  # 12 samples: hs_10 sorts after hs_9
]
IDS = sorted(s["id"] for s in SAMPLES)

# name -> (bulk flags, layers, dtype): what each folder was made with.
RUNS = {
    "f32": (["--layers", "1,2,-1", "--dtype", "float32"], [1, 2, -1], "float32"),
    "fp8": (["--layers", "1,-1", "--dtype", "fp8"], [1, -1], "fp8"),
    "bf16_last": (["--layers", "0,final_prenorm", "--dtype", "bfloat16", "--tokens", "last:3"], [0, "final_prenorm"], "bfloat16"),
}
# The speculators layout (hidden_states and token_ids only), checked on its own.
SPEC = (["--layers", "1,final_prenorm", "--dtype", "float32", "--layout", "speculators"], [1, "final_prenorm"], "float32")


def _input(s):
    return {k: v for k, v in s.items() if k != "id"}


@pytest.fixture(scope="module")
def bulk(tmp_path_factory):
    """{name: folder} made by `layertap bulk`, and the client's answers for the same inputs."""
    root = tmp_path_factory.mktemp("bulk")
    server = Server()
    try:
        folders, expected = {}, {}
        with Client(server.url) as client:
            for name, (flags, layers, dtype) in [*RUNS.items(), ("spec", SPEC)]:
                folders[name] = run_bulk(server.url, SAMPLES, root / name, flags)
                tokens = {"last": 3} if "--tokens" in flags else None
                expected[name] = {
                    s["id"]: client.hidden_states([_input(s)], layers=layers, dtype=dtype, tokens=tokens)[0]
                    for s in SAMPLES
                }
        yield folders, expected
    finally:
        server.stop()


def _check(sample, want, dtype):
    """A sample equals the client's answer for the same input."""
    h = np.asarray(_np(sample["hidden_states"]), dtype=np.float32)
    w = np.asarray(want.hidden_states, dtype=np.float32)
    assert h.shape == w.shape and h.shape[-1] == HIDDEN
    if dtype == "fp8":
        # Both dequantised from fp8: equal up to one fp8 step should the server's float32
        # sum differ in its last bit between the two batches (steps are <= 2^-3 of a row's amax).
        amax = np.abs(w).max(axis=-1, keepdims=True)
        assert np.all(np.abs(h - w) <= amax * 2**-3), np.abs(h - w).max()
        assert np.mean(h == w) > 0.99
    else:
        np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-5)
    assert _np(sample["input_ids"]).tolist() == want.input_ids.tolist()
    assert _np(sample["loss_mask"]).tolist() == want.loss_mask.tolist()
    if want.positions is not None:
        assert _np(sample["positions"]).tolist() == want.positions.tolist()
    else:
        assert "positions" not in sample


def _np(x):
    return x.float().numpy() if torch is not None and isinstance(x, torch.Tensor) and x.is_floating_point() else (
        x.numpy() if torch is not None and isinstance(x, torch.Tensor) else np.asarray(x)
    )


# -- the torch-free core ---------------------------------------------------------------------


def test_folder_gives_every_sample_with_the_clients_values(bulk):
    folders, expected = bulk
    for name, (_, _, dtype) in RUNS.items():
        f = BulkFolder(folders[name], bf16="float32")
        assert len(f) == len(SAMPLES) and sorted(f.ids) == IDS
        assert f.tokens == sum(len(w) for w in expected[name].values())
        seen = []
        for s in f.iter():
            seen.append(s["id"])
            _check(s, expected[name][s["id"]], dtype)
            assert s["hidden_states"].dtype == np.float32  # fp8 dequantised, bf16 widened
            assert "hidden_states_scale" not in s
        assert sorted(seen) == IDS
    # positions only where the run selected tokens.
    assert "positions" in BulkFolder(folders["bf16_last"]).load(0)
    assert "positions" not in BulkFolder(folders["f32"]).load(0)


def test_fp8_kept_quantised_when_asked(bulk):
    folders, expected = bulk
    f = BulkFolder(folders["fp8"], dequantize=False)
    for i in range(len(f)):
        s = f.load(i)
        q, scale = s["hidden_states"], s["hidden_states_scale"]
        assert q.dtype != np.float32 and scale.shape == q.shape[:2]
        deq = q.astype(np.float32) * scale[..., None]
        assert np.array_equal(deq, BulkFolder(folders["fp8"]).load(i)["hidden_states"])


def test_sharding_and_shuffling_cover_every_sample_once(bulk):
    folders, _ = bulk
    f = BulkFolder(folders["f32"])
    n = len(f)
    for world, workers in [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2)]:
        for shuffle in (False, True):
            got = [i for r in range(world) for w in range(workers) for i in f.indices(r, world, w, workers, shuffle, seed=7)]
            assert sorted(got) == list(range(n)), (world, workers, shuffle)
    # A rank's share (all its workers) differs from another's by one sample at most.
    for world in (2, 5):
        sizes = [sum(len(f.indices(r, world, w, 3)) for w in range(3)) for r in range(world)]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1, sizes
    plain = f.indices()
    assert plain == list(range(n))
    a, b = f.indices(shuffle=True, seed=1), f.indices(shuffle=True, seed=1)
    assert a == b and sorted(a) == plain
    orders = {tuple(f.indices(shuffle=True, seed=s)) for s in range(5)} | {tuple(f.indices(shuffle=True, epoch=e)) for e in range(5)}
    assert len(orders) > 5  # seeds and epochs change the order
    with pytest.raises(ValueError):
        shard_indices(5, rank=2, world_size=2)
    with pytest.raises(ValueError):
        shard_indices(5, worker=1, num_workers=1)


def test_sharded_manifests_are_read(bulk, tmp_path):
    folders, _ = bulk
    src = folders["f32"]
    lines = (src / "manifest.jsonl").read_text().splitlines()
    dst = tmp_path / "sharded"
    dst.mkdir()
    for entry in {json.loads(x)["file"] for x in lines}:
        (dst / entry).parent.mkdir(parents=True, exist_ok=True)
        (dst / entry).write_bytes((src / entry).read_bytes())
    # Two shards' manifests (one with a torn last line, as a crash leaves it) and no manifest.jsonl.
    (dst / "manifest-0-of-2.jsonl").write_text("\n".join(lines[:3]) + "\n")
    (dst / "manifest-1-of-2.jsonl").write_text("\n".join(lines[3:]) + '\n{"id": "torn", "fi')
    assert [p.name for p in manifest_paths(dst)] == ["manifest-0-of-2.jsonl", "manifest-1-of-2.jsonl"]
    f = BulkFolder(dst)
    assert sorted(f.ids) == IDS
    assert sorted(s["id"] for s in f.iter()) == IDS
    # Both names at once: manifest.jsonl and shards are all read, an id counted once.
    (dst / "manifest.jsonl").write_text(lines[0] + "\n")
    assert sorted(BulkFolder(dst).ids) == IDS
    with pytest.raises(FileNotFoundError):
        BulkFolder(tmp_path / "nothing-here")


def _corrupt_copy(src: Path, dst: Path, victim: str, tensor: str = "hidden_states") -> Path:
    for p in src.rglob("*"):
        if p.is_file():
            q = dst / p.relative_to(src)
            q.parent.mkdir(parents=True, exist_ok=True)
            q.write_bytes(p.read_bytes())
    entry = next(json.loads(x) for x in (dst / "manifest.jsonl").read_text().splitlines() if json.loads(x)["id"] == victim)
    f = dst / entry["file"]
    f.write_bytes(_flip(f.read_bytes(), tensor, 5))
    return f


def test_corrupt_file_is_reported_or_skipped(bulk, tmp_path):
    folders, expected = bulk
    bad = _corrupt_copy(folders["f32"], tmp_path / "c", "text-e")
    f = BulkFolder(tmp_path / "c")
    with pytest.raises(LayertapError) as e:
        list(f.iter())
    assert e.value.type == "checksum_mismatch" and str(bad) in e.value.message
    with pytest.warns(RuntimeWarning, match="text-e"):
        got = [s["id"] for s in f.iter(skip_errors=True)]
    assert sorted(got) == [i for i in IDS if i != "text-e"]
    assert [f.entries[i]["id"] for i in f.skipped] == ["text-e"]
    # The per-tensor checksums catch it even without the manifest's whole-file hash.
    lines = [json.loads(x) for x in (tmp_path / "c" / "manifest.jsonl").read_text().splitlines()]
    (tmp_path / "c" / "manifest.jsonl").write_text("".join(json.dumps({k: v for k, v in m.items() if k != "xxh64"}) + "\n" for m in lines))
    with pytest.raises(LayertapError, match="'hidden_states'"):
        list(BulkFolder(tmp_path / "c").iter())
    # verify=False reads it as it is: the flipped byte shows in the values.
    s = next(s for s in BulkFolder(tmp_path / "c", verify=False).iter() if s["id"] == "text-e")
    assert not np.array_equal(s["hidden_states"], expected["f32"]["text-e"].hidden_states)
    # A missing file is an error too (skipped alike).
    bad.unlink()
    with pytest.raises(FileNotFoundError):
        list(BulkFolder(tmp_path / "c").iter())
    with pytest.warns(RuntimeWarning):
        assert len(list(BulkFolder(tmp_path / "c").iter(skip_errors=True))) == len(SAMPLES) - 1


def test_manifest_paths_out_of_the_folder_are_refused(bulk, tmp_path):
    folders, expected = bulk
    src, outside = tmp_path / "src", tmp_path / "outside"
    subprocess.run(["cp", "-r", str(folders["f32"]), str(src)], check=True)
    outside.mkdir()
    manifest = src / "manifest.jsonl"
    original = manifest.read_text()

    def rewrite(edit):
        entries = [json.loads(line) for line in original.splitlines()]
        entries = [e for e in map(edit, entries) if e is not None]
        manifest.write_text("".join(json.dumps(e) + "\n" for e in entries))

    victim = next(json.loads(x) for x in original.splitlines() if json.loads(x)["id"] == "text-e")
    copy = outside / Path(victim["file"]).name
    copy.write_bytes((src / victim["file"]).read_bytes())  # intact: only its place is wrong
    for path, says in (
        (f"../outside/{copy.name}", "goes up out of the folder"),
        (str(copy), "is absolute"),
    ):
        rewrite(lambda e: {**e, "file": path} if e["id"] == "text-e" else e)
        with pytest.raises(BulkFolderError, match=says) as err:
            BulkFolder(src)
        assert repr(path) in str(err.value)
        loose = BulkFolder(src, strict=False)
        assert sorted(loose.ids) == [i for i in IDS if i != "text-e"]
        assert [(p["id"], p["file"]) for p in loose.problems] == [("text-e", path)]
        assert "inside the folder" in loose.problems[0]["error"]
    # A line without a file, and one without an id, are refused too.
    rewrite(lambda e: {k: v for k, v in e.items() if k != "file"} if e["id"] == "text-e" else e)
    with pytest.raises(BulkFolderError, match="no file for 'text-e'"):
        BulkFolder(src)
    # An id's last line counts: a later line recording a file inside the folder supersedes it.
    manifest.write_text(manifest.read_text() + json.dumps(victim) + "\n")
    assert sorted(BulkFolder(src).ids) == IDS
    manifest.write_text(original + json.dumps({"file": victim["file"]}) + "\n")
    with pytest.raises(BulkFolderError, match="line 13 records no id"):
        BulkFolder(src)
    # The recorded path a link leading out of the folder: refused when it is read.
    manifest.write_text(original)
    (src / victim["file"]).unlink()
    (src / victim["file"]).symlink_to(copy)
    f = BulkFolder(src)
    i = f.ids.index("text-e")
    with pytest.raises(BulkFolderError, match="leads out of the folder"):
        f.load(i)
    with pytest.warns(RuntimeWarning, match="text-e"):
        assert sorted(s["id"] for s in f.iter(skip_errors=True)) == [x for x in IDS if x != "text-e"]
    if torch is not None:
        from layertap_client.dataset import BulkIterableDataset

        with pytest.raises(BulkFolderError, match="leads out of the folder"):
            list(BulkIterableDataset(src))


def test_errors_pickle():
    import pickle

    for e in (LayertapError(422, "invalid_request", "bad layer"), ChecksumMismatch("f: tensor 'x'", None)):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and (back.status, back.type, back.message) == (e.status, e.type, e.message)
    assert ChecksumMismatch("m").type == "checksum_mismatch" and isinstance(ChecksumMismatch("m"), LayertapError)


def test_speculators_layout(bulk):
    folders, expected = bulk
    g = BulkFolder(folders["spec"])
    assert [e["file"] for e in g.entries] == [f"hs_{i}.safetensors" for i in range(len(SAMPLES))]
    assert [e["id"] for e in g.entries] == [s["id"] for s in SAMPLES]  # input order, 10 after 9
    for s in g.iter():
        w = expected["spec"][s["id"]]
        assert "loss_mask" not in s and s["input_ids"].tolist() == w.input_ids.tolist()
        np.testing.assert_allclose(s["hidden_states"], w.hidden_states, rtol=1e-5, atol=1e-5)


# -- the torch datasets ----------------------------------------------------------------------


@needs_torch
def test_torch_datasets_give_every_sample_once(bulk):
    from torch.utils.data import DataLoader

    from layertap_client.dataset import BulkDataset, BulkIterableDataset

    folders, expected = bulk
    for name, (_, _, dtype) in RUNS.items():
        ds = BulkDataset(folders[name])
        assert len(ds) == len(SAMPLES)
        items = [ds[i] for i in range(len(ds))]
        assert sorted(s["id"] for s in items) == IDS
        for s in items:
            assert isinstance(s["hidden_states"], torch.Tensor)
            assert s["hidden_states"].dtype == {"bfloat16": torch.bfloat16}.get(dtype, torch.float32)
            assert s["input_ids"].dtype == torch.int64 and s["loss_mask"].dtype == torch.uint8
            _check(s, expected[name][s["id"]], dtype)

        it = BulkIterableDataset(folders[name])
        assert sorted(s["id"] for s in it) == IDS
        loader = DataLoader(BulkIterableDataset(folders[name], shuffle=True, seed=3), batch_size=None, num_workers=2)
        got = [s["id"] for s in loader]
        assert Counter(got) == Counter(IDS)
        for s in loader:
            _check(s, expected[name][s["id"]], dtype)
        ranks = [[s["id"] for s in DataLoader(BulkIterableDataset(folders[name], rank=r, world_size=2), batch_size=None, num_workers=2)] for r in (0, 1)]
        assert not set(ranks[0]) & set(ranks[1]) and sorted(ranks[0] + ranks[1]) == IDS
        assert sorted([len(r) for r in ranks]) == [len(SAMPLES) // 2, len(SAMPLES) - len(SAMPLES) // 2]
        assert len(BulkIterableDataset(folders[name], rank=0, world_size=2)) == len(ranks[0])
        # A map-style dataset under DataLoader workers.
        got = [s["id"] for s in DataLoader(ds, batch_size=None, num_workers=2, shuffle=True)]
        assert sorted(got) == IDS


@needs_torch
def test_torch_epochs_reshuffle(bulk):
    from layertap_client.dataset import BulkIterableDataset

    folders, _ = bulk
    ds = BulkIterableDataset(folders["f32"], shuffle=True, seed=11)
    orders = []
    for epoch in range(4):
        ds.set_epoch(epoch)
        orders.append([s["id"] for s in ds])
    assert all(sorted(o) == IDS for o in orders) and len({tuple(o) for o in orders}) > 1
    ds.set_epoch(0)
    assert [s["id"] for s in ds] == orders[0]


@needs_torch
def test_torch_fp8_raw_and_corrupt(bulk, tmp_path):
    from torch.utils.data import DataLoader

    from layertap_client.dataset import BulkDataset, BulkIterableDataset

    folders, _ = bulk
    raw = BulkDataset(folders["fp8"], dequantize=False)[0]
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    deq = raw["hidden_states"].float() * raw["hidden_states_scale"][..., None]
    assert torch.equal(deq, BulkDataset(folders["fp8"])[0]["hidden_states"])

    _corrupt_copy(folders["f32"], tmp_path / "c", "chat-c")
    # Raised in a worker process, re-raised by the DataLoader as the same type.
    with pytest.raises(ChecksumMismatch, match="chat-c") as e:
        list(DataLoader(BulkIterableDataset(tmp_path / "c"), batch_size=None, num_workers=2))
    assert e.value.type == "checksum_mismatch"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [s["id"] for s in DataLoader(BulkIterableDataset(tmp_path / "c", skip_errors=True), batch_size=None, num_workers=2)]
        ds = BulkDataset(tmp_path / "c", skip_errors=True)
        items = [ds[i] for i in range(len(ds))]
    assert sorted(got) == [i for i in IDS if i != "chat-c"]
    assert sum(x is None for x in items) == 1


# -- the example -----------------------------------------------------------------------------


def test_example_script_runs(bulk):
    folders, _ = bulk
    for name, extra in [("f32", []), ("fp8", ["--pack"]), ("bf16_last", ["--workers", "0"])]:
        cmd = [sys.executable, str(EXAMPLE), str(folders[name]), "--batch-size", "3", "--workers", "2"] + extra
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if torch is None:
            assert p.returncode != 0 and "needs torch" in p.stderr, p.stderr
            continue
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"{len(SAMPLES)} samples" in p.stdout, p.stdout
        assert "hidden_states [" in p.stdout and "tokens/s" in p.stdout, p.stdout
