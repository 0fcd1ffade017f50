"""One bf16 paged decode call per path (CUDA cores, tensor cores), and FlashInfer's
tensor-core path with --flashinfer, for a profiler:
`ncu -k 'regex:decode_attention|fa2_attention|merge|Prefill|Merge' python benchmarks/dev/profile_decode.py`.
Shape: the first row of benchmarks/decode.py (64 requests x 4096 keys, 32/8 heads,
head_dim 128, page 16), or --kv-heads 32 for its MHA row."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
from decode import BF16, D, PAGE, paged_cache

import flashjit

parser = argparse.ArgumentParser()
parser.add_argument("--kv-heads", type=int, default=8)
parser.add_argument("--tc-only", action="store_true", help="only the tensor-core path")
parser.add_argument("--flashinfer", action="store_true", help="also FlashInfer's tensor-core path")
args = parser.parse_args()

batch, kv_len, qo_heads, kv_heads = 64, 4096, 32, args.kv_heads
cache, indptr, indices, last = paged_cache(batch, kv_len, kv_heads)
q = torch.randn(batch, qo_heads, D, dtype=BF16, device="cuda")
libs = [flashjit]
if args.flashinfer:
    import flashinfer

    libs.append(flashinfer)
for lib in libs:
    for tensor_cores in (True,) if args.tc_only or lib is not flashjit else (False, True):
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        w = lib.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD", use_tensor_cores=tensor_cores)
        w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16)
        w.run(q, cache)
torch.cuda.synchronize()
