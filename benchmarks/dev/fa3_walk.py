"""fa3's persistent grid with the plan's walk (ops._plan.deal_positions: each
launch position to the CTA that ends soonest, in launch order) against the
kernel's own rounds (_DEAL_SLACK infinite: no plan gives a walk), in one run:
causal ragged prefill, 16k tokens, bf16, grouped query heads (32/8 at d64 and
16/4 at d128, as served) and the prefill table's one KV head per query head.
Both wrappers' outputs must agree bit for bit (a position's rows are computed
alike by whichever CTA takes it) before anything is timed; a row where the plan
gives no walk says so. Cells: TFLOP/s, medians of shuffled samples
(flashjit.bench.timing.shuffled_ms), and the planner's estimate of each
schedule's end against the balanced bound.

Usage: python benchmarks/dev/fa3_walk.py [--rounds 3] [--reps 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import emit

import flashjit
from flashjit import jit
from flashjit.bench.prefill import attention_flops, indptr
from flashjit.bench.timing import shuffled_ms
from flashjit.ops import _plan
from flashjit.spec import KernelSpec

# (label, query/key lengths); 16k tokens each.
BATCHES = [("16 x 1024", [1024] * 16), ("4 x 4096", [4096] * 4), ("1 x 16384", [16384]),
           ("1 x 8192 + 16 x 512", [8192] + [512] * 16)]
# (head_dim, query heads, KV heads)
HEADS = [(64, 32, 8), (128, 16, 4), (64, 32, 32), (128, 16, 16)]


def wrapper(lens, qo_heads, kv_heads, d, walk: bool):
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                      backend="fa3", strict=True)
    slack = _plan._DEAL_SLACK
    _plan._DEAL_SLACK = slack if walk else float("inf")
    try:
        w.plan(indptr(lens), indptr(lens), qo_heads, kv_heads, d, causal=True, q_data_type=torch.bfloat16)
    finally:
        _plan._DEAL_SLACK = slack
    return w


def estimate(w, kv_heads) -> str:
    """The planner's end of the rounds and of the walk, as fractions past the balanced bound."""
    plan = w._plan
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    jit.build_many([KernelSpec.make("batch_prefill_ragged", "bfloat16", d, backend="fa3", use_tensor_cores=True,
                                    causal=True) for d in sorted({d for d, _, _ in HEADS})])
    lines = [f"device: {torch.cuda.get_device_name()}, bf16, causal ragged prefill, torch {torch.__version__}", "",
             "| head_dim, heads | batch | rounds TFLOP/s | walk TFLOP/s | walk/rounds | planner: rounds / walk past bound |",
             "|---|---|---|---|---|---|"]
    status = 0
    for d, qo_heads, kv_heads in HEADS:
        for label, lens in BATCHES:
            tokens = sum(lens)
            q = torch.randn(tokens, qo_heads, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(tokens, kv_heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            walked, rounds = (wrapper(lens, qo_heads, kv_heads, d, walk) for walk in (True, False))
            has_walk = walked._plan.walk != 0
            outs = [torch.full_like(q, float("nan")) for _ in range(2)]
            walked.run(q, k, v, out=outs[0])
            rounds.run(q, k, v, out=outs[1])
            torch.cuda.synchronize()
            if not torch.equal(outs[0], outs[1]) or not torch.isfinite(outs[0]).all():
                print(f"d{d} {qo_heads}/{kv_heads} {label}: the walk's output differs from the rounds'", file=sys.stderr)
                status = 1
                continue
            flops = sum(attention_flops(1, qo_heads, n, d, True) for n in lens)
            samples = shuffled_ms({"walk": lambda: walked.run(q, k, v), "rounds": lambda: rounds.run(q, k, v)},
                                  args.rounds * args.reps)
            rate = {name: flops / statistics.median(ms) / 1e9 for name, ms in samples.items()}
            lines.append(f"| d{d}, {qo_heads}/{kv_heads} | {label} | {rate['rounds']:.0f} | "
                         f"{rate['walk']:.0f}{'' if has_walk else ' (no walk)'} | "
                         f"{rate['walk'] / rate['rounds']:.3f} | {estimate(walked, kv_heads)} |")
            print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
