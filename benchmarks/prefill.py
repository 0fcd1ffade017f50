"""Prefill throughput, side by side in one run on one GPU: flashjit against
PyTorch SDPA (flash and cuDNN backends) and FlashInfer (fa2, fa3) when importable.
The benchmark lives in flashjit.bench.prefill (its docstring says what a row
measures); `flashjit bench` runs it too. This script prints its table and
appends it to --out, as it always has.

Usage: python benchmarks/prefill.py [--quick] [--rounds 3] [--out results.md]
"""

from __future__ import annotations

import argparse
import sys

from common import emit

from flashjit.bench import prefill
# benchmarks/dev/ import these from here:
from flashjit.bench.prefill import attention_flops, flashinfer_ragged, flashjit_ragged, indptr  # noqa: F401
from flashjit.bench.report import prefill_row_line, prefill_table
from flashjit.bench.timing import bench_ms  # noqa: F401


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="head_dim 128, S = 1k and 4k only")
    parser.add_argument("--head-dims", type=int, nargs="+", help="override the head dims")
    parser.add_argument("--seqlens", type=int, nargs="+", help="override the sequence lengths")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed samples per cell: reps per row x this many shuffled passes "
                             "(flashjit.bench.prefill)")
    parser.add_argument("--only", nargs="+", help="implementations to run (default: all available)")
    parser.add_argument("--no-skewed", action="store_true", help="leave out the skewed batch and the decode line")
    parser.add_argument("--out")
    args = parser.parse_args()
    impls = prefill.implementations(args.only)
    rows = prefill.rows(args.quick, args.head_dims, args.seqlens, skewed=not args.no_skewed)
    section = prefill.run(rows, impls, rounds=args.rounds,
                          on_row=lambda section, row: print(prefill_row_line(row, section["impls"]), flush=True))
    emit(prefill_table(section), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
