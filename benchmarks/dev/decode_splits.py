"""Times paged decode rows under the planner's split and under fixed split
sizes (pages per chunk), to check the planner's choice against the GPU.

Usage: python benchmarks/dev/decode_splits.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
from common import emit
from decode import BF16, D, PAGE, check, paged_cache, reference, time_us

import flashjit

ROWS = [("GQA 64x4k 32/8", 64, 4096, 32, 8), ("MHA 64x4k 32/32", 64, 4096, 32, 32),
        ("8x32k 64/8", 8, 32768, 64, 8)]
SPLITS = [None, 32, 64, 88, 128, 256]  # pages per chunk; None: the planner's choice


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    lines = [f"device: {torch.cuda.get_device_name()}; bf16 paged decode, head_dim {D}, page {PAGE}; "
             "cells: µs (keys per chunk)", "",
             "| row | cores | " + " | ".join("planner" if s is None else f"{s} pages" for s in SPLITS) + " | no split |",
             "|---|---|" + "---|" * (len(SPLITS) + 1)]
    for label, batch, kv_len, qo_heads, kv_heads in ROWS:
        cache, indptr, indices, last = paged_cache(batch, kv_len, kv_heads)
        q = torch.randn(batch, qo_heads, D, dtype=BF16, device="cuda")
        ref = reference(q, cache, indices, kv_len)
        for tensor_cores in (False, True):
            cells = []
            for split in SPLITS + ["off"]:
                w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace, use_tensor_cores=tensor_cores)
                kw = {"disable_split_kv": True} if split == "off" else {"fixed_split_size": split}
                w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16, **kw)
                ok, max_err, _ = check(w.run(q, cache), ref)
                if not ok:
                    cells.append(f"FAIL {max_err:.3g}")
                    continue
                us = time_us(lambda w=w: w.run(q, cache), args.reps)[0]
                cells.append(f"{us:.1f} ({w._plan.work.kv_chunk or '-'})")
            lines.append(f"| {label} | {'tensor' if tensor_cores else 'CUDA'} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
