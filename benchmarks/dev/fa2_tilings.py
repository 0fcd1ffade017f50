"""Compares fa2 (or, with --backend fa3, fa3) tilings for one head_dim in one run: each variant is built into
its own cache and checked against float64 on a ragged batch (within its
profile); then every row is timed for all of them (and FlashInfer fa2 when
importable) back to back, in `--rounds` rounds whose order alternates, and a
cell is the mean of its rounds (why: common.round_orders).
`--baseline-templates DIR [DIR ...]` (copies of other templates/ folders, e.g.
from `git archive`) adds the current default tiling built from each of those
sources, so that kernel changes are measured against the code before them in
the same run; `--no-variants` leaves out the alternative tilings below, and
`--variant 'Fa2Tiling(...)'` (repeatable) adds one. The
last line gives each source's largest difference between two rounds of one
cell: the noise a difference between sources has to clear.

Usage: python benchmarks/dev/fa2_tilings.py [--backend fa2|fa3] [--head-dim 128] [--baseline-templates DIR ...] [--no-variants]
       [--variant 'Fa2Tiling(...)' ...] [--no-flashinfer] [--rounds 2]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
from common import emit, round_orders, use_templates
from prefill import attention_flops, bench_ms, flashinfer_ragged, indptr

import flashjit
from flashjit import jit, kernels
from flashjit.kernels.fa2 import Fa2Tiling
from flashjit.kernels.fa3 import Fa3Tiling
from flashjit.reference import ragged_reference
from flashjit.spec import KernelSpec

# Per head_dim: name -> tiling; the current default is always measured first.
VARIANTS = {
    64: {
        # FA2_TILINGS[64]: what a library with an sm_80 / sm_89 target takes.
        "two waits per tile, P.V after the softmax (FA2_TILINGS)": Fa2Tiling(4, 64, 2, True, 2, frags_m=2),
        "64-key tiles x 2 stages, one wait per tile": Fa2Tiling(4, 64, 2, True, 2, frags_m=2, one_wait=True),
        # The wide d64 tiling with cp.async K/V copies instead of TMA.
        "64-key tiles x 3 stages, one wait per tile": Fa2Tiling(4, 64, 3, True, 2, frags_m=2, one_wait=True),
    },
    128: {
        # The wide tiling waiting for K at the top of a tile and for V before P.V.
        "two fragments, two waits per tile": Fa2Tiling(4, 64, 2, False, 2, frags_m=2, fence_pv=True),
    },
    256: {
        "32-key tiles, two waits per tile": Fa2Tiling(4, 32, 2, False, 2),
        # One CTA per SM, past SMEM_BUDGET (sm_90a-class only): each K/V tile feeds 8 warps.
        "8 warps (128 rows), 32-key tiles, 128 KB": Fa2Tiling(8, 32, 2, False, 1, one_wait=True),
        "8 warps (128 rows), 64-key tiles, 192 KB": Fa2Tiling(8, 64, 2, False, 1, one_wait=True),
        # The wide d256 tiling with a CTA barrier per tile instead of per-slot release.
        "8 warps, 64-key TMA tiles, a CTA barrier per tile": Fa2Tiling(8, 64, 2, False, 1, one_wait=True, tma_kv=True),
    },
}
# fa3 (--backend fa3): the same per head_dim, for FA3_TILINGS.
# "next Q prefetched": a second Q buffer per consumer warpgroup (Fa3QPrefetchTraits);
# "turns": the consumers take turns issuing their products (Fa3PingPongTraits).
FA3_VARIANTS = {
    64: {"one CTA per position": Fa3Tiling(128, 3, overlap=True), "persistent": Fa3Tiling(128, 3, True, True),
         "next Q prefetched": Fa3Tiling(128, 3, True, True, q_buffers=2),
         "turns": Fa3Tiling(128, 3, True, True, pingpong=True),
         "next Q prefetched, turns": Fa3Tiling(128, 3, True, True, q_buffers=2, pingpong=True)},
    96: {"next Q prefetched": Fa3Tiling(128, 2, True, True, q_buffers=2),
         "turns": Fa3Tiling(128, 2, True, True, pingpong=True)},
    128: {"one CTA per position": Fa3Tiling(128, 2, overlap=True), "persistent": Fa3Tiling(128, 2, True, True),
          "next Q prefetched": Fa3Tiling(128, 2, True, True, q_buffers=2),
          "turns": Fa3Tiling(128, 2, True, True, pingpong=True),
          "next Q prefetched, turns": Fa3Tiling(128, 2, True, True, q_buffers=2, pingpong=True)},
    256: {"one CTA per position": Fa3Tiling(64, 2, overlap=True), "persistent": Fa3Tiling(64, 2, True, True),
          "turns": Fa3Tiling(64, 2, overlap=True, pingpong=True)},
}
ROWS = [(16, 1024, False), (16, 1024, True), (4, 4096, False), (4, 4096, True), (1, 16384, False),
        (1, 16384, True)]


BACKEND = "fa2"  # --backend


def wrapper(lens, h, d, causal):
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                      backend=BACKEND)
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
                               return_lse=True, backend=BACKEND)
        tol = flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=max(lens), sm_scale=1 / math.sqrt(d))
        worst = max(worst, tol.assert_close(out, ref, f"{BACKEND} tiling check"))
    return worst


def tflops(b: int, h: int, s: int, d: int, causal: bool, ms: float) -> float:
    return attention_flops(b, h, s, d, causal) / ms / 1e9


def flashinfer_runs(rows, h: int, d: int, inputs) -> list | None:
    """FlashInfer fa2's callables for `rows` ((batch, seqlen, causal), inputs by
    (batch, seqlen)); None (with the reason on stderr) when it does not run here."""
    try:
        runs = []
        for b, s, causal in rows:
            run = flashinfer_ragged(BACKEND)([s] * b, [s] * b, h, d, causal, torch.bfloat16)
            q, k, v = inputs[(b, s)]
            run(q, k, v)
            runs.append(lambda run=run, q=q, k=k, v=v: run(q, k, v))
        return runs
    except Exception as exc:
        print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def flashinfer_cells(rows, h: int, d: int, inputs) -> list[str] | None:
    """FlashInfer fa2's TFLOP/s on `rows`, each timed once; None when it does not run here."""
    runs = flashinfer_runs(rows, h, d, inputs)
    if runs is None:
        return None
    return [f"{tflops(b, h, s, d, causal, bench_ms(run)):.0f}" for (b, s, causal), run in zip(rows, runs)]


def restore_tilings(d: int, default, wide) -> None:
    table(d)[d] = default
    if wide is not None:
        kernels.fa2.FA2_WIDE_TILINGS[d] = wide


def table(d: int) -> dict:
    """The default tilings that --backend's kernels take."""
    return kernels.fa3.FA3_TILINGS if BACKEND == "fa3" else kernels.fa2.FA2_TILINGS


def main() -> int:
    global BACKEND
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["fa2", "fa3"], default="fa2")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--baseline-templates", type=Path, nargs="+", default=[])
    parser.add_argument("--no-variants", action="store_true")
    parser.add_argument("--variant", action="append", default=[], help="a Fa2Tiling(...) expression to time too")
    parser.add_argument("--no-flashinfer", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    BACKEND = args.backend
    d = args.head_dim
    h = 2048 // d
    header = " | ".join(f"{b}x{s}{' causal' if c else ''}" for b, s, c in ROWS)
    lines = [f"device: {torch.cuda.get_device_name()}, {BACKEND}, bf16, head_dim {d}, TFLOP/s, mean of {args.rounds} "
             "interleaved rounds", "", f"| variant | err/bound | smem | {header} |",
             "|---|---|---|" + "---|" * len(ROWS)]
    inputs = {(b, s): [torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
              for b, s, _ in ROWS}
    default = table(d)[d]
    wide = kernels.fa2.FA2_WIDE_TILINGS.get(d) if BACKEND == "fa2" else None
    # The defaults as shipped (with a wide tiling, the rows take it on this GPU's
    # arch when it fits); a variant replaces both for every row.
    wide_note = f", where every target holds {wide.min_blocks_per_sm} per SM: {wide}" if wide else ""
    sources = [(f"default {default}{wide_note}", None, None)]
    sources[:0] = [(f"default, sources from {folder.name}", None, folder.resolve())
                   for folder in args.baseline_templates]
    if not args.no_variants:
        variants = (FA3_VARIANTS if BACKEND == "fa3" else VARIANTS).get(d, {})
        sources += [(name, tiling, None) for name, tiling in variants.items()]
    sources += [(text, eval(text, {"Fa2Tiling": Fa2Tiling, "Fa3Tiling": Fa3Tiling}), None) for text in args.variant]
    budget = kernels.common.SMEM_BUDGET
    # Build, check and plan every source; its wrappers keep their own modules.
    timed = []  # (label, row callables)
    for name, tiling, templates in sources:
        # A variant may exceed the shipped budget (one CTA per SM on an sm_90a-class part).
        kernels.common.SMEM_BUDGET = max(budget, (tiling or default).smem_bytes(KernelSpec.make("single_prefill", "bfloat16", d)))
        table(d)[d] = tiling or default
        if BACKEND == "fa2":  # the shipped wide tiling stands beside the default alone
            if tiling is None and wide is not None:
                kernels.fa2.FA2_WIDE_TILINGS[d] = wide
            else:
                kernels.fa2.FA2_WIDE_TILINGS.pop(d, None)
        use_templates(templates)
        jit._modules.clear()
        os.environ["FLASHJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"{BACKEND}-tiling-")
        try:
            # Both masks' libraries in one parallel build instead of one at a time on first use.
            jit.build_many([KernelSpec.make("batch_prefill_ragged", "bfloat16", d, backend=BACKEND, use_tensor_cores=True,
                                            causal=c).validate() for c in (False, True)])
            worst = check(d)
            runs = []
            for b, s, causal in ROWS:
                run = wrapper([s] * b, h, d, causal).run
                q, k, v = inputs[(b, s)]
                runs.append(lambda run=run, q=q, k=k, v=v: run(q, k, v))
            smem = (tiling or wide or default).smem_bytes(KernelSpec.make("single_prefill", "bfloat16", d))
            timed.append((f"| {name} | {worst:.3f} | {smem} |", runs))
        except Exception as exc:
            lines.append(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:300]} |")
            print(lines[-1], flush=True)
    restore_tilings(d, default, wide)
    kernels.common.SMEM_BUDGET = budget
    use_templates(None)
    fi_runs = None if args.no_flashinfer else flashinfer_runs(ROWS, h, d, inputs)
    if fi_runs:
        timed.append((f"| FlashInfer {BACKEND} (same run) | - | - |", fi_runs))

    # rates[source][row]: TFLOP/s of each round.
    rates = [[[] for _ in ROWS] for _ in timed]
    for order in round_orders(list(range(len(timed))), args.rounds):
        for r, (b, s, causal) in enumerate(ROWS):
            for i in order:
                rates[i][r].append(tflops(b, h, s, d, causal, bench_ms(timed[i][1][r])))
    spreads = []
    for (label, _), per_row in zip(timed, rates):
        lines.append(label + " " + " | ".join(f"{sum(x) / len(x):.0f}" for x in per_row) + " |")
        spreads.append(max((max(x) - min(x)) / min(x) for x in per_row) * 100)
        print(lines[-1], flush=True)
    if args.rounds > 1:
        lines += ["", "Largest difference between two rounds of one cell, per source: "
                  + ", ".join(f"{x:.1f}%" for x in spreads) + "."]
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
