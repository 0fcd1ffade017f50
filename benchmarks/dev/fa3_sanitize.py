"""A few small fa3 launches for compute-sanitizer (memcheck, racecheck,
synccheck): each head dim (and 192/128) once on a single request with a
partial last tile and GQA, and a ragged batch that leaves a consumer warpgroup without rows,
walks a persistent grid and splits its long request, from ragged K/V and from
paged caches (pages loaded by TMA, and gathered). Checks each output against
float64 within its profile, so that a clean sanitizer run is also a correct one.

Usage: python benchmarks/dev/fa3_sanitize.py            (build and check)
       compute-sanitizer --tool racecheck --error-exitcode 1 python benchmarks/dev/fa3_sanitize.py
"""

from __future__ import annotations

import math
import sys

import torch

import flashjit
from flashjit.reference import attention_reference, ragged_reference
from flashjit.spec import FA3_HEAD_DIMS, QK_VO_HEAD_DIMS, KernelSpec
from paged_vs_ragged import paged_cache  # benchmarks/dev/, this script's folder


def check(spec, out, ref, q, k, v, kv_len, d):
    tol = flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=kv_len, sm_scale=1 / math.sqrt(d))
    return tol.assert_close(out, ref, spec.name)


def main() -> int:
    torch.manual_seed(0)
    dtype, worst = torch.bfloat16, 0.0
    for d, d_vo in [(d, d) for d in FA3_HEAD_DIMS] + list(QK_VO_HEAD_DIMS):
        q = torch.randn(150, 8, d, device="cuda").to(dtype)
        k, v = torch.randn(300, 2, d, device="cuda").to(dtype), torch.randn(300, 2, d_vo, device="cuda").to(dtype)
        out = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa3", use_tensor_cores=True,
                                                    strict=True)
        ref, _ = attention_reference(q, k, v, causal=True)
        spec = KernelSpec.make("single_prefill", dtype, d, head_dim_vo=d_vo, backend="fa3", use_tensor_cores=True,
                               causal=True)
        worst = max(worst, check(spec, out, ref, q, k, v, 300, d))
    qo_lens, kv_lens, d = [3, 40, 1], [2000, 40, 7], 128
    qo = torch.tensor([0, *qo_lens]).cumsum(0).to(torch.int32)
    kv = torch.tensor([0, *kv_lens]).cumsum(0).to(torch.int32)
    q = torch.randn(int(qo[-1]), 4, d, device="cuda").to(dtype)
    k, v = (torch.randn(int(kv[-1]), 4, d, device="cuda").to(dtype) for _ in range(2))
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                      backend="fa3", strict=True)
    w.plan(qo, kv, 4, 4, d, causal=True, q_data_type=dtype, fixed_split_size=512)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, _ = ragged_reference(q, k, v, qo.tolist(), kv.tolist(), causal=True)
    spec = KernelSpec.make("batch_prefill_ragged", dtype, d, backend="fa3", use_tensor_cores=True, causal=True,
                           return_lse=True)
    worst = max(worst, check(spec, out, ref, q, k, v, max(kv_lens), d))
    # The same batch from a paged cache, pages in random order: of 64 slots (whole tiles by TMA boxes, the
    # last gathered) and of 3 (every tile gathered by cp.async).
    for page in (64, 3):
        worst = max(worst, check_paged(q, k, v, qo, kv_lens, d, page, ref, spec))
    torch.cuda.synchronize()
    print(f"fa3 sanitizer cases: worst err/bound {worst:.3f}")
    return 0


def check_paged(q, k, v, qo, kv_lens, d, page, ref, spec):
    cache, kv_indptr, indices, last = paged_cache(k, v, kv_lens, page)
    paged = flashjit.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"),
                                                         backend="fa3", strict=True)
    paged.plan(qo, kv_indptr, indices, last, 4, 4, d, page, causal=True, q_data_type=q.dtype,
               fixed_split_size=512 // page)
    out = paged.run(q, cache)
    return check(spec.replace(op="batch_prefill_paged"), out, ref, q, k, v, max(kv_lens), d)


if __name__ == "__main__":
    sys.exit(main())
