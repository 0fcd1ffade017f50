"""How a timing sample's size moves benchmarks/mla.py's numbers: each row's
flashjit fa3 and FlashInfer fa3 (when importable) calls timed as samples of
N back-to-back calls (CUDA events around them, flashjit.bench.timing.event_ms)
for several N, and for the N of 2-ms samples (calls_per_sample(fn, 2.0), what
benchmarks/mla.py took before its 20-ms default), every (library, N) cell once
per pass in a fresh random order; a cell is the median us per call over its
samples. A sample starts on an idle GPU, so what its first call costs beyond
the others' falls inside it once: the smaller N, the more of it each call
carries. The last column estimates that cost: (us at 1 call - us at the
largest N) / (1 - 1 / largest N).

Usage: python benchmarks/dev/mla_sample_size.py [--rows 1 3] [--calls 1 4 16 50] [--passes 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: mla, common
import mla  # noqa: E402

import flashjit  # noqa: E402
from flashjit.bench.timing import calls_per_sample, event_ms  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(range(len(mla.ROWS))),
                        help="indices into benchmarks/mla.py's ROWS")
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 4, 16, 50])
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    libs = [("flashjit fa3", flashjit)]
    try:
        import flashinfer

        libs.append(("flashinfer fa3", flashinfer))
    except Exception as exc:  # noqa: BLE001 (any import failure means: no FlashInfer column)
        print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(f"MLA per-call us by calls per sample, {torch.cuda.get_device_name()}, bf16, {args.passes} passes\n")
    print("| row | library | " + " | ".join(f"{n} calls" for n in args.calls)
          + " | 2-ms samples (calls) | first call's extra us |")
    print("|---|---|" + "---|" * (len(args.calls) + 2))
    rng = random.Random(0)
    for row in args.rows:
        label, batch, kv_len, heads, page_size = mla.ROWS[row]
        r = mla.make_row(batch, kv_len, heads, page_size)
        fns = {name: mla.runner(lib, "fa3", r, heads, page_size) for name, lib in libs}
        short = {name: calls_per_sample(fn, 2.0) for name, fn in fns.items()}
        cells = sorted({(name, n) for name in fns for n in args.calls + [short[name]]})
        samples = {cell: [] for cell in cells}
        for _ in range(args.passes):
            rng.shuffle(cells)
            for name, n in cells:
                samples[(name, n)].append(event_ms(fns[name], n) / n * 1e3)
        for name in fns:
            us = {n: statistics.median(samples[(name, n)]) for n in args.calls + [short[name]]}
            most = max(args.calls)
            extra = (us[1] - us[most]) / (1 - 1 / most) if 1 in us else float("nan")
            print(f"| {label} | {name} | " + " | ".join(f"{us[n]:.1f}" for n in args.calls)
                  + f" | {us[short[name]]:.1f} ({short[name]}) | {extra:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
