"""Compares fa2 tilings for one head_dim in one run: each variant is built into
its own cache, checked against float64 on a ragged batch (within its profile),
then timed on the prefill rows, beside FlashInfer fa2 when importable.

Usage: python benchmarks/fa2_tilings.py [--head-dim 128]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch
from common import emit
from prefill import bench_ms, flashinfer_ragged, indptr

import flashjit
from flashjit import jit, kernels
from flashjit.kernels import Fa2Tiling
from flashjit.reference import ragged_reference
from flashjit.spec import KernelSpec

VARIANTS = {
    "2 frags, 32 keys x 3 stages, Q smem": Fa2Tiling(4, 32, 3, False, 2, frags_m=2),
    "1 frag, 64 keys x 2 stages, Q regs": Fa2Tiling(4, 64, 2, True, 2, frags_m=1),
    "8 warps, 64 keys x 2 stages, Q regs": Fa2Tiling(8, 64, 2, True, 1, frags_m=1),
    "8 warps, 32 keys x 3 stages, Q regs": Fa2Tiling(8, 32, 3, True, 1, frags_m=1),
    "2 frags, 32 keys x 2 stages, Q smem": Fa2Tiling(4, 32, 2, False, 2, frags_m=2),
}
ROWS = [(16, 1024, False), (16, 1024, True), (4, 4096, False), (4, 4096, True)]


def wrapper(lens, h, d, causal):
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr(lens), indptr(lens), h, h, d, causal=causal, q_data_type=torch.bfloat16)
    return w


def check(d: int) -> float:
    """Worst err/bound over a ragged batch, causal and not."""
    lens, h, worst = [1, 70, 300, 1000], 4, 0.0
    q, k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        out = wrapper(lens, h, d, causal).run(q, k, v)
        ref, _ = ragged_reference(q, k, v, indptr(lens).tolist(), indptr(lens).tolist(), causal=causal)
        spec = KernelSpec.make("batch_prefill_ragged", "bfloat16", d, use_tensor_cores=True, causal=causal,
                               return_lse=True)
        tol = flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=max(lens), sm_scale=1 / math.sqrt(d))
        worst = max(worst, tol.assert_close(out, ref, "fa2 tiling check"))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--out")
    args = parser.parse_args()
    d = args.head_dim
    h = 2048 // d
    header = " | ".join(f"{b}x{s}{' causal' if c else ''}" for b, s, c in ROWS)
    lines = [f"device: {torch.cuda.get_device_name()}, bf16, head_dim {d}, TFLOP/s", "",
             f"| variant | err/bound | smem | {header} |", "|---|---|---|" + "---|" * len(ROWS)]
    inputs = {(b, s): [torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
              for b, s, _ in ROWS}
    for name, tiling in VARIANTS.items():
        kernels.FA2_TILINGS[d] = tiling
        jit._modules.clear()
        os.environ["FLASHJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fa2-tiling-")
        try:
            worst = check(d)
            cells = []
            for b, s, causal in ROWS:
                run = wrapper([s] * b, h, d, causal).run
                q, k, v = inputs[(b, s)]
                ms = bench_ms(lambda: run(q, k, v))
                cells.append(f"{4 * b * h * s * s * d / (2 if causal else 1) / ms / 1e9:.0f}")
            lines.append(f"| {name} | {worst:.3f} | {tiling.smem_bytes(KernelSpec.make('single_prefill', 'bfloat16', d))} | "
                         + " | ".join(cells) + " |")
        except Exception as exc:
            lines.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} |")
        print(lines[-1], flush=True)
    try:
        cells = []
        for b, s, causal in ROWS:
            run = flashinfer_ragged("fa2")([s] * b, [s] * b, h, d, causal, torch.bfloat16)
            q, k, v = inputs[(b, s)]
            ms = bench_ms(lambda: run(q, k, v))
            cells.append(f"{4 * b * h * s * s * d / (2 if causal else 1) / ms / 1e9:.0f}")
        lines.append("| FlashInfer fa2 (same run) | - | - | " + " | ".join(cells) + " |")
    except Exception as exc:
        print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
