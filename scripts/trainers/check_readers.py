#!/usr/bin/env python3
"""The drafter trainers' own readers on layertap's output, end to end (`make trainer-readers`).

Run in the venv of scripts/trainers/setup-venv.sh, with a release build of layertap and the
default model (`make model`). It starts `layertap serve`, then:

1. speculators: prepares a dataset of pre-tokenized chats with speculators' own
   preprocessing (which shuffles the rows), exports it in that order, runs
   `layertap bulk --ids-column input_ids --layout speculators` into the dataset's
   `hidden_states` folder (bfloat16, and fp8 in a second folder), and loads every sample
   through speculators' ArrowDataset with hs-connectors' FileTransfer (bfloat16) and
   FP8Transfer (fp8), as its trainer does with `--on-missing raise`;
2. SpecForge: runs `layertap bulk` on the chats (plain layout), converts with
   `python -m layertap_client.convert specforge-eagle3|specforge-dflash`, and reads every
   file through SpecForge's OfflineManifestReader, feature store, normaliser and collator
   for EAGLE-3 and DFlash;
3. kills a conversion halfway and checks that running it again resumes to the same files;
4. online, with nothing on disk (layertap_client.trainers): speculators' train config with
   `--hidden-states-backend layertap` and its own train/val DataLoaders; SpecForge 0.2's
   online producer with LayertapFeatureSource for EAGLE-3 and DFlash; and, given
   `--specforge-legacy DIR` (a SpecForge source tree from before 2026-07, whose target
   models PyPI's releases do not carry), LayertapEagle3TargetModel / LayertapDFlashTargetModel
   called as that version's training scripts call them, on its own collated batches.

Every sample's tensors are compared with layertap's answer for the same input. It prints
one line per check with its counts and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_LAYERS = 30  # SmolLM2-135M
EAGLE3 = [2, 15, 27]  # 2, L/2, L-3
DFLASH_TARGET_LAYER_IDS = [1, 10, 19, 28]  # a DFlash draft config's target_layer_ids -> ask for t + 1

TOPICS = ["rivers", "prime numbers", "bread", "the moon", "chess", "volcanoes", "tea", "bicycles", "owls", "glass"]


def chats(n):
    """n short chats, deterministic, each with a system turn and one or two exchanges."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        m = [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": f"Tell me one fact about {topic}."},
            {"role": "assistant", "content": f"Here is a fact about {topic}: it is number {i} on my list."},
        ]
        if i % 3 == 0:
            m += [
                {"role": "user", "content": "And another?"},
                {"role": "assistant", "content": f"Another: {topic} appear in {i + 2} of my notes."},
            ]
        out.append(m)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def run(cmd, **kw):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(map(str, cmd))}\n{p.stdout}\n{p.stderr}")
    return p


def report(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def check_speculators(binary, url, client, work, n):
    from datasets import Dataset
    from hs_connectors import FileTransfer, FP8Transfer
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from speculators.train.data import ArrowDataset

    # pre-tokenized rows (ids and assistant loss mask from the target's chat template)
    rows = [post(f"{url}/v1/tokenize", {"inputs": [{"messages": m}]})["results"][0] for m in chats(n)]
    raw = Dataset.from_list([{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows])
    prepared = build_speculator_training_dataset(raw, processor=None, max_length=2048, num_proc=1)
    prepared = prepared.shuffle(seed=0)  # as speculators' prepare-data does
    data = work / "spec-data"
    prepared.save_to_disk(str(data))
    export = work / "prepared.parquet"
    prepared.with_format(None).to_parquet(str(export))  # the prepared rows, in their order

    ok = True
    layers = [*EAGLE3, "final_prenorm"]  # speculators norms the last slot itself
    for dtype, folder, transfer in (
        ("bfloat16", data / "hidden_states", FileTransfer(data / "hidden_states")),
        ("fp8", work / "spec-fp8", FP8Transfer(work / "spec-fp8", dequantize_dtype=torch.float32)),
    ):
        run([binary, "bulk", "--server", url, "--input", export, "--ids-column", "input_ids",
             "--layout", "speculators", "--layers", ",".join(map(str, layers)), "--dtype", dtype,
             "--out", folder], timeout=600)
        ds = ArrowDataset(max_len=2048, datapath=str(data), transfer=transfer, on_missing="raise")
        loaded, equal = 0, 0
        for i in range(len(ds)):
            sample = ds[i]
            if not isinstance(sample, dict):
                continue
            loaded += 1
            ids = sample["input_ids"].tolist()
            [want] = client.hidden_states([ids], layers=layers, dtype="float32" if dtype == "fp8" else dtype,
                                          as_torch=True)
            want = want.hidden_states.float()
            got_aux = sample["hidden_states"].float()  # [T, 3H]
            got_last = sample["verifier_last_hidden_states"].float()
            if dtype == "fp8":  # within one fp8 step of the float32 states, per token and layer
                deq = torch.cat([got_aux.view(len(ids), 3, -1), got_last[:, None]], 1)
                amax = want.abs().amax(-1, keepdim=True)
                good = bool(((deq - want).abs() <= amax * 2**-3).all())
            else:
                good = torch.equal(got_aux, want[:, :3].flatten(1)) and torch.equal(got_last, want[:, 3])
            good = good and sample["loss_mask"].tolist() == prepared[i]["loss_mask"].tolist()
            equal += good
        ok &= report(f"speculators ArrowDataset + {type(transfer).__name__} ({dtype})", loaded == equal == n,
                     f"{loaded} of {n} samples loaded, {equal} equal to layertap's answer for their ids")
    return ok


def check_specforge(binary, url, client, work, n):
    from specforge.algorithms.common import dflash_family_data as dflash
    from specforge.algorithms.eagle3 import data as eagle3
    from specforge.runtime.data_plane.feature_store import load_feature_file

    inputs = work / "chats.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n" for i, m in enumerate(chats(n))))
    ok = True
    cases = (
        ("specforge-eagle3", [*EAGLE3, -1], eagle3.build_offline_reader, eagle3.normalize_offline_sample,
         eagle3.build_offline_collator()),
        ("specforge-dflash", [t + 1 for t in DFLASH_TARGET_LAYER_IDS], dflash.build_offline_reader,
         dflash.normalize_offline_sample, dflash.build_collator()),
    )
    for fmt, layers, build_reader, normalize, collate in cases:
        bulk = work / f"bulk-{fmt}"
        out = work / f"out-{fmt}"
        run([binary, "bulk", "--server", url, "--input", inputs, "--layers", ",".join(map(str, layers)),
             "--dtype", "bfloat16", "--out", bulk], timeout=600)
        run([sys.executable, "-m", "layertap_client.convert", fmt, bulk, out, "--quiet"], timeout=600)
        kw = {"run_id": "check", "ttt_length": 7, "max_len": 2048}
        if fmt == "specforge-eagle3":
            reader = build_reader(str(out), **kw)
        else:
            reader = build_reader(fmt.split("-")[1], str(out), **kw)
        refs = reader.read()
        by_file = {json.loads(line)["file"]: json.loads(line)["id"]
                   for line in (out / "convert-manifest.jsonl").read_text().splitlines()}
        loaded, equal, batch = 0, 0, []
        for ref in refs:
            path = ref.feature_store_uri[len("file://"):]
            raw = load_feature_file(path)
            sample = normalize(raw, max_len=2048)
            loaded += 1
            batch.append(sample)
            sid = by_file[str(Path(path).relative_to(out.resolve()))]
            i = int(sid[1:])
            [want] = client.hidden_states([{"messages": chats(n)[i]}], layers=layers, dtype="bfloat16", as_torch=True)
            t = len(want.input_ids)
            if fmt == "specforge-eagle3":
                good = (torch.equal(sample["hidden_state"][0], want.hidden_states[:, :3].reshape(t, -1))
                        and torch.equal(sample["target"][0], want.hidden_states[:, 3]))
            else:
                good = torch.equal(sample["hidden_states"][0], want.hidden_states.reshape(t, -1))
            good = good and sample["input_ids"][0].tolist() == want.input_ids.tolist()
            mask = want.loss_mask.tolist()
            if fmt == "specforge-eagle3":
                mask[-1] = 0  # its normaliser drops the last position
            good = good and sample["loss_mask"][0].tolist() == mask
            equal += good
        collated = collate(batch)
        shapes = {k: tuple(v.shape) for k, v in collated.items() if hasattr(v, "shape")}
        ok &= report(f"SpecForge {fmt.split('-')[1]} offline reader", loaded == equal == n,
                     f"{loaded} of {n} files read, {equal} equal to layertap's answer; collated batch {shapes}")
    return ok


def check_resume(binary, url, work, n):
    inputs = work / "resume.jsonl"
    inputs.write_text("".join(json.dumps({"id": f"r{i}", "messages": m}) + "\n" for i, m in enumerate(chats(n))))
    bulk = work / "bulk-resume"
    run([binary, "bulk", "--server", url, "--input", inputs, "--layers", ",".join(map(str, [*EAGLE3, -1])),
         "--dtype", "bfloat16", "--out", bulk], timeout=600)
    whole = work / "resume-whole"
    run([sys.executable, "-m", "layertap_client.convert", "specforge-eagle3", bulk, whole, "--quiet"])
    killed = work / "resume-killed"
    p = subprocess.Popen([sys.executable, "-m", "layertap_client.convert", "specforge-eagle3", str(bulk),
                          str(killed), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    manifest = killed / "convert-manifest.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and p.poll() is None:
        if manifest.is_file() and manifest.read_bytes().count(b"\n") >= n // 10:
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    done_before = manifest.read_bytes().count(b"\n")
    again = run([sys.executable, "-m", "layertap_client.convert", "specforge-eagle3", str(bulk), str(killed), "--quiet"])
    files = sorted(str(f.relative_to(whole)) for f in whole.rglob("*.ckpt"))
    same = all((whole / f).read_bytes() == (killed / f).read_bytes() for f in files)
    stray = [str(f) for f in killed.rglob("*.tmp")]
    return report("conversion killed and resumed", done_before < n and len(files) == n and same and not stray,
                  f"killed after {done_before} of {n} samples; the second run: {again.stdout.strip()}; "
                  f"{len(files)} files byte-equal to an uninterrupted run: {same}; stray temporary files: {len(stray)}")


def check_final_norm(binary):
    """speculators' verifier norm on a Qwen3.5 checkpoint, whose final norm is rmsnorm(x)·(1 + w)."""
    from safetensors.torch import load_file
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # speculators' norm for a qwen3 draft

    from layertap_client import Client

    model = REPO / "tests" / "fixtures" / "tiny" / "qwen3_5_text"
    config = json.loads((model / "config.json").read_text())
    w = load_file(str(model / "model.safetensors"))["model.norm.weight"].float()
    with Server(binary, model) as url, Client(url) as client:
        [r] = client.hidden_states(["The verifier's final norm, checked."], layers=[-1, "final_prenorm"],
                                   dtype="float32", as_torch=True)
    post, pre = r.hidden_states[:, 0], r.hidden_states[:, 1]
    errors = {}
    for name, weight in (("w", w), ("1 + w", 1 + w)):
        norm = Qwen3RMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        norm.weight.data = weight.clone()
        with torch.no_grad():
            got = norm(pre)
        errors[name] = float((got - post).norm() / post.norm())
    return report("speculators' verifier norm on Qwen3.5", errors["1 + w"] < 1e-5 < 0.1 < errors["w"],
                  f"relative error against layertap's index L: weight w {errors['w']:.3g}, "
                  f"weight 1 + w {errors['1 + w']:.3g}")



# -- online: each drop-in of layertap_client.trainers driven by its trainer's own code ----------


def _rows(url, n):
    """n chats as pre-tokenized rows (ids and assistant loss mask from the target's chat template)."""
    return [post(f"{url}/v1/tokenize", {"inputs": [{"messages": m}]})["results"][0] for m in chats(n)]


def check_speculators_online(url, client, work, n):
    """speculators' train config parses `--hidden-states-backend layertap`, its CLI's own call
    builds the transfer (`from_train_args`), and its train/val DataLoaders (spawned workers,
    ArrowDataset, multipack sampler, CollateFn) pull every sample from layertap: no vLLM
    server, no hidden-states folder. Each packed document is compared with layertap's answer."""
    import argparse

    import layertap_client.trainers.speculators  # noqa: F401 - registers the backend first
    from datasets import Dataset
    from hs_connectors import HiddenStatesBackend
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders

    rows = _rows(url, n)
    raw = Dataset.from_list([{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows])
    prepared = build_speculator_training_dataset(raw, processor=None, max_length=2048, num_proc=1).shuffle(seed=0)
    data = work / "spec-online"
    prepared.save_to_disk(str(data))
    assert not (data / "hidden_states").exists()
    cfg = TrainConfig.resolve([
        "--verifier-name-or-path", "unused", "--data-path", str(data), "--speculator-type", "eagle3",
        "--hidden-states-backend", "layertap", "--layertap-server", url, "--on-missing", "raise",
        "--target-layer-ids", *map(str, EAGLE3), "--total-seq-len", "1024",
    ])
    args = argparse.Namespace(**cfg.flatten())
    transfer = HiddenStatesBackend.registry[args.hidden_states_backend].from_train_args(args, args.data_path)
    loaders = create_train_val_loaders(
        data_path=args.data_path, total_seq_len=args.total_seq_len, hidden_states_dtype=torch.bfloat16,
        transfer=transfer, vllm_endpoint=args.vllm_endpoint, on_missing=args.on_missing,
        verifier_name_or_path=args.verifier_name_or_path, request_timeout=args.request_timeout,
        max_retries=args.max_retries, generation_validation_retries=args.generation_validation_retries,
        max_consecutive_generation_failures=args.max_consecutive_generation_failures, hidden_size=576,
        num_target_layers=len(EAGLE3), num_workers=2, prefetch_factor=2, preprocess=None,
        train_data_ratio=args.train_data_ratio, seed=0,
    )
    masks = {tuple(r["input_ids"]): r["loss_mask"] for r in rows}
    layers = [*EAGLE3, "final_prenorm"]
    seen, equal = 0, 0
    for loader in loaders:
        for batch in loader:
            doc = batch["document_ids"][0]
            for d in range(int(doc.max()) + 1):
                sel = doc == d
                ids = batch["input_ids"][0][sel].tolist()
                [want] = client.hidden_states([ids], layers=layers, dtype="bfloat16", as_torch=True)
                seen += 1
                equal += (torch.equal(batch["hidden_states"][0][sel], want.hidden_states[:, :3].flatten(1))
                          and torch.equal(batch["verifier_last_hidden_states"][0][sel], want.hidden_states[:, 3])
                          and batch["loss_mask"][0][sel].tolist() == masks.get(tuple(ids)))
    return report("speculators online: --hidden-states-backend layertap through its DataLoaders", seen == equal == n,
                  f"{seen} of {n} samples trained on, {equal} equal to layertap's answer (states and the dataset's "
                  f"loss mask); backend choices {sorted(HiddenStatesBackend.registry)}")


def _specforge_prompts(url, work, n, name):
    """SpecForge's own prompt preparation of a pre-tokenized JSONL (ids + loss mask)."""
    from specforge.data.prompt_builder import prepare_prompt_tasks

    path = work / f"{name}-prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}) + "\n"
                            for r in _rows(url, n)))
    prompts = prepare_prompt_tasks(path, None, chat_template=None, max_length=2048, is_preformatted=False,
                                   train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None)
    return [dict(p, task_id=f"{name}-{i}") for i, p in enumerate(prompts)]


def check_specforge_online(url, client, work, n):
    """SpecForge 0.2's online producer (`build_disagg_online_producer`: its controller, rollout
    workers with `verify_capture`, feature store and ref channel) with layertap's
    FeatureSource in place of the SGLang capture adapter; every committed sample's features
    are read back from the store, compared with layertap's answer, and collated with the
    algorithm's own streaming collator."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.launch import build_disagg_online_producer
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    from layertap_client.trainers.specforge import LayertapFeatureSource

    ok = True
    registry = builtin_algorithm_registry()
    # SpecForge's capture ids count decoder layers from 0 (layertap's index t + 1)
    for name, aux_ids in (("eagle3", [t - 1 for t in EAGLE3]), ("dflash", DFLASH_TARGET_LAYER_IDS)):
        algorithm = registry.resolve(name)
        prompts = _specforge_prompts(url, work, n, name)
        store = LocalFeatureStore(f"check-{name}")
        channel = StreamingRefChannel(str(work / f"{name}.refs"))
        channel.publish_consumer_quantum(1)
        source = LayertapFeatureSource(url, algorithm=name, request_tokens=512)
        _, drive = build_disagg_online_producer(
            algorithm=algorithm, prompts=prompts, feature_store=store, channel=channel, run_id=f"check-{name}",
            target_hidden_size=576, aux_hidden_state_layer_ids=aux_ids, feature_source=source, lease=8,
            producer_concurrency=2, in_flight_high_watermark=n + 8, peer_wait_timeout_s=300,
        )
        published = drive()
        refs = channel.poll()
        by_task = {p["task_id"]: p["payload"] for p in prompts}
        collate = algorithm.providers.server_streaming_for("text").build_collator()
        layers = [t + 1 for t in aux_ids] + ([-1] if name == "eagle3" else [])
        equal, shapes = 0, None
        for ref in refs:
            feats, _ = store.get(ref)
            payload = by_task[ref.source_task_id]
            [want] = client.hidden_states([payload["input_ids"]], layers=layers, dtype="bfloat16", as_torch=True)
            t = len(payload["input_ids"])
            k = len(aux_ids)
            good = (feats["input_ids"].tolist() == [payload["input_ids"]]
                    and feats["loss_mask"].tolist() == [payload["loss_mask"]])
            if name == "eagle3":
                good = (good and torch.equal(feats["hidden_state"][0], want.hidden_states[:, :k].reshape(t, -1))
                        and torch.equal(feats["target"][0], want.hidden_states[:, k])
                        and feats["attention_mask"].tolist() == [[1] * t])
            else:
                good = good and torch.equal(feats["hidden_states"][0], want.hidden_states.reshape(t, -1))
            equal += good
            batch = collate([feats, feats])
            shapes = {key: tuple(v.shape) for key, v in batch.items()}
        ok &= report(f"SpecForge 0.2 online producer + LayertapFeatureSource ({name})",
                     published == len(refs) == equal == n,
                     f"{published} of {n} prompts published, {equal} read back from the feature store equal to "
                     f"layertap's answer; collated pair {shapes}")
    return ok


def _legacy_child(url, legacy, n):
    """In a process of its own, with SpecForge's tree from before 2026-07 first on sys.path:
    its scripts' target-model calls on its own collated batches."""
    sys.path.insert(0, str(legacy))
    import gguf
    from specforge.core.eagle3 import _compute_target_p_padded
    from specforge.data.utils import DataCollatorWithPadding

    import specforge
    from layertap_client import Client
    from layertap_client.trainers.specforge import LayertapDFlashTargetModel, LayertapEagle3TargetModel

    assert str(legacy) in specforge.__file__, specforge.__file__
    # the output head of the default model (its embeddings: tied), dequantised as the server does
    reader = gguf.GGUFReader(str(MODEL))
    [emb] = [t for t in reader.tensors if t.name == "token_embd.weight"]
    weight = torch.from_numpy(gguf.quants.dequantize(emb.data, emb.tensor_type).copy())
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight.data = weight
    head.requires_grad_(False)
    import torch.distributed as dist

    import specforge.distributed as sf_dist

    # its collator reads the sequence-parallel groups: one process, on the CPU (gloo)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    sf_dist._DRAFT_SP_GROUP = sf_dist._SP_ULYSSES_GROUP = sf_dist._TP_GROUP = dist.group.WORLD
    rows = _rows(url, n)
    collate = DataCollatorWithPadding()
    features = [{"input_ids": torch.tensor([r["input_ids"]]), "attention_mask": torch.ones(1, len(r["input_ids"]), dtype=torch.long),
                 "loss_mask": torch.tensor([r["loss_mask"]])} for r in rows]
    batches = [collate(features[i:i + 4]) for i in range(0, n, 4)]
    client = Client(url)
    ok = True

    eagle = LayertapEagle3TargetModel(url, lm_head=head, dtype="float32")
    eagle.set_aux_hidden_states_layers()  # SpecForge's default [1, L/2 - 1, L - 4]
    checked = equal = 0
    worst = 0.0
    for data in eagle.prefetch(batches, depth=2):
        out = eagle.generate_eagle3_data(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                                         loss_mask=data["loss_mask"], shard_returns=False)
        _compute_target_p_padded(target=out.target, t2d=torch.ones(weight.shape[0], dtype=torch.bool),
                                 loss_mask=out.loss_mask, length=7)
        for b in range(data["input_ids"].shape[0]):
            t = int(data["attention_mask"][b].sum())
            ids = data["input_ids"][b, :t].tolist()
            [want] = client.hidden_states([ids], layers=[2, 15, 27, -1], dtype="float32", as_torch=True,
                                          logprobs={"top_k": 8})
            logits = head(want.hidden_states[:, 3])
            good = (torch.equal(out.hidden_states[b, :t], want.hidden_states[:, :3].reshape(t, -1))
                    and torch.equal(out.last_hidden_states[b, :t], want.hidden_states[:, 3])
                    and torch.equal(out.target[b, : t - 1], logits[1:]) and not out.target[b, t - 1:].any()
                    and out.input_ids[b, : t - 1].tolist() == ids[1:]
                    and out.loss_mask[b, :, 0].tolist() == data["loss_mask"][b].tolist())
            # the head on the final state gives the server's own top-k log-probabilities
            logp = torch.log_softmax(logits.double(), -1)
            worst = max(worst, float((logp.gather(1, want.topk_ids) - want.topk_logprobs.double()).abs().max()))
            checked += 1
            equal += good
    ok &= report("SpecForge before 2026-07: LayertapEagle3TargetModel.generate_eagle3_data on its collated batches",
                 checked == equal == n and worst < 1e-3 and eagle.prefetch_misses == 0,
                 f"{checked} samples in {len(batches)} batches, {equal} equal to layertap's answer (aux states, "
                 f"shifted logits of its output head, shifted ids, loss mask); log-softmax of the target against "
                 f"the server's top-8 log-probabilities within {worst:.2g}; prefetched {eagle.prefetch_hits} of "
                 f"{eagle.prefetch_hits + eagle.prefetch_misses} batches")

    dflash = LayertapDFlashTargetModel.from_pretrained(servers=url, torch_dtype=torch.bfloat16)
    dflash.set_capture_layers(DFLASH_TARGET_LAYER_IDS)
    checked = equal = 0
    for data in dflash.prefetch(batches, depth=2):
        out = dflash.generate_dflash_data(data["input_ids"], data["attention_mask"], data["loss_mask"])
        for b in range(data["input_ids"].shape[0]):
            t = int(data["attention_mask"][b].sum())
            [want] = client.hidden_states([data["input_ids"][b, :t].tolist()],
                                          layers=[x + 1 for x in DFLASH_TARGET_LAYER_IDS], dtype="bfloat16", as_torch=True)
            equal += (torch.equal(out.hidden_states[b, :t], want.hidden_states.reshape(t, -1))
                      and not out.hidden_states[b, t:].any() and torch.equal(out.loss_mask, data["loss_mask"]))
            checked += 1
    ok &= report("SpecForge before 2026-07: LayertapDFlashTargetModel.generate_dflash_data on its collated batches",
                 checked == equal == n, f"{checked} samples, {equal} equal to layertap's answer (zeros at the padding)")
    return ok


def check_specforge_legacy(url, legacy, n):
    if legacy is None:
        print("SKIP SpecForge before 2026-07 (target models): give --specforge-legacy, a SpecForge source tree "
              "from before 2026-07 (e.g. commit 357a97ed)", flush=True)
        return True
    p = subprocess.run([sys.executable, __file__, "--legacy-child", str(legacy), "--url", url, "--samples", str(n)],
                       capture_output=True, text=True, timeout=1200)
    print(p.stdout, end="", flush=True)
    if p.returncode != 0:
        print(p.stderr[-4000:], flush=True)
    return p.returncode == 0


class Server:
    """`layertap serve` on a free port, for the length of a `with` block."""

    def __init__(self, binary, model):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(binary), "serve", "--model", str(model), "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self):
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/ready", timeout=2)
                return self.url
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.__exit__()
                    raise SystemExit("layertap serve did not become ready")
                time.sleep(0.2)

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin", default=os.environ.get("LAYERTAP_BIN", str(REPO / "target" / "release" / "layertap")))
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--resume-samples", type=int, default=400, help="samples of the kill-and-resume check")
    p.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    p.add_argument("--specforge-legacy", default=os.environ.get("SPECFORGE_LEGACY"),
                   help="a SpecForge source tree from before 2026-07, for its target-model interface")
    p.add_argument("--only", choices=["offline", "online"], default=None, help="run one half of the checks")
    p.add_argument("--legacy-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.legacy_child:
        return 0 if _legacy_child(args.url, Path(args.legacy_child), args.samples) else 1
    import tempfile

    from layertap_client import Client

    work = Path(args.work or tempfile.mkdtemp(prefix="layertap-trainers-"))
    work.mkdir(parents=True, exist_ok=True)
    ok = True
    with Server(args.bin, args.model) as url:
        with Client(url) as client:
            if args.only != "online":
                ok &= check_speculators(args.bin, url, client, work, args.samples)
                ok &= check_specforge(args.bin, url, client, work, args.samples)
            if args.only != "offline":
                ok &= check_speculators_online(url, client, work, args.samples)
                ok &= check_specforge_online(url, client, work, args.samples)
                ok &= check_specforge_legacy(url, args.specforge_legacy, args.samples)
        if args.only != "online":
            ok &= check_resume(args.bin, url, work, args.resume_samples)
    if args.only != "online":
        ok &= check_final_norm(args.bin)
    print("all trainer readers accepted layertap's output" if ok else "SOME CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
