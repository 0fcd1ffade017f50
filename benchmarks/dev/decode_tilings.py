"""Compares decode tilings for head_dim 128 in one run: each variant is built
into its own cache, checked against a float32 reference, then timed on paged
decode rows (bf16, page 16, random page order) as benchmarks/decode.py does,
beside FlashInfer's decode of the same cores when importable.
`--baseline-templates DIR [DIR ...]` (copies of other templates/ folders) adds
the shipped tiling built from each of those sources, so that a kernel change is
measured against the code before it in the same run; `--no-variants` keeps the
shipped tiling alone. `--kv-dtype e4m3` (or e5m2) times an FP8 cache instead:
the bf16 cache quantised per tensor, checked against the reference over the
dequantised values, GB/s of FP8 bytes, and the FP8 variants (deeper rings,
16-dim lanes on CUDA cores: docs/fp8.md, "Speed"), which on tensor cores replace
kernels.fa2.FA2_FP8_DECODE_TILINGS (the table FP8 decode reads).

Usage: python benchmarks/dev/decode_tilings.py [--cores tensor|cuda] [--kv-dtype bf16|e4m3|e5m2]
       [--baseline-templates DIR ...] [--no-variants] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
from common import emit, use_templates
from decode import BF16, D, PAGE, check, libraries, paged_cache, reference, time_us

import flashjit
from flashjit import jit, kernels
from flashjit.bench import decode_fp8
from flashjit.kernels.cuda_core import CudaDecodeTiling
from flashjit.kernels.fa2 import Fa2Tiling

TENSOR_CORE_VARIANTS = {
    "keys split over 4 warps, 64 keys x 2 stages, 2 CTAs/SM (shipped)": Fa2Tiling(4, 64, 2, False, 2,
                                                                                   split_keys=True),
    "keys split over 4 warps, 64 keys x 2 stages, 3 CTAs/SM": Fa2Tiling(4, 64, 2, False, 3, split_keys=True),
}
CUDA_CORE_VARIANTS = {
    "4 warps, 4 keys per lane group x 3 stages, 4 CTAs/SM": CudaDecodeTiling(4, 4, 3, 4),
    "4 warps, 2 keys per lane group x 4 stages, 4 CTAs/SM": CudaDecodeTiling(4, 2, 4, 4),
    "4 warps, 8 keys per lane group x 2 stages, 3 CTAs/SM": CudaDecodeTiling(4, 8, 2, 3),
    "4 warps, 4 keys per lane group x 3 stages, 3 CTAs/SM": CudaDecodeTiling(4, 4, 3, 3),
    "2 warps, 4 keys per lane group x 3 stages, 8 CTAs/SM": CudaDecodeTiling(2, 4, 3, 8),
}
# FP8 caches: the shipped tilings beside rings that keep a 16-bit cache's bytes in
# flight, and (CUDA cores) lanes of 16 dims, whose four rows need 255 registers.
FP8_TENSOR_CORE_VARIANTS = {
    "keys split over 4 warps, 64 keys x 3 stages, 2 CTAs/SM": Fa2Tiling(4, 64, 3, False, 2, split_keys=True),
    "keys split over 4 warps, 64 keys x 4 stages, 2 CTAs/SM": Fa2Tiling(4, 64, 4, False, 2, split_keys=True),
    "keys split over 4 warps, 64 keys x 2 stages, 3 CTAs/SM": Fa2Tiling(4, 64, 2, False, 3, split_keys=True),
}
FP8_CUDA_CORE_VARIANTS = {
    "4 warps, 4 keys per lane group x 6 stages, 4 CTAs/SM": CudaDecodeTiling(4, 4, 6, 4),
    "16 dims a lane, 4 warps, 4 keys x 3 stages, 2 CTAs/SM": CudaDecodeTiling(4, 4, 3, 2, dims_per_lane=16),
    "16 dims a lane, 4 warps, 2 keys x 4 stages, 2 CTAs/SM": CudaDecodeTiling(4, 2, 4, 2, dims_per_lane=16),
}
ROWS = [("GQA 64x4k 32/8", 64, 4096, 32, 8), ("MHA 64x4k 32/32", 64, 4096, 32, 32),
        ("MQA 64x4k 32/1", 64, 4096, 32, 1), ("MQA 64x4k 16/1", 64, 4096, 16, 1),
        ("split 1x32k 32/8", 1, 32768, 32, 8), ("split 1x128k 32/8", 1, 131072, 32, 8), ("8x32k 64/8", 8, 32768, 64, 8)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cores", choices=("tensor", "cuda"), default="tensor")
    parser.add_argument("--baseline-templates", type=Path, nargs="+", default=[])
    parser.add_argument("--no-variants", action="store_true")
    parser.add_argument("--kv-dtype", type=decode_fp8.kv_dtype_arg, default="bf16")
    args = parser.parse_args()
    tensor_cores = args.cores == "tensor"
    fp8 = decode_fp8.is_fp8(args.kv_dtype)
    kv_dtype = decode_fp8.torch_dtype(args.kv_dtype) if fp8 else BF16
    tilings = kernels.fa2.FA2_FP8_DECODE_TILINGS if fp8 else kernels.fa2.FA2_DECODE_TILINGS  # the table decode reads
    shipped = tilings[D] if tensor_cores else kernels.cuda_core.cuda_decode_tiling(
        flashjit.KernelSpec.make("batch_decode_paged", "bfloat16", D, dtype_kv=kv_dtype))
    runs = [(f"shipped, sources from {folder.name}", shipped, folder.resolve()) for folder in args.baseline_templates]
    runs.append(("shipped", shipped, None))
    if not args.no_variants:
        if fp8:
            variants = FP8_TENSOR_CORE_VARIANTS if tensor_cores else FP8_CUDA_CORE_VARIANTS
        else:
            variants = TENSOR_CORE_VARIANTS if tensor_cores else CUDA_CORE_VARIANTS
        runs += [(name, tiling, None) for name, tiling in variants.items()]
    cuda_decode_tiling = kernels.cuda_core.cuda_decode_tiling
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    cases = []
    for label, batch, kv_len, qo_heads, kv_heads in ROWS:
        cache, indptr, indices, last = paged_cache(batch, kv_len, kv_heads)
        q = torch.randn(batch, qo_heads, D, dtype=BF16, device="cuda")
        scale = 1.0
        if fp8:  # the FP8 codes of the cache, and the reference over the values they stand for
            cache, scale = decode_fp8.quantise(cache, args.kv_dtype)
            ref = reference(q, cache, indices, kv_len, scale)
        else:
            ref = reference(q, cache, indices, kv_len)
        cases.append((label, batch * kv_len * kv_heads * D * 2 * cache.element_size(), q, cache, indptr, indices,
                      last, qo_heads, kv_heads, ref, scale))
    lines = [f"device: {torch.cuda.get_device_name()}, paged decode, bf16 queries, {args.kv_dtype} cache, head_dim "
             f"{D}, {args.cores} cores; cells: µs · GB/s of K+V read", "",
             "| variant | smem | " + " | ".join(r[0] for r in ROWS) + " |", "|---|---|" + "---|" * len(ROWS)]
    scaled = (lambda scale: {"k_scale": scale, "v_scale": scale}) if fp8 else (lambda scale: {})
    for name, tiling, templates in runs:
        if tensor_cores:
            tilings[D] = tiling
        else:
            kernels.cuda_core.cuda_decode_tiling = lambda spec, tiling=tiling: tiling
        use_templates(templates)
        jit._modules.clear()
        os.environ["FLASHJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="decode-tiling-")
        cells = []
        try:
            for label, nbytes, q, cache, indptr, indices, last, qo_heads, kv_heads, ref, scale in cases:
                w = flashjit.BatchDecodeWithPagedKVCacheWrapper(workspace, use_tensor_cores=tensor_cores)
                w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16, kv_data_type=kv_dtype)
                ok, max_err, rel = check(w.run(q, cache, **scaled(scale)), ref)
                if not ok:
                    cells.append(f"FAIL max err {max_err:.3g}")
                    continue
                us = time_us(lambda w=w, kw=scaled(scale): w.run(q, cache, **kw), args.reps)[0]
                cells.append(f"{us:.1f} · {nbytes / us / 1e3:.0f}")
        except Exception as exc:
            cells.append(f"failed: {type(exc).__name__}: {str(exc)[:120]}")
        spec = flashjit.KernelSpec.make("batch_decode_paged", "bfloat16", D, use_tensor_cores=tensor_cores,
                                        dtype_kv=kv_dtype)
        lines.append(f"| {name} | {tiling.smem_bytes(spec)} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    if tensor_cores:
        tilings[D] = shipped
    kernels.cuda_core.cuda_decode_tiling = cuda_decode_tiling
    use_templates(None)
    if "flashinfer" in libraries():
        import flashinfer

        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        cells = []
        for label, nbytes, q, cache, indptr, indices, last, qo_heads, kv_heads, ref, scale in cases:
            try:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
                w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16, kv_data_type=kv_dtype)
                ok, max_err, _ = check(w.run(q, cache, **scaled(scale)), ref)
                us = time_us(lambda w=w, kw=scaled(scale): w.run(q, cache, **kw), args.reps)[0] if ok else None
                cells.append(f"{us:.1f} · {nbytes / us / 1e3:.0f}" if ok else f"FAIL max err {max_err:.3g}")
            except Exception as exc:
                cells.append(f"failed: {type(exc).__name__}: {str(exc)[:80]}")
        lines.append("| FlashInfer (same run) | - | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
