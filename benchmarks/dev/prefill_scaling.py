"""Splits prefill time into a fixed part and a part per key tile: the same
queries (16 requests of 1024 tokens, 16 heads, bf16, non-causal, so the same
CTAs) against 256 .. 4096 keys per request, flashjit fa2 and FlashInfer fa2
timed side by side in rounds of alternating order. A least-squares line
t = fixed + per_tile * (keys / 64) per implementation: `fixed` is what a CTA
costs besides its key tiles (plan loads, Q, the first tile's wait, the
epilogue, wave tails), `per_tile` the main loop.

Usage: python benchmarks/dev/prefill_scaling.py [--head-dim 128] [--rounds 3] [--profile] [--out results.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
from common import emit, kernel_times, round_orders
from prefill import bench_ms, flashinfer_ragged, flashjit_ragged

KV_LENS = [256, 512, 1024, 2048, 4096]


def fit(xs, ys):
    """Least-squares intercept and slope."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--qo-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also kernel time per call (torch.profiler)")
    parser.add_argument("--out")
    args = parser.parse_args()
    d, b, s = args.head_dim, args.batch, args.qo_len
    h = 2048 // d
    makers = {"flashjit fa2": flashjit_ragged("fa2")}
    try:
        makers["flashinfer fa2"] = flashinfer_ragged("fa2")
    except Exception as exc:
        print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
    q = torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16)
    runs, times = {}, {}
    for kv in KV_LENS:
        k, v = (torch.randn(b * kv, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name, make in makers.items():
            try:
                fn = make([s] * b, [kv] * b, h, d, False, torch.bfloat16)
                runs[(name, kv)] = lambda fn=fn, k=k, v=v: fn(q, k, v)
                times[(name, kv)] = []
            except Exception as exc:
                print(f"{name} kv={kv}: {type(exc).__name__}: {exc}", file=sys.stderr)
    for order in round_orders(list(runs), args.rounds):
        for key in order:
            times[key].append(bench_ms(runs[key]) * 1e3)
    mean = {key: sum(t) / len(t) for key, t in times.items()}
    names = [n for n in makers if all((n, kv) in mean for kv in KV_LENS)]
    lines = [f"device: {torch.cuda.get_device_name()}, bf16, head_dim {d}, {b} x {s} queries, non-causal, "
             f"µs per call (mean of {args.rounds} interleaved rounds)", "",
             "| keys per request | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for kv in KV_LENS:
        lines.append(f"| {kv} | " + " | ".join(f"{mean[(n, kv)]:.1f}" for n in names) + " |")
    lines += ["", "| implementation | fixed (µs) | per 64-key tile (µs) |", "|---|---|---|"]
    for n in names:
        fixed, per_tile = fit([kv / 64 for kv in KV_LENS], [mean[(n, kv)] for kv in KV_LENS])
        lines.append(f"| {n} | {fixed:.1f} | {per_tile:.2f} |")
    if args.profile:
        lines += ["", "Kernel time per call from torch.profiler (device time of every kernel a call launches), "
                  "against the event-timed call above: the difference is time between kernels.", "",
                  "| keys per request | implementation | kernels | kernel µs per call | event µs per call |",
                  "|---|---|---|---|---|"]
        for kv in KV_LENS:
            for n in names:
                times = kernel_times(runs[(n, kv)])
                lines.append(f"| {kv} | {n} | {len(times)} | {sum(times.values()):.1f} | {mean[(n, kv)]:.1f} |")
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
