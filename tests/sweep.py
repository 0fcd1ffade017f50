"""The configuration axes the GPU tests sweep, in one place: the tests
parametrize over them and the prewarm fixture builds exactly their product."""

from __future__ import annotations

import itertools

import torch

from flashjit.spec import KernelSpec

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (dtype, use_tensor_cores) pairs that exist: tensor cores take fp16/bf16 only.
DTYPE_CORES = [(torch.float16, False), (torch.float16, True), (torch.bfloat16, False), (torch.bfloat16, True),
               (torch.float32, False)]
TENSOR_CORE_OPS = ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged")
DECODE_OPS = ("single_decode", "batch_decode_paged")
BATCH_OPS = ("batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged")
HEAD_DIMS = [64, 128, 256]
CAUSAL = [False, True]
# (num_qo_heads, num_kv_heads): MHA, GQA 4, GQA 8 = MQA with 8 query heads.
HEADS = [(4, 4), (8, 2), (8, 1)]
# Variants, each on its own: sliding window, soft-cap, LSE.
VARIANTS = ["plain", "window", "softcap", "lse"]
# The paged ops share the ragged kernels' math; their sweeps vary the page
# table, and the variants that change the code only where decode is concerned.
OP_VARIANTS = {"batch_prefill_paged": ["plain"], "batch_decode_paged": ["plain", "window", "softcap"]}


def variant_kwargs(variant: str) -> dict:
    return {"plain": {}, "window": {"window_left": 70}, "softcap": {"logits_soft_cap": 30.0},
            "lse": {"return_lse": True}}[variant]


def cores_id(pair) -> str:
    return f"{str(pair[0]).removeprefix('torch.')}-{'tc' if pair[1] else 'cc'}"


def spec_for(op: str, dtype, head_dim: int, causal: bool = False, variant: str = "plain",
             tensor_cores: bool = False) -> KernelSpec:
    return KernelSpec.make(op, dtype, head_dim, causal=causal and op not in DECODE_OPS, use_tensor_cores=tensor_cores,
                           sliding_window=variant == "window", soft_cap=variant == "softcap",
                           return_lse=variant == "lse" or op in BATCH_OPS)


def all_specs() -> list[KernelSpec]:
    specs = []
    for op, (dtype, tc), head_dim, causal, variant in itertools.product(
            ["single_prefill", "single_decode", *BATCH_OPS], DTYPE_CORES, HEAD_DIMS, CAUSAL, VARIANTS):
        if (tc and op not in TENSOR_CORE_OPS) or variant not in OP_VARIANTS.get(op, VARIANTS):
            continue
        specs.append(spec_for(op, dtype, head_dim, causal, variant, tc))
    return list(dict.fromkeys(specs))
