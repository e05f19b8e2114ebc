"""Tests of ``python -m layertap_client.convert`` on folders written by the real ``layertap bulk``.

The converted files are read back two ways: with a torch-free reader of torch's zip
format (below; it runs everywhere), and with ``torch.load`` itself where torch is
installed. ``scripts/trainers/check_readers.py`` runs SpecForge's own offline readers on
them.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from layertap_client import _torchsave
from layertap_client.convert import FAILURES, MANIFEST, ConvertError, convert_folder
from layertap_client.dataset import BulkFolder
from test_client import HIDDEN, NUM_LAYERS, Server, _flip, run_bulk

try:
    import torch
except ImportError:
    torch = None

SAMPLES = [
    {"id": "ids-a", "input_ids": [5, 6, 7, 8, 9]},
    {"id": "text-b", "text": "The quick brown fox"},
    {"id": "chat-c", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    {"id": "ids-d", "input_ids": list(range(1, 24))},
    {"id": "ids-e", "input_ids": [42]},
    *({"id": f"n{k}", "input_ids": [k + 1, 2 * k + 3, 7]} for k in range(4)),
]

# name -> bulk flags
RUNS = {
    "bf16": ["--layers", f"1,2,{NUM_LAYERS}", "--dtype", "bfloat16"],
    "f32": ["--layers", "0,2,-1", "--dtype", "float32"],
    "fp8": ["--layers", "1,-1", "--dtype", "fp8"],
    "prenorm": ["--layers", "1,final_prenorm", "--dtype", "bfloat16"],
    "last": ["--layers", "1,-1", "--dtype", "bfloat16", "--tokens", "last:2"],
    "spec": ["--layers", "1,final_prenorm", "--dtype", "float32", "--layout", "speculators"],
    "fp8_prenorm": ["--layers", "1,final_prenorm", "--dtype", "fp8"],
    "spec_fp8": ["--layers", "1,final_prenorm", "--dtype", "fp8", "--layout", "speculators"],
}


@pytest.fixture(scope="module")
def bulk(tmp_path_factory):
    root = tmp_path_factory.mktemp("bulk")
    server = Server()
    try:
        yield {name: run_bulk(server.url, SAMPLES, root / name, flags) for name, flags in RUNS.items()}
    finally:
        server.stop()


# -- a torch-free reader of torch's zip format -----------------------------------------------

_NUMPY = {name: dtype for name, dtype in _torchsave.STORAGES.items()}


class _Storage:
    def __init__(self, kind, data):
        self.kind, self.data = kind, data


def read_ckpt(path):
    """``{name: (storage class, array)}`` of a file in torch.save's zip format, without torch."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        stem = names[0].split("/")[0]
        assert zf.read(f"{stem}/byteorder") == b"little"
        assert zf.read(f"{stem}/version").strip() == b"3"
        for info in zf.infolist():  # stored, each record aligned for mmap
            assert info.compress_type == zipfile.ZIP_STORED
            with open(path, "rb") as f:
                f.seek(info.header_offset + 26)
                n, m = np.frombuffer(f.read(4), dtype="<u2")
            assert (info.header_offset + 30 + n + m) % 64 == 0, info.filename

        class Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                    return lambda st, off, size, stride, grad, hooks: (
                        st.kind,
                        np.lib.stride_tricks.as_strided(
                            st.data[off:], size, [s * st.data.itemsize for s in stride]
                        ).copy(),
                    )
                if (module, name) == ("collections", "OrderedDict"):
                    return dict
                if module == "torch" and name in _NUMPY:
                    return name
                raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

            def persistent_load(self, pid):
                kind, storage, key, location, numel = pid
                assert kind == "storage" and location == "cpu"
                data = np.frombuffer(zf.read(f"{stem}/data/{key}"), dtype=_NUMPY[storage])
                assert data.size == numel
                return _Storage(storage, data)

        return Unpickler(zf.open(f"{stem}/data.pkl")).load()


def _bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _by_id(out):
    """The converted samples the manifest records (a torn line is no record)."""
    lines = (Path(out) / MANIFEST).read_text().splitlines()
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            pass
    return {e["id"]: e for e in entries}


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "layertap_client.convert", *map(str, args)], capture_output=True, text=True, timeout=300
    )


# -- the formats -----------------------------------------------------------------------------


def test_eagle3_files_hold_specforges_keys_and_the_bulk_values(bulk, tmp_path):
    for name in ("bf16", "f32"):
        out = tmp_path / name
        p = _run("specforge-eagle3", bulk[name], out)
        assert p.returncode == 0, p.stderr
        assert f"converted {len(SAMPLES)} samples" in p.stdout
        src = BulkFolder(bulk[name], bf16="float32")
        entries = _by_id(out)
        assert sorted(entries) == sorted(s["id"] for s in SAMPLES)
        for i in range(len(src)):
            s = src.load(i)
            t = read_ckpt(out / entries[s["id"]]["file"])
            assert sorted(t) == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
            n = len(s["input_ids"])
            want_kind = "BFloat16Storage" if name == "bf16" else "FloatStorage"
            assert t["hidden_state"][0] == t["aux_hidden_state"][0] == want_kind
            assert t["input_ids"][0] == t["loss_mask"][0] == "LongStorage"
            assert t["input_ids"][1].tolist() == s["input_ids"].tolist()
            assert t["loss_mask"][1].tolist() == s["loss_mask"].tolist()
            hs = t["hidden_state"][1]
            aux = t["aux_hidden_state"][1]
            assert hs.shape == (1, n, HIDDEN) and aux.shape == (1, n, 2 * HIDDEN)
            f32 = (lambda a: _bf16_to_f32(a)) if name == "bf16" else (lambda a: a)
            states = s["hidden_states"]  # [T, 3, H], bf16 widened exactly
            assert np.array_equal(f32(hs)[0], states[:, 2])
            assert np.array_equal(f32(aux)[0], states[:, :2].reshape(n, 2 * HIDDEN))
            assert entries[s["id"]]["tokens"] == n
            assert entries[s["id"]]["bytes"] == (out / entries[s["id"]]["file"]).stat().st_size


def test_dflash_files_concatenate_every_layer_asked(bulk, tmp_path):
    for name in ("bf16", "prenorm"):  # DFlash takes any layers, final_prenorm too
        out = tmp_path / name
        assert convert_folder("specforge-dflash", bulk[name], out).converted == len(SAMPLES)
        src = BulkFolder(bulk[name], bf16="float32")
        entries = _by_id(out)
        for s in src.iter():
            t = read_ckpt(out / entries[s["id"]]["file"])
            assert sorted(t) == ["hidden_states", "input_ids", "loss_mask"]
            n, k = s["hidden_states"].shape[:2]
            assert t["hidden_states"][0] == "BFloat16Storage"
            assert t["hidden_states"][1].shape == (n, k * HIDDEN)
            assert np.array_equal(_bf16_to_f32(t["hidden_states"][1]), s["hidden_states"].reshape(n, k * HIDDEN))
            assert t["loss_mask"][1].tolist() == s["loss_mask"].tolist()


def test_fp8_is_dequantised_with_its_scales_then_rounded_to_bfloat16(bulk, tmp_path):
    out = tmp_path / "fp8"
    assert convert_folder("specforge-dflash", bulk["fp8"], out).converted == len(SAMPLES)
    f32 = tmp_path / "fp8-f32"
    assert convert_folder("specforge-dflash", bulk["fp8"], f32, dtype="float32").converted == len(SAMPLES)
    src = BulkFolder(bulk["fp8"])  # dequantised: fp8 value times its scale, float32
    entries, entries32 = _by_id(out), _by_id(f32)
    for s in src.iter():
        n = len(s["input_ids"])
        want = s["hidden_states"].reshape(n, -1)
        kind, got = read_ckpt(f32 / entries32[s["id"]]["file"])["hidden_states"]
        assert kind == "FloatStorage" and np.array_equal(got, want)
        kind, bits = read_ckpt(out / entries[s["id"]]["file"])["hidden_states"]
        assert kind == "BFloat16Storage"
        # rounded to nearest even, as ml_dtypes (and torch's .to(torch.bfloat16)) round
        assert np.array_equal(bits, want.astype(ml_dtypes.bfloat16).view(np.uint16))
        assert np.all(np.abs(_bf16_to_f32(bits) - want) <= np.abs(want) * 2.0**-8)


@pytest.mark.skipif(torch is None, reason="torch is not installed")
def test_torch_load_reads_the_files_as_torch_save_would_write_them(bulk, tmp_path):
    out = tmp_path / "eagle3"
    assert convert_folder("specforge-eagle3", bulk["bf16"], out).converted == len(SAMPLES)
    for e in _by_id(out).values():
        path = out / e["file"]
        mine = read_ckpt(path)
        for mmap in (False, True):
            t = torch.load(path, mmap=mmap, weights_only=True)
            assert sorted(t) == sorted(mine)
            assert t["hidden_state"].dtype == torch.bfloat16 and t["input_ids"].dtype == torch.int64
            for k, (_, arr) in mine.items():
                got = t[k].view(torch.int16).numpy().view(np.uint16) if t[k].dtype == torch.bfloat16 else t[k].numpy()
                assert np.array_equal(got, arr), k
        # and torch.save of the same tensors reads back equal
        again = tmp_path / "again.ckpt"
        torch.save(torch.load(path, weights_only=True), again)
        assert all(torch.equal(a, b) for a, b in zip(torch.load(again).values(), torch.load(path).values()))


# -- resuming, failures, refusals --------------------------------------------------------------


def test_a_killed_run_resumes_without_redoing_or_losing_a_sample(bulk, tmp_path):
    whole = tmp_path / "whole"
    convert_folder("specforge-eagle3", bulk["bf16"], whole)
    reference = {e["id"]: (whole / e["file"]).read_bytes() for e in _by_id(whole).values()}

    out = tmp_path / "killed"
    convert_folder("specforge-eagle3", bulk["bf16"], out)
    lines = (out / MANIFEST).read_text().splitlines()
    # as a kill leaves it: 3 samples recorded, a torn line, a temporary file, a file renamed but not recorded
    (out / MANIFEST).write_text("\n".join(lines[:3]) + "\n" + lines[3][:17])
    unrecorded = out / json.loads(lines[4])["file"]
    (unrecorded.parent / (unrecorded.name + ".tmp")).write_bytes(b"partial")
    for line in lines[5:]:
        (out / json.loads(line)["file"]).unlink()
    before = {json.loads(line)["file"]: (out / json.loads(line)["file"]).stat().st_mtime_ns for line in lines[:3]}

    s = convert_folder("specforge-eagle3", bulk["bf16"], out)
    assert (s.skipped, s.converted, s.failed) == (3, len(SAMPLES) - 3, 0)
    entries = _by_id(out)
    assert sorted(entries) == sorted(reference)
    for sid, e in entries.items():
        assert (out / e["file"]).read_bytes() == reference[sid]
    for f, mtime in before.items():  # not rewritten
        assert (out / f).stat().st_mtime_ns == mtime
    # a third run has nothing left to do
    s = convert_folder("specforge-eagle3", bulk["bf16"], out)
    assert (s.skipped, s.converted) == (len(SAMPLES), 0)
    # a converted file deleted since is redone
    gone = next(iter(entries.values()))
    (out / gone["file"]).unlink()
    assert convert_folder("specforge-eagle3", bulk["bf16"], out).converted == 1
    assert (out / gone["file"]).read_bytes() == reference[gone["id"]]


def test_a_damaged_source_file_is_listed_and_the_rest_converted(bulk, tmp_path):
    src = tmp_path / "src"
    subprocess.run(["cp", "-r", str(bulk["bf16"]), str(src)], check=True)
    first = BulkFolder(src).entries[0]
    path = src / first["file"]
    path.write_bytes(_flip(path.read_bytes(), "hidden_states", 3))  # one bit of the states
    out = tmp_path / "out"
    p = _run("specforge-eagle3", src, out, "--quiet")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"converted {len(SAMPLES) - 1} samples" in p.stdout and "1 failed" in p.stdout
    failures = [json.loads(line) for line in (out / FAILURES).read_text().splitlines()]
    assert [f["id"] for f in failures] == [first["id"]]
    assert "hash" in failures[0]["error"] or "checksum" in failures[0]["error"]
    assert first["id"] not in _by_id(out)
    # once the file is extracted again, the next run converts it alone
    subprocess.run(["cp", str(bulk["bf16"] / first["file"]), str(src / first["file"])], check=True)
    p = _run("specforge-eagle3", src, out)
    assert p.returncode == 0 and "converted 1 samples" in p.stdout, p.stdout + p.stderr
    assert not (out / FAILURES).exists()


def test_manifest_lines_leaving_the_folder_or_recording_no_file_are_listed_and_never_read(bulk, tmp_path):
    src, outside, out = tmp_path / "src", tmp_path / "outside", tmp_path / "out"
    subprocess.run(["cp", "-r", str(bulk["bf16"]), str(src)], check=True)
    outside.mkdir()
    entries = [json.loads(line) for line in (src / "manifest.jsonl").read_text().splitlines()]
    by_id = {e["id"]: e for e in entries}
    moved = {}
    for id_ in ("ids-a", "ids-d", "chat-c"):  # intact files, moved out of the folder
        f = src / by_id[id_]["file"]
        moved[id_] = outside / f.name
        os.replace(f, moved[id_])
    by_id["ids-a"]["file"] = f"../outside/{moved['ids-a'].name}"
    by_id["ids-d"]["file"] = str(moved["ids-d"])
    # The first file (by path), a link out to one of other layers, which the folder's layer check
    # must not read either.
    assert BulkFolder(src).entries[0]["id"] == "chat-c"
    prenorm = {e["id"]: e["file"] for e in BulkFolder(bulk["prenorm"]).entries}["chat-c"]
    moved["chat-c"].write_bytes((bulk["prenorm"] / prenorm).read_bytes())
    os.symlink(moved["chat-c"], src / by_id["chat-c"]["file"])
    del by_id["text-b"]["file"]
    # (the manifest's order is the order the samples finished: the last line may be text-b's)
    last_file = next(e["file"] for e in reversed(entries) if "file" in e)
    lines = [json.dumps(e) for e in entries] + [json.dumps({"file": last_file})]
    (src / "manifest.jsonl").write_text("".join(line + "\n" for line in lines))

    p = _run("specforge-eagle3", src, out, "--quiet")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"converted {len(SAMPLES) - 4} samples" in p.stdout and "5 failed" in p.stdout, p.stdout
    failures = {f["id"]: f["error"] for f in map(json.loads, (out / FAILURES).read_text().splitlines())}
    assert sorted(failures, key=str) == sorted(["ids-a", "ids-d", "chat-c", "text-b", None], key=str), failures
    for id_ in ("ids-a", "ids-d", "chat-c"):
        assert "out of the folder" in failures[id_] or "absolute" in failures[id_], failures[id_]
        assert "inside the folder" in failures[id_], failures[id_]
    assert "no file" in failures["text-b"] and "no id" in failures[None], failures
    stray = [c for c in tmp_path.glob("**/*.ckpt*") if out not in c.parents]
    assert not stray, f"written outside the output folder: {stray}"
    assert sorted(_by_id(out)) == sorted(s["id"] for s in SAMPLES if s["id"] not in failures)


def test_layer_sets_and_folders_the_formats_cannot_take_are_refused(bulk, tmp_path):
    p = _run("specforge-eagle3", bulk["prenorm"], tmp_path / "a")
    assert p.returncode == 2
    assert "after the norm" in p.stderr and "end --layers with -1" in p.stderr
    assert not (tmp_path / "a" / MANIFEST).exists() or not (tmp_path / "a" / MANIFEST).read_text()
    p = _run("specforge-eagle3", bulk["fp8"], tmp_path / "b")  # only 1 auxiliary layer is still EAGLE-3 shaped
    assert p.returncode == 0, p.stderr
    # a token selection, and the speculators layout (no loss mask): every sample fails, named
    for name, needle in (("last", "extract without --tokens"), ("spec", "no loss_mask")):
        p = _run("specforge-dflash", bulk[name], tmp_path / name)
        assert p.returncode == 1, p.stdout + p.stderr
        errors = [json.loads(line)["error"] for line in (tmp_path / name / FAILURES).read_text().splitlines()]
        assert len(errors) == len(SAMPLES) and all(needle in e for e in errors), errors[0]
    # an output folder converted with other settings, or the bulk folder itself
    with pytest.raises(ConvertError, match="convert into another folder"):
        convert_folder("specforge-dflash", bulk["fp8"], tmp_path / "b")
    with pytest.raises(ConvertError, match="must not be the bulk folder"):
        convert_folder("specforge-dflash", bulk["bf16"], bulk["bf16"])
    p = _run("specforge-dflash", tmp_path / "nowhere", tmp_path / "c")
    assert p.returncode == 2 and "manifest" in p.stderr
    p = _run("eagle-9", bulk["bf16"], tmp_path / "d")
    assert p.returncode == 2 and "invalid choice" in p.stderr


def test_fp8_speculators_files_dequantise_as_hs_connectors_does(bulk):
    """hs-connectors' fp8 reader: ``hidden_states.to(dtype) * hidden_states_scales.to(dtype)``,
    the scales ``[T, n_layers, 1]`` broadcasting over the hidden size. In float32 that is the
    plain layout's fp8 states times their scales, exactly."""
    from layertap_client import _safetensors

    plain = {s["id"]: s for s in BulkFolder(bulk["fp8_prenorm"]).iter()}  # dequantised, float32
    for row, sample in enumerate(SAMPLES):
        tensors, metadata = _safetensors.parse((bulk["spec_fp8"] / f"hs_{row}.safetensors").read_bytes())
        assert sorted(tensors) == ["hidden_states", "hidden_states_scales", "token_ids"]
        (hs_dtype, hs), (sc_dtype, scales), (id_dtype, ids) = (
            tensors["hidden_states"], tensors["hidden_states_scales"], tensors["token_ids"])
        want = plain[sample["id"]]
        t = len(want["input_ids"])
        assert (hs_dtype, sc_dtype, id_dtype) == ("F8_E4M3", "F32", "I64")
        assert hs.shape == (t, 2, HIDDEN) and scales.shape == (t, 2, 1) and ids.tolist() == want["input_ids"].tolist()
        assert np.array_equal(_safetensors.f8_e4m3_bits_to_float32(hs) * scales, want["hidden_states"])
        assert json.loads(metadata["layers"]) == [1, "final_prenorm"]


def test_torchsave_writes_what_it_is_given():
    assert _torchsave.pickle_dict({}) == b"\x80\x02}."
    with pytest.raises(ValueError, match="holds"):
        _torchsave.save(os.devnull, {"x": ("FloatStorage", np.zeros(3, np.float64))})
    with pytest.raises(ValueError, match="unknown storage"):
        _torchsave.save(os.devnull, {"x": ("DoubleStorage", np.zeros(3, np.float64))})
