"""Measures the launch order of CTAs (ops._plan.choose_band_items, work.cuh) in
one run: the planner's choice against fixed band counts, on fa2 prefill (bf16,
d128, one and two m16 fragments per warp; causal rows, where tile costs
differ) and on tensor-core paged decode rows. Every variant is checked against
a reference before it is timed. FlashInfer fa2 prefill closes the table when
importable.

Band counts: 1 keeps every work slot of a KV head together (the CTAs that
share its keys run at once); "all" gives each slot its own band (the KV head
varies fastest, long-first order across heads).

Usage: python benchmarks/dev/cta_order.py [--out FILE] [--skip-decode]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
from common import emit
from decode import BF16, D, PAGE, check, paged_cache, reference, time_us
from fa2_tilings import check as check_prefill
from fa2_tilings import flashinfer_cells, restore_tilings, tflops, wrapper
from prefill import bench_ms

import flashjit
from flashjit import jit, kernels
from flashjit.kernels.fa2 import Fa2Tiling
from flashjit.ops import _plan
from flashjit.spec import KernelSpec

TILINGS = {
    "one fragment": Fa2Tiling(4, 64, 2, True, 2, one_wait=True),
    "two fragments": Fa2Tiling(4, 64, 2, False, 2, frags_m=2, one_wait=True, fence_pv=True),
}
PREFILL_ROWS = [(16, 1024, True), (4, 4096, True), (1, 16384, True), (4, 4096, False)]
DECODE_ROWS = [("GQA 64x4k 32/8", 64, 4096, 32, 8), ("MHA 64x4k 32/32", 64, 4096, 32, 32),
               ("8x32k 64/8", 8, 32768, 64, 8)]
BANDS = ["planner", 1, 2, 4, 8, "all"]
_PLANNER = _plan.choose_band_items


def use_bands(bands) -> None:
    """Makes plan_work cut its items into `bands` launch bands ('planner': its own rule)."""
    if bands == "planner":
        _plan.choose_band_items = _PLANNER
    elif bands == "all":
        _plan.choose_band_items = lambda costs, heads, slots: 1
    else:
        _plan.choose_band_items = lambda costs, heads, slots: 0 if bands == 1 else _plan.ceil_div(len(costs), bands)


def prefill_table() -> list[str]:
    d, h = 128, 16
    header = " | ".join(f"{b}x{s}{' causal' if c else ''}" for b, s, c in PREFILL_ROWS)
    lines = [f"fa2 prefill, bf16, head_dim {d}, {h} heads, TFLOP/s", "", f"| tiling | bands | {header} |",
             "|---|---|" + "---|" * len(PREFILL_ROWS)]
    inputs = {(b, s): [torch.randn(b * s, h, d, device="cuda", dtype=BF16) for _ in range(3)]
              for b, s, _ in PREFILL_ROWS}
    default, wide = kernels.fa2.FA2_TILINGS[d], kernels.fa2.FA2_WIDE_TILINGS.pop(d, None)
    for name, tiling in TILINGS.items():
        kernels.fa2.FA2_TILINGS[d] = tiling
        jit._modules.clear()
        os.environ["FLASHJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cta-order-")
        jit.build_many([KernelSpec.make("batch_prefill_ragged", "bfloat16", d, backend="fa2", use_tensor_cores=True,
                                        causal=c).validate() for c in (False, True)])
        for bands in BANDS:
            use_bands(bands)
            try:
                worst = check_prefill(d)
                cells = []
                for b, s, causal in PREFILL_ROWS:
                    w = wrapper([s] * b, h, d, causal)
                    q, k, v = inputs[(b, s)]
                    ms = bench_ms(lambda: w.run(q, k, v))
                    per_band = w._plan.work.band_items
                    cells.append(f"{tflops(b, h, s, d, causal, ms):.0f} ({per_band or 'one'})")
                lines.append(f"| {name} (err/bound {worst:.2f}) | {bands} | " + " | ".join(cells) + " |")
            except Exception as exc:
                lines.append(f"| {name} | {bands} | failed: {type(exc).__name__}: {str(exc)[:200]} |")
            print(lines[-1], flush=True)
    restore_tilings(d, default, wide)
    use_bands("planner")
    cells = flashinfer_cells(PREFILL_ROWS, h, d, inputs)
    if cells:
        lines.append("| FlashInfer fa2 (same run) | - | " + " | ".join(cells) + " |")
    return lines


def decode_table() -> list[str]:
    jit._modules.clear()
    os.environ["FLASHJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cta-order-decode-")
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    lines = ["", f"tensor-core paged decode, bf16, head_dim {D}, page {PAGE}, NHD, random page order; µs per call "
             "(work slots per band)", "", "| bands | " + " | ".join(r[0] for r in DECODE_ROWS) + " |",
             "|---|" + "---|" * len(DECODE_ROWS)]
    cases = []
    for label, batch, kv_len, qo_heads, kv_heads in DECODE_ROWS:
        cache, indptr, indices, last = paged_cache(batch, kv_len, kv_heads)
        q = torch.randn(batch, qo_heads, D, dtype=BF16, device="cuda")
        cases.append((q, cache, indptr, indices, last, qo_heads, kv_heads, reference(q, cache, indices, kv_len)))
    for bands in ("planner", 1, "all"):
        use_bands(bands)
        cells = []
        for q, cache, indptr, indices, last, qo_heads, kv_heads, ref in cases:
            w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD", use_tensor_cores=True)
            w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16, kv_data_type=BF16)
            ok, max_err, _ = check(w.run(q, cache), ref)
            if not ok:
                cells.append(f"FAIL max err {max_err:.3g}")
                continue
            us, _, _ = time_us(lambda w=w, q=q, cache=cache: w.run(q, cache), 30)
            cells.append(f"{us:.1f} ({w._plan.work.band_items or 'one'})")
        lines.append(f"| {bands} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    use_bands("planner")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()
    lines = [f"device: {torch.cuda.get_device_name()}", ""] + prefill_table()
    if not args.skip_decode:
        lines += decode_table()
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
