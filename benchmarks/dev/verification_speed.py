"""Speculative-decoding verification against one decode step, beside FlashInfer,
in one run on one GPU (the custom-mask issue's tables).

The batch: B = 64 requests, 4096 cached keys each, GQA 32/8, head_dim 128,
bf16, page 16, pages in random order (decode.paged_cache). Rows:

- decode: one query token per request, the paged decode wrapper (flashjit
  CUDA and tensor cores, FlashInfer tensor cores): the time a step costs.
- tree: 8 draft tokens per request appended to the cache (4104 keys), each
  seeing the cached keys and its ancestors in a random tree of 8 nodes (a
  custom mask), through the paged prefill wrapper's plan(custom_mask=...).
- chain: 4 draft tokens per request, causal (bottom-right aligned), no mask.

Each cell is µs per call (median of CUDA-graph samples, timing.time_us) and its
ratio to flashjit's faster decode cell (targets: tree <= 1.3x, chain <= 1.15x).
flashjit's prefill outputs are checked against FlashInfer's where both ran
(max |difference|) and against float32 attention on the first four requests
(within 2e-2 + 2e-2 |ref|). FlashInfer's prefill runs its fa2 backend (its fa3
takes no custom mask).

Usage: python benchmarks/dev/verification_speed.py [--reps 30] [--batch 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from common import emit  # noqa: E402

from flashjit.bench import decode as dec  # noqa: E402
from flashjit.bench.timing import time_us  # noqa: E402

KV_LEN, QO_HEADS, KV_HEADS, D = 4096, 32, 8, 128


def tree_mask(n: int, kv_len: int, gen: torch.Generator) -> torch.Tensor:
    """[n, kv_len]: every cached key, then node i's ancestors and itself among the
    last n keys (node i's parent a random earlier node)."""
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, kv_len, dtype=torch.bool)
    mask[:, : kv_len - n] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, kv_len - n + j] = True
            j = parent[j]
    return mask


def reference(q, cache, indices, kv_len, masks, requests: int) -> torch.Tensor:
    """float32 attention of the first `requests` requests, [requests * n, heads, D]."""
    n, group = masks[0].shape[0], QO_HEADS // KV_HEADS
    ppr = indices.numel() // (q.shape[0] // n)  # pages per request
    out = []
    for r in range(requests):
        pages = indices[r * ppr:(r + 1) * ppr].long()
        kv = cache[pages].transpose(0, 1).reshape(2, -1, KV_HEADS, D)[:, :kv_len].float()
        qq = q[r * n:(r + 1) * n].float().view(n, KV_HEADS, group, D)
        s = torch.einsum("nhgd,khd->hgnk", qq, kv[0]) / math.sqrt(D)
        s = s.masked_fill(~masks[r].to(q.device), float("-inf"))
        out.append(torch.einsum("hgnk,khd->nhgd", s.softmax(-1), kv[1]).reshape(n, QO_HEADS, D))
    return torch.cat(out)


def prefill_cells(libs, ws, batch, n, causal, masks, reps, results, label):
    """flashjit's and FlashInfer's paged prefill of n tokens a request, masked or causal."""
    kv_len = KV_LEN + n
    torch.manual_seed(1)
    cache, kv_indptr, indices, last = dec.paged_cache(batch, kv_len, KV_HEADS)
    q = torch.randn(batch * n, QO_HEADS, D, dtype=dec.BF16, device="cuda")
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * n
    mask = torch.cat([m.flatten() for m in masks]).cuda() if masks else None
    outs = {}
    for name, lib, backend in [("flashjit fa2", libs["flashjit"], "fa2"), ("flashjit auto", libs["flashjit"], "auto"),
                               ("flashinfer", libs.get("flashinfer"), "fa2")]:
        if lib is None:
            continue
        try:
            w = lib.BatchPrefillWithPagedKVCacheWrapper(ws[name.split()[0]], "NHD", backend=backend)
            w.plan(qo_indptr, kv_indptr, indices, last, QO_HEADS, KV_HEADS, D, dec.PAGE, custom_mask=mask,
                   causal=causal, q_data_type=dec.BF16)
            outs[name] = w.run(q, cache)
            results[label][name] = time_us(lambda w=w: w.run(q, cache), reps)[0]
            print(f"{label} {name}: {results[label][name]:.1f} us", flush=True)
        except Exception as exc:
            results[label][name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            print(f"{label} {name}: {results[label][name]}", file=sys.stderr, flush=True)
    checks = []
    ref_masks = masks or [torch.ones(n, kv_len, dtype=torch.bool).tril(kv_len - n)] * 4
    ref = reference(q, cache, indices, kv_len, ref_masks, 4)
    for name, out in outs.items():
        err = (out[: 4 * n].float() - ref).abs()
        ok = bool((err <= 2e-2 + 2e-2 * ref.abs()).all())
        checks.append(f"{name} vs float32 (4 requests): max err {err.max().item():.3g} {'ok' if ok else 'FAIL'}")
        if name != "flashinfer" and "flashinfer" in outs:
            diff = (out.float() - outs["flashinfer"].float()).abs().max().item()
            checks.append(f"{name} vs flashinfer (all requests): max |diff| {diff:.3g}")
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    libs = dec.libraries()
    ws = {name: torch.zeros(256 << 20, dtype=torch.uint8, device="cuda") for name in libs}
    results = {"decode": {}, "tree 8, mask": {}, "chain 4, causal": {}}
    torch.manual_seed(0)
    cache, indptr, indices, last = dec.paged_cache(args.batch, KV_LEN, KV_HEADS)
    q = torch.randn(args.batch, QO_HEADS, D, dtype=dec.BF16, device="cuda")
    for name, lib_name, tc in [("flashjit cc", "flashjit", False), ("flashjit tc", "flashjit", True),
                               ("flashinfer tc", "flashinfer", True)]:
        if lib_name not in libs:
            continue
        w = libs[lib_name].BatchDecodeWithPagedKVCacheWrapper(ws[lib_name], "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, QO_HEADS, KV_HEADS, D, dec.PAGE, q_data_type=dec.BF16)
        results["decode"][name] = time_us(lambda w=w: w.run(q, cache), args.reps)[0]
        print(f"decode {name}: {results['decode'][name]:.1f} us", flush=True)
    del cache
    torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(0)
    masks = [tree_mask(8, KV_LEN + 8, gen) for _ in range(args.batch)]
    checks = prefill_cells(libs, ws, args.batch, 8, False, masks, args.reps, results, "tree 8, mask")
    checks += prefill_cells(libs, ws, args.batch, 4, True, None, args.reps, results, "chain 4, causal")
    step = min(v for k, v in results["decode"].items() if k.startswith("flashjit"))
    names = list(dict.fromkeys(k for row in results.values() for k in row))
    lines = [f"device: {torch.cuda.get_device_name()}; B {args.batch}, {KV_LEN} cached keys, GQA {QO_HEADS}/{KV_HEADS}, "
             f"d{D}, bf16, page {dec.PAGE}; µs per call (x flashjit's decode step, {step:.1f} µs)", "",
             "| row | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, row in results.items():
        cells = [(f"{row[k]:.1f} ({row[k] / step:.2f}x)" if isinstance(row[k], float) else row[k].replace("|", "/"))
                 if k in row else "" for k in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [""] + checks
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
