#!/usr/bin/env bash
# The online source against bench_http (bench/gpu/online_compare.sh) on one server of the dense
# Qwen3-8B shape (the random bf16 checkpoint of bench/gpu/load_check.sh, in WORK): 300 sequences
# (log-normal lengths 100..4,096 around 800, seed 0), taps 2, 18, 33, bfloat16 answers. Run on the
# GPU machine from the repository root after load_check.sh, with the client on PYTHONPATH:
#
#   source bench/gpu/cuda-libs.sh && PYTHONPATH=<layertap_client> bench/gpu/online_8b.sh
#
# One JSON line per contender on stdout. WORKLOAD_ONLY=1: only the workload (online_probe.sh's).
# SEQUENCES=N: N sequences drawn the same way (the first 300 with the default workload's lengths), written
# as workload-N.json(l) in WORK; a longer pass, where the source's start weighs less.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/dev/shm/load-check}
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
# shellcheck source=bench/gpu/online_compare.sh
source bench/gpu/online_compare.sh
SEQUENCES=${SEQUENCES:-300}
name=workload
[[ "$SEQUENCES" == 300 ]] || name="workload-$SEQUENCES"
python3 - "$WORK" "$SEQUENCES" "$name" <<'PY'
import json, sys
import numpy as np
work, n_seq, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
lens = np.clip(rng.lognormal(np.log(800), 0.6, 300).astype(int), 100, 4096)
if n_seq > 300:  # drawn after the first 300, so those stay the default workload's lengths
    lens = np.concatenate([lens, np.clip(rng.lognormal(np.log(800), 0.6, n_seq - 300).astype(int), 100, 4096)])
lens = lens[:n_seq]
with open(f"{work}/{name}.jsonl", "w") as f:
    for n in lens:
        f.write(json.dumps({"input_ids": rng.integers(0, 151936, n).tolist()}) + "\n")
json.dump({"layers": [2, 18, 33], "dtype": "bfloat16", "file": f"{name}.jsonl"}, open(f"{work}/{name}.json", "w"))
print(json.dumps({"step": "workload", "sequences": int(len(lens)), "tokens": int(lens.sum())}))
PY
[[ -z "${WORKLOAD_ONLY:-}" ]] || exit 0
# a sample is ~940 tokens: ~22 ms of the server's time at 42,000 tokens/s; the slow consumer takes 40
online_compare "$WORK" "$WORK/$name.json" 40
