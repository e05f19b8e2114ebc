#!/usr/bin/env bash
# The online source against bench_http (bench/gpu/online_compare.sh) on one server of the
# Qwen3.5/3.6-27B hybrid shape at full depth (64 layers, random weights never written to disk:
# --synthetic-weights), DFlash's five taps (2, 17, 32, 47, 62), bfloat16 answers, the 200
# sequences of synthetic_manifest.py's workload. Run on the GPU machine from the repository
# root, with the client on PYTHONPATH:
#
#   source bench/gpu/cuda-libs.sh && PYTHONPATH=<layertap_client> bench/gpu/online_27b.sh
#
# One JSON line per contender on stdout.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/layertap-synthetic}
# shellcheck source=bench/gpu/serve.sh
source bench/gpu/serve.sh
# shellcheck source=bench/gpu/online_compare.sh
source bench/gpu/online_compare.sh
mkdir -p "$WORK"
[[ -f "$WORK/27b/bench.json" ]] || python3 bench/gpu/synthetic_manifest.py --shape 27b --out "$WORK/27b" --sequences 200 \
  | sed 's/^{/{"step":"manifest",/'
# a sample is ~900 tokens: ~80 ms of the server's time at 11,000 tokens/s; the slow consumer takes 120
online_compare "$WORK/27b" "$WORK/27b/workload.json" 120 --synthetic-weights
