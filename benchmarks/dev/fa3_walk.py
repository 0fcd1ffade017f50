"""fa3's persistent grid with the plan's walk (ops._plan.deal_positions: each
launch position to the CTA that ends soonest, in launch order) against the
kernel's own rounds, in one run: causal prefill, 16k tokens, bf16, grouped
query heads (32/8 at d64 and 16/4 at d128, as served) and the prefill table's
one KV head per query head; ragged batches, paged ones (pages of 16 in random
order) and single prompts (the one-request rows). "rounds": plans with
_DEAL_SLACK infinite (no walk), single prompts with no walk made. Both outputs
must agree bit for bit (a position's rows are computed alike by whichever CTA
takes it) before anything is timed; a row where no walk is taken says so.
Cells: TFLOP/s, medians of shuffled samples (flashjit.bench.timing.shuffled_ms),
and the planner's estimate of each schedule's end against the balanced bound
(batches).

Usage: python benchmarks/dev/fa3_walk.py [--layouts ragged paged single] [--rounds 3] [--reps 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import emit
from paged_vs_ragged import paged_cache, workspace

import flashjit
from flashjit import jit
from flashjit.bench.prefill import attention_flops, indptr
from flashjit.bench.timing import shuffled_ms
from flashjit.ops import _calls, _plan
from flashjit.spec import KernelSpec

# (label, query/key lengths); 16k tokens each.
BATCHES = [("16 x 1024", [1024] * 16), ("4 x 4096", [4096] * 4), ("1 x 16384", [16384]),
           ("1 x 8192 + 16 x 512", [8192] + [512] * 16)]
# (head_dim, query heads, KV heads)
HEADS = [(64, 32, 8), (128, 16, 4), (64, 32, 32), (128, 16, 16)]


PAGE = 16
LAYOUTS = ("ragged", "paged", "single")


def planned(make, walk: bool):
    """make() (a wrapper's plan) with the plan's walk or, walk False, the kernel's rounds."""
    slack = _plan._DEAL_SLACK
    _plan._DEAL_SLACK = slack if walk else float("inf")
    try:
        return make()
    finally:
        _plan._DEAL_SLACK = slack


def runners(layout, lens, qo_heads, kv_heads, d, k, v) -> tuple:
    """({"walk": fn(q) -> out, "rounds": fn(q) -> out}, the walk's plan or None (single prompts))."""
    if layout == "single":
        def single(q):
            return flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa3")

        def single_rounds(q):
            walk = _calls.single_request_walk
            _calls.single_request_walk = lambda *args, **kwargs: 0
            try:
                return single(q)
            finally:
                _calls.single_request_walk = walk
        return {"walk": single, "rounds": single_rounds}, None
    fns, plans = {}, {}
    if layout == "paged":
        cache, kv_indptr, indices, last = paged_cache(k, v, lens, PAGE)
    for name in ("walk", "rounds"):
        if layout == "ragged":
            w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend="fa3", strict=True)
            planned(lambda: w.plan(indptr(lens), indptr(lens), qo_heads, kv_heads, d, causal=True,
                                   q_data_type=torch.bfloat16), name == "walk")
            fns[name] = lambda q, w=w: w.run(q, k, v)
        else:
            w = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), backend="fa3", strict=True)
            planned(lambda: w.plan(indptr(lens), kv_indptr, indices, last, qo_heads, kv_heads, d, PAGE, causal=True,
                                   q_data_type=torch.bfloat16), name == "walk")
            fns[name] = lambda q, w=w: w.run(q, cache)
        plans[name] = w._plan
    return fns, plans["walk"]


def estimate(plan, kv_heads) -> str:
    """The planner's end of the rounds and of the walk, as fractions past the balanced bound."""
    if plan is None:
        return "-"
    by_position = _plan.launch_costs(plan.work.costs, kv_heads, plan.work.band_items)
    ctas = min(len(by_position), torch.cuda.get_device_properties(0).multi_processor_count)
    bound = max(sum(by_position) / ctas, max(by_position))
    walk = _plan.deal_positions(plan.work.costs, kv_heads, plan.work.band_items, ctas)
    dealt = "none"
    if walk is not None:
        ends = [sum(by_position[x] for x in walk[2 + ctas + walk[1 + j]:2 + ctas + walk[2 + j]]) for j in range(ctas)]
        dealt = f"{max(ends) / bound - 1:+.1%}"
    return f"{_plan.rounds_time(by_position, ctas) / bound - 1:+.1%} / {dealt}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    ops = {"ragged": "batch_prefill_ragged", "paged": "batch_prefill_paged", "single": "single_prefill"}
    jit.build_many([KernelSpec.make(ops[layout], "bfloat16", d, backend="fa3", use_tensor_cores=True, causal=True)
                    for layout in args.layouts for d in sorted({d for d, _, _ in HEADS})])
    lines = [f"device: {torch.cuda.get_device_name()}, bf16, causal prefill, torch {torch.__version__}", "",
             "| layout | head_dim, heads | batch | rounds TFLOP/s | walk TFLOP/s | walk/rounds | "
             "planner: rounds / walk past bound |", "|---|---|---|---|---|---|---|"]
    status = 0
    for layout in args.layouts:
        for d, qo_heads, kv_heads in HEADS:
            for label, lens in BATCHES:
                if layout == "single" and len(lens) > 1:
                    continue
                tokens = sum(lens)
                q = torch.randn(tokens, qo_heads, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(tokens, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                fns, plan = runners(layout, lens, qo_heads, kv_heads, d, k, v)
                outs = {name: fn(q) for name, fn in fns.items()}
                torch.cuda.synchronize()
                where = f"{layout} d{d} {qo_heads}/{kv_heads} {label}"
                if not torch.equal(outs["walk"], outs["rounds"]) or not torch.isfinite(outs["walk"]).all():
                    print(f"{where}: the walk's output differs from the rounds'", file=sys.stderr)
                    status = 1
                    continue
                flops = sum(attention_flops(1, qo_heads, n, d, True) for n in lens)
                samples = shuffled_ms({name: (lambda fn=fn: fn(q)) for name, fn in fns.items()},
                                      args.rounds * args.reps)
                rate = {name: flops / statistics.median(ms) / 1e9 for name, ms in samples.items()}
                no_walk = plan is not None and plan.walk == 0
                lines.append(f"| {layout} | d{d}, {qo_heads}/{kv_heads} | {label} | {rate['rounds']:.0f} | "
                             f"{rate['walk']:.0f}{' (no walk)' if no_walk else ''} | "
                             f"{rate['walk'] / rate['rounds']:.3f} | {estimate(plan, kv_heads)} |")
                print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
