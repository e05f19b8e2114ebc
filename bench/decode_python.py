"""Time the Python client's zstd decoding of a large answer, with and without the frame
recording its size: `python bench/decode_python.py [--tokens 4096] [--width 10240] [--reps 5]`
(width = layers x hidden; 5 x 2,048 is the MoE shape's answer). Synthetic bf16 states (normal
values), compressed at level 1 like the server's default. Prints one JSON line per way."""

import argparse
import io
import json
import time

import numpy as np
import zstandard

from layertap_client._common import decompress


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--width", type=int, default=5 * 2048)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    x = np.random.default_rng(0).standard_normal(a.tokens * a.width).astype(np.float32) * 0.7
    raw = (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    for sized in (False, True):
        c = zstandard.ZstdCompressor(level=1, write_content_size=sized)
        out = io.BytesIO()
        with c.stream_writer(out, closefd=False, size=len(raw) if sized else -1) as w:
            w.write(raw)
        data = out.getvalue()
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            got = decompress(data)
            times.append(time.perf_counter() - t)
            assert got == raw
        print(
            json.dumps(
                {
                    "frame_records_size": sized,
                    "mb": round(len(raw) / 1e6, 1),
                    "ms": [round(t * 1e3, 1) for t in times],
                    "gb_per_s_best": round(len(raw) / min(times) / 1e9, 3),
                    "zstandard": zstandard.__version__,
                }
            )
        )


if __name__ == "__main__":
    main()
