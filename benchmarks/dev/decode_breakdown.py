"""Per-kernel GPU time of paged decode calls (attention, split-KV merge), from
torch.profiler: where a split-KV row's time goes beyond its attention kernel.
--batch-invariant adds each row planned in batch-invariant mode (fixed chunks,
the prefill kernel, the fold merge) beside the planner's choices. With PDL a
merge kernel starts while the attention kernel runs, so its duration includes
the wait; the last column comes from the kernels' timestamps instead: the time
between successive calls' attention kernels' ends (the call's time on a
GPU-paced loop).

Usage: python benchmarks/dev/decode_breakdown.py [--rows LABEL ...] [--batch-invariant] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
from common import emit, kernel_spans, kernel_times
from decode import BF16, D, PAGE, paged_cache

import flashjit

ROWS = [("GQA 64x4k 32/8", 64, 4096, 32, 8), ("MHA 64x4k 32/32", 64, 4096, 32, 32),
        ("split 1x32k 32/8", 1, 32768, 32, 8),
        ("split 1x128k 32/8", 1, 131072, 32, 8)]
CALLS = 20


def short_name(kernel: str) -> str:
    for label in ("merge_split_states", "merge_fold_states", "decode_attention", "fa2_attention", "fa3_attention",
                  "cuda_core_attention"):
        if label in kernel:
            return label
    return kernel[:40]


def call_period(spans) -> float:
    """Mean µs between successive calls' ends, from kernel_spans: the call's
    time on a GPU-paced loop. (A kernel's own span is no measure of its tail:
    a dependent grid (PDL) starts before its primary ends.)"""
    ends = sorted(end for name, _, end in spans if "_attention" in name)
    return (ends[-1] - ends[0]) / max(len(ends) - 1, 1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rows", nargs="+", help="only the rows whose label starts with one of these")
    parser.add_argument("--batch-invariant", action="store_true", help="also each row in batch-invariant mode")
    args = parser.parse_args()
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    lines = [f"device: {torch.cuda.get_device_name()}; bf16 paged decode, head_dim {D}, page {PAGE}; "
             f"mean µs per call over {CALLS} calls (torch.profiler)", "",
             "| row | cores | split chunk (keys) | kernel | µs | µs per call |", "|---|---|---|---|---|---|"]
    for label, batch, kv_len, qo_heads, kv_heads in ROWS:
        if args.rows and not any(label.startswith(r) for r in args.rows):
            continue
        cache, indptr, indices, last = paged_cache(batch, kv_len, kv_heads)
        q = torch.randn(batch, qo_heads, D, dtype=BF16, device="cuda")
        # The planner's choice, the same row with splitting disabled, and batch-invariant mode.
        cases = [(False, False, False), (True, False, False), (False, True, False), (True, True, False)]
        cases += [(True, False, True)] if args.batch_invariant else []
        for tensor_cores, no_split, invariant in cases:
            w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace, use_tensor_cores=tensor_cores)
            w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16, disable_split_kv=no_split,
                   batch_invariant=invariant)
            chunk = w._plan.work.kv_chunk or "none"  # the plan's split, for the table
            chunk = f"{chunk} (split disabled)" if no_split else f"{chunk} (batch-invariant)" if invariant else chunk
            period = call_period(kernel_spans(lambda: w.run(q, cache), CALLS))
            for kernel, us in sorted(kernel_times(lambda: w.run(q, cache), CALLS).items(), key=lambda kv: -kv[1]):
                lines.append(f"| {label} | {'tensor' if tensor_cores else 'CUDA'} | {chunk} | "
                             f"{short_name(kernel)} | {us:.1f} | {period:.1f} |")
                print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
