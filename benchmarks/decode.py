"""Paged decode and KV append, side by side in one run on one GPU: flashjit with
use_tensor_cores=False and True, and FlashInfer (both) when importable. The
benchmark lives in flashjit.bench.decode (its docstring says what a cell
measures and how it is checked); `flashjit bench` runs it too. This script
prints its table, appends it to --out and writes the raw numbers to --json, as
it always has; a flashjit mismatch or error makes the exit status 1 (an FP8
configuration flashjit does not generate yet is a skipped cell, not an error).
--kv-dtype bf16 e4m3 e5m2: the KV caches of each decode row (default bf16); an
FP8 one is the row's bf16 cache quantised per tensor (flashjit.bench.decode_fp8).

Usage: python benchmarks/decode.py [--quick] [--kv-dtype bf16 e4m3 ...] [--out results.md] [--json raw.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import emit

from flashjit.bench import decode
from flashjit.bench.decode_fp8 import kv_dtype_arg
# benchmarks/dev/ import these from here:
from flashjit.bench.decode import BF16, D, PAGE, check, libraries, paged_cache, reference  # noqa: F401
from flashjit.bench.report import decode_header, decode_row_line, decode_table, write_json
from flashjit.bench.timing import time_us  # noqa: F401


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="decode rows GQA 64x4k and split 1x32k only, no append")
    parser.add_argument("--reps", type=int, default=50, help="timed samples per cell (median reported)")
    parser.add_argument("--kv-dtype", nargs="+", type=kv_dtype_arg, default=["bf16"], metavar="KV_DTYPE",
                        help="KV caches of each decode row: bf16 (default), e4m3, e5m2 (also fp8_e4m3, "
                             "float8_e4m3fn, ...); FP8 cells count 1 byte an element, against the copy bandwidth")
    parser.add_argument("--out", help="append the markdown table to this file")
    parser.add_argument("--json", help="write raw numbers to this file")
    args = parser.parse_args()
    printed = []

    def on_row(section, label):
        if not printed:  # the header needs the bandwidth baselines, measured first
            print("\n".join(decode_header(section)), flush=True)
            printed.append(True)
        print(decode_row_line(section, label), flush=True)

    section = decode.run(decode.rows(args.quick), libraries(), reps=args.reps, on_row=on_row,
                         kv_dtypes=args.kv_dtype)
    print(flush=True)
    emit(decode_table(section), args.out)
    if args.json:
        write_json(section, Path(args.json))
    return 1 if section["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
