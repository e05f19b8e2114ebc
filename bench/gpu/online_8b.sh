#!/usr/bin/env bash
# The online source (layertap_client.online, bench/gpu/online_bench.py) against the HTTP client
# (examples/bench_http.rs) on one server of the dense Qwen3-8B shape (the random bf16 checkpoint
# of bench/gpu/load_check.sh, in WORK): the same 300 sequences (log-normal lengths 100..4,096
# around 800, seed 0), taps 2, 18, 33, bfloat16 answers. Run on the GPU machine from the
# repository root after load_check.sh, with the client on PYTHONPATH:
#
#   source bench/gpu/cuda-libs.sh && PYTHONPATH=<layertap_client> bench/gpu/online_8b.sh
#
# One JSON line per contender on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/dev/shm/load-check}
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
python3 - "$WORK" <<'EOF'
import json, sys
import numpy as np
rng = np.random.default_rng(0)
lens = np.clip(rng.lognormal(np.log(800), 0.6, 300).astype(int), 100, 4096)
with open(f"{sys.argv[1]}/workload.jsonl", "w") as f:
    for n in lens:
        f.write(json.dumps({"input_ids": rng.integers(0, 151936, n).tolist()}) + "\n")
json.dump({"layers": [2, 18, 33], "dtype": "bfloat16", "file": "workload.jsonl"}, open(f"{sys.argv[1]}/workload.json", "w"))
print(json.dumps({"step": "workload", "sequences": 300, "tokens": int(lens.sum())}))
EOF
start_server "$WORK" cuda:0 "$WORK.serve.log"
w="$WORK/workload.json"
url="http://127.0.0.1:$PORT"
clients "$w" 64 zstd | sed 's/^{/{"contender":"bench_http zstd, 64 in flight",/'
python3 bench/gpu/online_bench.py --url "$url" --workload "$w" --workers 0
python3 bench/gpu/online_bench.py --url "$url" --workload "$w" --workers 1
python3 bench/gpu/online_bench.py --url "$url" --workload "$w" --workers 4
python3 bench/gpu/online_bench.py --url "$url" --workload "$w" --workers 0 --step-ms 20
clients "$w" 64 identity | sed 's/^{/{"contender":"bench_http identity, 64 in flight",/'
kill -TERM "$server"
