"""The configuration axes the GPU tests sweep, in one place: the tests
parametrize over them and the prewarm fixture builds exactly their product."""

from __future__ import annotations

import itertools
import os

import torch

from flashjit.spec import FA3_OPS, KernelSpec, canonical_dtype, mla_spec

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (dtype, use_tensor_cores) pairs that exist: tensor cores take fp16/bf16 only.
DTYPE_CORES = [(torch.float16, False), (torch.float16, True), (torch.bfloat16, False), (torch.bfloat16, True),
               (torch.float32, False)]
TENSOR_CORE_OPS = ("single_prefill", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged")
# The ops with a second tensor-core backend, and their (dtype, path) pairs: CUDA
# cores ("cc"), fa2 and fa3 (sm_90a only; skipped on other GPUs).
DTYPE_PATHS = [(torch.float16, "cc"), (torch.float16, "fa2"), (torch.float16, "fa3"), (torch.bfloat16, "cc"),
               (torch.bfloat16, "fa2"), (torch.bfloat16, "fa3"), (torch.float32, "cc")]
DECODE_OPS = ("single_decode", "batch_decode_paged")
BATCH_OPS = ("batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged")
HEAD_DIMS = [64, 128, 256]
# MLA (ckv 512 + kpe 64): tensor cores, fp16 and bf16; fa2 everywhere, fa3 on sm_90a.
MLA_DTYPES = [torch.float16, torch.bfloat16]
MLA_BACKENDS = ["fa2", "fa3"]
# FP8 KV caches (decode, append, fa2 prefill): their dtypes and the q/o dtypes beside them.
FP8_KV_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_Q_DTYPES = [torch.float16, torch.bfloat16]
FP8_PAGE_SIZES = [1, 16]
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


def path_id(pair) -> str:
    return f"{str(pair[0]).removeprefix('torch.')}-{pair[1]}"


def path_kwargs(path: str) -> dict:
    """The op arguments that select a path: CUDA cores, or a tensor-core backend named explicitly."""
    return {"use_tensor_cores": path != "cc", "backend": "fa2" if path == "cc" else path}


def spec_path(path: str) -> dict:
    """The spec_for arguments of a path."""
    return {"tensor_cores": path != "cc", "backend": "fa2" if path == "cc" else path}


def fa3_runs_here() -> bool:
    from flashjit import arch
    from flashjit.kernels import fa3

    return all(a in fa3.ARCHES for a in arch.backend_targets())


def spec_for(op: str, dtype, head_dim: int, causal: bool = False, variant: str = "plain",
             tensor_cores: bool = False, backend: str = "fa2") -> KernelSpec:
    return KernelSpec.make(op, dtype, head_dim, causal=causal and op not in DECODE_OPS, use_tensor_cores=tensor_cores,
                           sliding_window=variant == "window", soft_cap=variant == "softcap",
                           return_lse=variant == "lse" or op in BATCH_OPS, backend=backend)


def all_specs() -> list[KernelSpec]:
    """Every configuration the GPU sweep uses; with FLASHJIT_PREWARM_OPS=mla_paged
    (a comma list of ops) only those ops', for a run of their tests alone
    (`-k mla`) that should not build the whole sweep first; with
    FLASHJIT_PREWARM_FP8=1 only the FP8 KV-cache ones."""
    if os.environ.get("FLASHJIT_PREWARM_FP8") == "1":  # the FP8 tests alone (gpu_check.sh fp8)
        return fp8_specs()
    ops = os.environ.get("FLASHJIT_PREWARM_OPS")
    if ops:
        return [s for s in _all_specs() if s.op in ops.split(",")]
    return _all_specs()


def _all_specs() -> list[KernelSpec]:
    specs = []
    for op, (dtype, tc), head_dim, causal, variant in itertools.product(
            ["single_prefill", "single_decode", *BATCH_OPS], DTYPE_CORES, HEAD_DIMS, CAUSAL, VARIANTS):
        if (tc and op not in TENSOR_CORE_OPS) or variant not in OP_VARIANTS.get(op, VARIANTS):
            continue
        specs.append(spec_for(op, dtype, head_dim, causal, variant, tc))
        if tc and op in FA3_OPS and fa3_runs_here():
            specs.append(spec_for(op, dtype, head_dim, causal, variant, tc, backend="fa3"))
    specs += [mla_spec(dtype, causal=causal, backend=backend) for dtype in MLA_DTYPES for causal in CAUSAL
              for backend in MLA_BACKENDS if backend == "fa2" or fa3_runs_here()]
    return list(dict.fromkeys(specs + fp8_specs()))


def fp8_specs() -> list[KernelSpec]:
    """The FP8 KV-cache configurations the GPU tests use: CUDA-core single decode
    (with and without LSE), paged decode and the quantising append."""
    specs = []
    for q_dtype, kv_dtype, head_dim in itertools.product(FP8_Q_DTYPES, FP8_KV_DTYPES, HEAD_DIMS):
        specs += [KernelSpec.make(op, q_dtype, head_dim, dtype_kv=kv_dtype, return_lse=lse)
                  for op, lse in (("single_decode", False), ("single_decode", True), ("batch_decode_paged", True))]
        specs.append(KernelSpec.make("append_paged", q_dtype, head_dim, dtype_kv=kv_dtype))
    # The sliding window and the soft-cap (k_scale joins a logit scale in natural units there), d128.
    specs += [spec_for("batch_decode_paged", torch.bfloat16, 128, variant=variant).replace(dtype_kv=canonical_dtype(kv))
              for kv in FP8_KV_DTYPES for variant in ("window", "softcap")]
    return specs + fp8_tensor_core_specs()


def fp8_tensor_core_specs() -> list[KernelSpec]:
    """The FP8 KV-cache configurations on tensor cores (fa2) the GPU tests use:
    paged decode, paged prefill (causal or not), causal ragged prefill, and
    single prefill without a mask, at every head dim, q and KV dtype."""
    specs = []
    for q_dtype, kv_dtype, head_dim in itertools.product(FP8_Q_DTYPES, FP8_KV_DTYPES, HEAD_DIMS):
        kv = canonical_dtype(kv_dtype)
        specs += [spec_for(op, q_dtype, head_dim, causal, tensor_cores=True).replace(dtype_kv=kv)
                  for op, causal in (("batch_decode_paged", False), ("batch_prefill_paged", False),
                                     ("batch_prefill_paged", True), ("batch_prefill_ragged", True),
                                     ("single_prefill", False))]
    # The soft-cap on tensor cores (k_scale joins the cap's inner scale), d128.
    specs += [spec_for("batch_prefill_ragged", torch.bfloat16, 128, True, "softcap", True).replace(
        dtype_kv=canonical_dtype(kv)) for kv in FP8_KV_DTYPES]
    return specs


def build_for_gpu(specs: list[KernelSpec]) -> list:
    """Builds `specs` for this GPU in one parallel run (a GPU test module's
    prewarm); skips without a GPU; fails naming each configuration that did not build."""
    import pytest

    import flashjit

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = flashjit.build_many(specs)
    failed = [f"{r.spec.name}: {r.error}" for r in results if r.entry is None]
    assert not failed, "\n".join(failed)
    return results
