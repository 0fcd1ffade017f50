"""One bf16 prefill call of flashjit and of FlashInfer (when importable) on the same backend,
fa2 unless `--backend fa3`, for a profiler to compare:
`ncu -k regex:'fa[23]_attention|Prefill' python benchmarks/dev/profile_prefill.py`.
Shape: 4 requests x 4096 tokens, head_dim 128 (`--head-dim`), 2048 / head_dim heads, not causal;
`--shape B S` and `--causal` change it.
`--templates DIR` renders from another templates/ copy (as fa2_tilings.py's --baseline-templates);
`--tiling 'Fa2Tiling(...)'` replaces the d128 default tiling; `--no-flashinfer` skips FlashInfer;
`--paged P` runs flashjit's paged prefill on the same K/V in pages of P slots (random order);
`--batch-invariant` plans flashjit's call in batch-invariant mode (fa3: the chunk-fold kernel)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/dev/: paged_vs_ragged
from common import use_templates

import flashjit
from flashjit import kernels
from flashjit.kernels.fa2 import Fa2Tiling  # noqa: F401  (for --tiling)

parser = argparse.ArgumentParser()
parser.add_argument("--templates", type=Path)
parser.add_argument("--tiling")
parser.add_argument("--no-flashinfer", action="store_true")
parser.add_argument("--shape", type=int, nargs=2, default=(4, 4096), metavar=("B", "S"))
parser.add_argument("--causal", action="store_true")
parser.add_argument("--backend", choices=["fa2", "fa3"], default="fa2")
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--paged", type=int, metavar="P", help="paged prefill, pages of P slots")
parser.add_argument("--batch-invariant", action="store_true")
args = parser.parse_args()
if args.templates:
    use_templates(args.templates.resolve())
if args.tiling:
    kernels.fa2.FA2_TILINGS[128] = eval(args.tiling)
    kernels.fa2.FA2_WIDE_TILINGS.pop(128, None)
    # A variant may exceed the shipped budget (one sm_90a-class part), as in fa2_tilings.py.
    kernels.common.SMEM_BUDGET = max(kernels.common.SMEM_BUDGET,
                              kernels.fa2.FA2_TILINGS[128].smem_bytes(flashjit.KernelSpec.make("single_prefill", "bfloat16", 128)))
if args.templates or args.tiling:
    # The cache key hashes the flashjit.kernels sources, not a tiling replaced at run time: a
    # fresh cache keeps a variant from loading the default's library.
    os.environ["FLASHJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fa2-profile-")

(b, s), d = args.shape, args.head_dim
h = 2048 // d
indptr = torch.arange(b + 1, dtype=torch.int32) * s
q, k, v = (torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
if args.paged:
    from paged_vs_ragged import paged_cache  # benchmarks/dev/

    cache, kv_indptr, indices, last = paged_cache(k, v, [s] * b, args.paged)
    w = flashjit.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                     backend=args.backend)
    w.plan(indptr, kv_indptr, indices, last, h, h, d, args.paged, causal=args.causal, q_data_type=torch.bfloat16,
           batch_invariant=args.batch_invariant)
    w.run(q, cache)
else:
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                      backend=args.backend)
    w.plan(indptr, indptr, h, h, d, causal=args.causal, q_data_type=torch.bfloat16,
           batch_invariant=args.batch_invariant)
    w.run(q, k, v)
try:
    if args.no_flashinfer:
        raise ImportError
    import flashinfer

    fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                         "NHD", backend=args.backend)
    fw.plan(indptr.cuda(), indptr.cuda(), h, h, d, causal=args.causal, q_data_type=torch.bfloat16)
    fw.run(q, k, v)
except ImportError:
    pass
torch.cuda.synchronize()
