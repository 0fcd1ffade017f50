"""One bf16 paged decode call per path (CUDA cores, tensor cores) for a
profiler: `ncu -k regex:decode_attention|fa2_attention python benchmarks/profile_decode.py`.
Shape: the first row of benchmarks/decode.py (64 requests x 4096 keys, 32/8 heads, head_dim 128, page 16)."""

from __future__ import annotations

import torch
from decode import BF16, D, PAGE, paged_cache

import flashjit

batch, kv_len, qo_heads, kv_heads = 64, 4096, 32, 8
cache, indptr, indices, last = paged_cache(batch, kv_len, kv_heads)
q = torch.randn(batch, qo_heads, D, dtype=BF16, device="cuda")
workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
for tensor_cores in (False, True):
    w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace, use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16)
    w.run(q, cache)
torch.cuda.synchronize()
