"""Shared-prefix decode: MultiLevelCascadeAttentionWrapper against plain paged
decode of the same batch, beside FlashInfer's, in one run on one GPU (the
cascade target of the custom-mask issue).

The batch: B = 64 requests decoding one token each, GQA 32/8, head_dim 128,
bf16, page 16; every request's keys are a shared prefix of 16384 tokens (its
pages listed once, in random order) then 256 tokens of its own. Rows:

- plain: the paged decode wrapper over each request's whole page table (the
  shared pages listed in every request's table), CUDA and tensor cores.
- cascade: two levels, level 0 the prefix for all 64 queries, level 1 each
  request's own pages (causal=True, as a decode step's).

µs per call (median of CUDA-graph samples, timing.time_us), and the speedup of
each cascade cell over flashjit's faster plain cell (target: >= 3x, and ahead
of FlashInfer's cascade). Each cascade output is checked against flashjit's
plain output (max |difference| <= 2e-2 + 2e-2 |plain|).

Usage: python benchmarks/dev/cascade_speed.py [--reps 30] [--batch 64] [--prefix 16384] [--own 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from common import emit  # noqa: E402

from flashjit.bench import decode as dec  # noqa: E402
from flashjit.bench.timing import time_us  # noqa: E402

QO_HEADS, KV_HEADS, D, PAGE = 32, 8, 128, 16


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def batch_pages(batch: int, prefix: int, own: int):
    """(cache, shared page ids, own page ids per request, own pages a request,
    last page length): the shared prefix's pages, then each request's own, all at
    random places in one NHD cache."""
    shared, mine = prefix // PAGE, -(-own // PAGE)
    pages = shared + batch * mine
    cache = torch.randn(pages, 2, PAGE, KV_HEADS, D, dtype=dec.BF16, device="cuda")
    order = torch.randperm(pages, device="cuda").to(torch.int32)
    last = own - (mine - 1) * PAGE
    return cache, order[:shared], order[shared:].view(batch, mine), mine, last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=16384, help="shared tokens (a multiple of the page size)")
    parser.add_argument("--own", type=int, default=256, help="each request's own tokens")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.prefix % PAGE:
        parser.error(f"--prefix: expected a multiple of {PAGE}, got {args.prefix}")
    torch.manual_seed(0)
    b = args.batch
    cache, shared, own, mine, last = batch_pages(b, args.prefix, args.own)
    q = torch.randn(b, QO_HEADS, D, dtype=dec.BF16, device="cuda")
    libs = dec.libraries()
    ws = {name: torch.zeros(256 << 20, dtype=torch.uint8, device="cuda") for name in libs}
    times, outs, checks = {}, {}, []
    # Plain: each request's table is the shared pages, then its own.
    tables = torch.cat([shared.unsqueeze(0).expand(b, -1), own], dim=1).reshape(-1)
    per = shared.numel() + mine
    indptr, lasts = i32([i * per for i in range(b + 1)]), i32([last] * b)
    for name, lib_name, tc in [("plain flashjit cc", "flashjit", False), ("plain flashjit tc", "flashjit", True),
                               ("plain flashinfer tc", "flashinfer", True)]:
        if lib_name not in libs:
            continue
        w = libs[lib_name].BatchDecodeWithPagedKVCacheWrapper(ws[lib_name], "NHD", use_tensor_cores=tc)
        w.plan(indptr, tables, lasts, QO_HEADS, KV_HEADS, D, PAGE, q_data_type=dec.BF16)
        outs[name] = w.run(q, cache)
        times[name] = time_us(lambda w=w: w.run(q, cache), args.reps)[0]
        print(f"{name}: {times[name]:.1f} us", flush=True)
    # Cascade: level 0 the prefix for every query, level 1 each request's own pages.
    levels = ([i32([0, b]), i32(list(range(b + 1)))],
              [i32([0, shared.numel()]), i32([i * mine for i in range(b + 1)])],
              [shared, own.reshape(-1).contiguous()],
              [i32([PAGE]), lasts])
    for name, lib_name in [("cascade flashjit", "flashjit"), ("cascade flashinfer", "flashinfer")]:
        if lib_name not in libs:
            continue
        try:
            w = libs[lib_name].MultiLevelCascadeAttentionWrapper(2, ws[lib_name], "NHD")
            w.plan(*levels, QO_HEADS, KV_HEADS, D, PAGE, causal=True, q_data_type=dec.BF16)
            outs[name] = w.run(q, cache)
            times[name] = time_us(lambda w=w: w.run(q, cache), args.reps)[0]
            print(f"{name}: {times[name]:.1f} us", flush=True)
        except Exception as exc:
            times[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            print(f"{name}: {times[name]}", file=sys.stderr, flush=True)
    plain = outs["plain flashjit tc"].float()
    for name, out in outs.items():
        err = (out.float() - plain).abs()
        ok = bool((err <= 2e-2 + 2e-2 * plain.abs()).all())
        checks.append(f"{name} vs plain flashjit tc: max |diff| {err.max().item():.3g} {'ok' if ok else 'FAIL'}")
    base = min(v for k, v in times.items() if k.startswith("plain flashjit") and isinstance(v, float))
    lines = [f"device: {torch.cuda.get_device_name()}; B {b}, shared prefix {args.prefix} tokens, {args.own} own "
             f"tokens a request, GQA {QO_HEADS}/{KV_HEADS}, d{D}, bf16, page {PAGE}; µs per call "
             f"(speedup over flashjit's faster plain cell, {base:.1f} µs)", "", "| implementation | µs | speedup |",
             "|---|---|---|"]
    for name, t in times.items():
        lines.append(f"| {name} | {t:.1f} | {base / t:.2f}x |" if isinstance(t, float)
                     else f"| {name} | {t.replace('|', '/')} | |")
    lines += [""] + checks
    emit("\n".join(lines), args.out)
    return 0 if all(c.endswith("ok") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
