"""One MLA paged-decode call of benchmarks/mla.py's rows, for a profiler: flashjit's
wrapper (fa2 or fa3) or FlashInfer's, planned once and run --calls times.

Usage: python benchmarks/dev/profile_mla.py [--row 1] [--lib flashjit|flashinfer] [--backend fa3] [--calls 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mla  # noqa: E402 (benchmarks/ on the path first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", type=int, default=1, help="index into benchmarks/mla.py's ROWS")
    parser.add_argument("--lib", choices=("flashjit", "flashinfer"), default="flashjit")
    parser.add_argument("--backend", default="fa3")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    label, batch, kv_len, heads, page_size = mla.ROWS[args.row]
    lib = __import__(args.lib)
    r = mla.make_row(batch, kv_len, heads, page_size)
    call = mla.runner(lib, args.backend, r, heads, page_size)
    for _ in range(args.calls):
        out = call()
    torch.cuda.synchronize()
    mla.check(out, r, kv_len, f"{args.lib} {args.backend} {label}", args.backend)
    print(f"{args.lib} {args.backend} {label}: checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
