#!/usr/bin/env bash
# Compiles every CUDA kernel (kernels/*.cu) for every compute capability layertap ships machine
# code for (90 as sm_90a), and to PTX for the newest, as build.rs does for `--features cuda` — on a machine
# without a GPU, with nvcc 13.0 from PyPI wheels (installed on first use under .cache/, about
# 100 MB). Candle's own kernels are PTX for CUDA_COMPUTE_CAP and are not compiled here.
#   scripts/check-cuda-archs.sh           archs: LAYERTAP_CUDA_ARCHS, default build.rs's list
# Exit status 1 if any kernel fails to compile for any of them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="$ROOT/.cache/cuda-nvcc"
R="$CACHE/nvidia/cu13"
WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
if [ ! -x "$R/bin/nvcc" ]; then
  echo "== installing nvcc 13.0 from PyPI into $CACHE"
  mkdir -p "$CACHE/whl"
  python3 -m pip download -q --no-deps -d "$CACHE/whl" "${WHEELS[@]}"
  for w in "$CACHE"/whl/*.whl; do python3 -m zipfile -e "$w" "$CACHE"; done
  chmod +x "$R"/bin/* "$R"/nvvm/bin/* 2>/dev/null || true
fi
NVCC="$R/bin/nvcc"
default=$(sed -n 's/^const DEFAULT_ARCHS: &str = "\(.*\)";/\1/p' build.rs)
ARCHS="${LAYERTAP_CUDA_ARCHS:-$default}"
IFS=',' read -r -a list <<<"$ARCHS"
newest=$(printf '%s\n' "${list[@]}" | sort -n | tail -n 1)
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
echo "== $("$NVCC" --version | tail -n 1); compute capabilities ${ARCHS}, PTX ${newest}"
fail=0
for f in kernels/*.cu; do
  name=$(basename "$f" .cu)
  for a in "${list[@]}"; do
    # 90 as build.rs compiles it: sm_90a, Hopper's arch-specific target (warpgroup MMA).
    t="$a"
    [ "$a" = 90 ] && t=90a
    if "$NVCC" --cubin -O3 -std=c++17 --use_fast_math -arch="sm_$t" -o "$OUT/$name.sm_$t.cubin" "$f"; then
      echo "ok   $f sm_$t ($(stat -c %s "$OUT/$name.sm_$t.cubin") bytes)"
    else
      echo "FAIL $f sm_$t"; fail=1
    fi
  done
  if "$NVCC" --ptx -O3 -std=c++17 --use_fast_math -arch="compute_$newest" -o "$OUT/$name.ptx" "$f"; then
    echo "ok   $f PTX compute_$newest ($(stat -c %s "$OUT/$name.ptx") bytes)"
  else
    echo "FAIL $f PTX compute_$newest"; fail=1
  fi
done
exit "$fail"
