"""One bf16 prefill call of flashjit fa2 and of FlashInfer fa2 (when importable),
for a profiler to compare: `ncu -k regex:'fa2_attention|Prefill' python benchmarks/profile_prefill.py`.
Shape: 4 requests x 4096 tokens, 16 heads, head_dim 128, not causal."""

from __future__ import annotations

import torch

import flashjit

b, s, h, d = 4, 4096, 16, 128
indptr = torch.arange(b + 1, dtype=torch.int32) * s
q, k, v = (torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
w.plan(indptr, indptr, h, h, d, causal=False, q_data_type=torch.bfloat16)
w.run(q, k, v)
try:
    import flashinfer

    fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                         "NHD", backend="fa2")
    fw.plan(indptr.cuda(), indptr.cuda(), h, h, d, causal=False, q_data_type=torch.bfloat16)
    fw.run(q, k, v)
except ImportError:
    pass
torch.cuda.synchronize()
