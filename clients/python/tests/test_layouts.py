"""``layertap_client.layouts``: the trainers' layouts of one sample, shared by the offline
converter and the online drop-ins (``layertap_client.trainers``).

The file layouts are checked against the converter's own output, byte for byte, and the
speculators layout against the files ``layertap bulk --layout speculators`` writes; all on
folders written by the real ``layertap bulk``. numpy only: the drop-ins themselves are
checked with the trainers' code by ``scripts/trainers/check_readers.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from layertap_client import _safetensors, _torchsave, layouts
from layertap_client.convert import MANIFEST, convert_folder
from layertap_client.dataset import BulkFolder
from layertap_client.layouts import LayoutError
from layertap_client.trainers import Servers
from test_client import HIDDEN, NUM_LAYERS, Server, _free_port, run_bulk

SAMPLES = [
    {"id": "ids-a", "input_ids": [5, 6, 7, 8, 9]},
    {"id": "text-b", "text": "The quick brown fox"},
    {"id": "chat-c", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    {"id": "ids-d", "input_ids": list(range(1, 24))},
    {"id": "ids-e", "input_ids": [42]},
]

RUNS = {
    "bf16": ["--layers", f"1,2,{NUM_LAYERS}", "--dtype", "bfloat16"],
    "f32": ["--layers", "0,2,-1", "--dtype", "float32"],
    "fp8": ["--layers", "1,-1", "--dtype", "fp8"],
    "prenorm": ["--layers", "1,final_prenorm", "--dtype", "float32"],
    "spec": ["--layers", "1,final_prenorm", "--dtype", "float32", "--layout", "speculators"],
    "fp8_prenorm": ["--layers", "1,final_prenorm", "--dtype", "fp8"],
    "spec_fp8": ["--layers", "1,final_prenorm", "--dtype", "fp8", "--layout", "speculators"],
}


@pytest.fixture(scope="module")
def server():
    s = Server()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def bulk(server, tmp_path_factory):
    root = tmp_path_factory.mktemp("bulk")
    return {name: run_bulk(server.url, SAMPLES, root / name, flags) for name, flags in RUNS.items()}


_STORAGE = {
    np.dtype(np.int64): "LongStorage",
    np.dtype(np.float32): "FloatStorage",
    np.dtype(np.float16): "HalfStorage",
    np.dtype(ml_dtypes.bfloat16): "BFloat16Storage",
}


def _save(path, tensors):
    """``torch.save`` of a layout's numpy arrays, as the converter writes them (bf16 as its bits)."""
    out = {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        storage = _STORAGE[arr.dtype]
        out[name] = (storage, arr.view(np.uint16) if storage == "BFloat16Storage" else arr)
    _torchsave.save(path, out)
    return Path(path).read_bytes()


def _bf16(sample):
    """The hidden states rounded to bfloat16, as the converter stores fp8 answers by default."""
    return dict(sample, hidden_states=layouts.dequantized(sample).astype(ml_dtypes.bfloat16), hidden_states_scale=None)


@pytest.mark.parametrize("run", ["bf16", "f32", "fp8"])
@pytest.mark.parametrize("fmt", sorted(layouts.FILE_LAYOUTS))
def test_file_layouts_give_the_converters_bytes(bulk, tmp_path, run, fmt):
    out = tmp_path / "out"
    summary = convert_folder(fmt, bulk[run], out)
    assert summary.converted == len(SAMPLES) and summary.failed == 0
    converted = {line.split('"id": "')[1].split('"')[0]: line for line in (out / MANIFEST).read_text().splitlines()}
    # fp8 kept as fp8 (dequantised by the layout itself) and dequantised by the reader alike
    for dequantize in ([True, False] if run == "fp8" else [True]):
        folder = BulkFolder(bulk[run], dequantize=dequantize)
        for i, sample in enumerate(folder.iter()):
            if run == "fp8":
                sample = _bf16(sample)
            file = out / (str(Path(folder.entries[i]["file"]).with_suffix("")) + ".ckpt")
            assert sample["id"] in converted
            # torch.save names the archive's folder after the file: the converter's file name
            (tmp_path / "mine").mkdir(exist_ok=True)
            mine = _save(tmp_path / "mine" / file.name, layouts.FILE_LAYOUTS[fmt](sample))
            assert mine == file.read_bytes(), (run, fmt, sample["id"])


def test_speculators_layout_is_what_bulk_writes_for_speculators(bulk):
    """The plain layout's sample through :func:`layouts.speculators` holds the tensors of the
    ``--layout speculators`` file of the same row, byte for byte (fp8 kept as fp8 with its
    scales ``[T, n, 1]``, as hs-connectors' fp8 reader takes them)."""
    for plain, spec, dequantize in (("prenorm", "spec", True), ("fp8_prenorm", "spec_fp8", False)):
        folder = BulkFolder(bulk[plain], dequantize=dequantize)
        by_id = {s["id"]: s for s in folder.iter()}
        for row, source in enumerate(SAMPLES):
            mine = layouts.speculators(by_id[source["id"]])
            tensors, _ = _safetensors.parse((bulk[spec] / f"hs_{row}.safetensors").read_bytes())
            assert sorted(mine) == sorted(tensors)
            for name, (_, theirs) in tensors.items():
                got = np.ascontiguousarray(mine[name])
                assert got.shape == theirs.shape and got.tobytes() == theirs.tobytes(), (plain, name, row)


def test_online_features_are_the_files_reshaped(bulk):
    for sample in BulkFolder(bulk["bf16"]).iter():
        t = len(sample["input_ids"])
        file, online = layouts.specforge_eagle3_file(sample), layouts.specforge_eagle3(sample)
        assert sorted(online) == ["attention_mask", "hidden_state", "input_ids", "loss_mask", "target"]
        assert online["hidden_state"].shape == (1, t, 2 * HIDDEN) and online["target"].shape == (1, t, HIDDEN)
        assert np.array_equal(online["hidden_state"], file["aux_hidden_state"])
        assert np.array_equal(online["target"], file["hidden_state"])
        for name in ("input_ids", "loss_mask"):
            assert online[name].dtype == np.int64 and np.array_equal(online[name], file[name][None])
        assert online["attention_mask"].dtype == np.int64 and online["attention_mask"].tolist() == [[1] * t]
        dfile, donline = layouts.specforge_dflash_file(sample), layouts.specforge_dflash(sample)
        assert sorted(donline) == ["hidden_states", "input_ids", "loss_mask"]
        assert np.array_equal(donline["hidden_states"], dfile["hidden_states"][None])
        assert donline["hidden_states"].dtype == sample["hidden_states"].dtype
        # the general form, with a layout of SpecForge's server capture
        general = layouts.specforge_features(
            sample, "hidden_state", "target", [("input_ids", "input_ids"), ("loss_mask", "loss_mask")], "attention_mask")
        assert all(np.array_equal(general[k], online[k]) for k in online)


def test_layouts_refuse_what_the_trainer_cannot_take(bulk):
    [sample] = list(BulkFolder(bulk["prenorm"]).iter([0]))
    # a Result-like sample names its layers: EAGLE-3's last must be index L (post-norm)
    labelled = dict(sample, layers=[1, "final_prenorm"], num_layers=NUM_LAYERS)
    for layout in (layouts.specforge_eagle3, layouts.specforge_eagle3_file):
        with pytest.raises(LayoutError, match="end --layers with -1"):
            layout(labelled)
    assert layouts.speculators(labelled)["hidden_states"].shape[1] == 2
    with pytest.raises(LayoutError, match="do not agree"):
        layouts.specforge_dflash_file(dict(sample, loss_mask=sample["loss_mask"][:-1]))
    with pytest.raises(LayoutError, match="no loss_mask"):
        layouts.specforge_dflash({"hidden_states": sample["hidden_states"], "input_ids": sample["input_ids"]})
    with pytest.raises(LayoutError, match="at least 2 layers"):
        layouts.specforge_eagle3_file(dict(sample, hidden_states=sample["hidden_states"][:, :1]))


def test_the_trainers_package_imports_without_any_trainer():
    code = (
        "import sys\n"
        "for m in ('torch', 'hs_connectors', 'speculators', 'specforge', 'datasets'): sys.modules[m] = None\n"
        "import layertap_client.trainers as t, layertap_client.layouts\n"
        "assert t.Servers\n"
        "try:\n"
        "    import layertap_client.trainers.speculators\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "ImportError:" in p.stdout, p.stdout


def test_servers_skip_a_server_that_does_not_answer(server):
    dead = f"http://127.0.0.1:{_free_port()}"
    servers = Servers([dead, server.url], retries=3, backoff=0.05)
    for _ in range(3):  # every call answered, the dead server left alone after its failure
        [r] = servers.hidden_states([[5, 6, 7]], layers=[1], dtype="float32")
        assert r.hidden_states.shape == (3, 1, HIDDEN)
    assert servers.info()["num_layers"] == NUM_LAYERS
    with pytest.raises(Exception, match="422|invalid"):  # the request's own fault: no retry elsewhere
        servers.hidden_states([[5, 6, 7]], layers=[NUM_LAYERS + 5])
    only_dead = Servers(dead, retries=1, backoff=0.01, max_backoff=0.02)
    with pytest.raises(Exception, match="after 2 attempts"):
        only_dead.hidden_states([[5]], layers=[1])
    import pickle

    again = pickle.loads(pickle.dumps(servers))  # to DataLoader workers: settings, no connections
    assert again.urls == servers.urls and again.hidden_states([[5]], layers=[1])[0].hidden_states.shape[0] == 1
