"""The kernel catalogue: which template renders a configuration, with which
tiling. One module per kernel family (`cuda_core`, and one per tensor-core
backend, each beside its header folder under templates/include/flashjit/); the
tiling is chosen there, once, and handed to the template. The generated library
reports the resulting rows-per-CTA back so the host-side plan never has to
duplicate it.

A tensor-core backend module provides `TEMPLATE` (its thin Jinja template) and
`tiling(spec, arches)`; adding one is a new header folder, a new template, a new
module and its line in TENSOR_CORE_BACKENDS.
"""

from __future__ import annotations

from ..spec import DECODE_OPS, DTYPES, MLA_OPS, PAGED_OPS, KernelSpec
from . import common, cuda_core, fa2, fa3

TENSOR_CORE_BACKENDS = {
    "fa2": fa2,
    "fa3": fa3,
}


def target_arches(spec: KernelSpec, arches: tuple[str, ...]) -> tuple[str, ...]:
    """The arches of `arches` a spec's library is built for: a backend module's
    ARCHES where it names them (fa3: sm_90a alone), else all of them. Raises
    ValueError, before anything is compiled, when none is left."""
    backend = TENSOR_CORE_BACKENDS.get(spec.backend) if spec.use_tensor_cores else None
    allowed = getattr(backend, "ARCHES", None)
    if allowed is None:
        return tuple(arches)
    kept = tuple(a for a in arches if a in allowed)
    if not kept:
        raise ValueError(f"{spec.name}: backend {spec.backend} builds for {', '.join(sorted(allowed))} only, and "
                         f"the targets are {', '.join(arches)}; add 9.0a to FLASHJIT_CUDA_ARCH_LIST (or --arch "
                         f"sm_90a), or use backend='fa2'")
    return kept


def tiling_for(spec: KernelSpec, arches=None):
    """The template file of a validated attention spec and its tiling (every
    tiling has rows_per_cta and smem_bytes(spec)); `arches`: the build's target
    arches, None when unknown (then a tiling that suits every arch)."""
    if not spec.use_tensor_cores and spec.op in DECODE_OPS and not spec.invariant_decode:
        return "attention_cuda_decode.cu.jinja", cuda_core.cuda_decode_tiling(spec)
    if not spec.use_tensor_cores:
        return "attention_cuda_core.cu.jinja", cuda_core.cuda_core_tiling(spec)
    if spec.op in MLA_OPS:
        if spec.backend == "fa3":
            return fa3.MLA_TEMPLATE, fa3.mla_tiling(spec)
        return fa2.MLA_TEMPLATE, fa2.mla_tiling(spec, arches)
    backend = TENSOR_CORE_BACKENDS.get(spec.backend)
    if backend is None:
        raise ValueError(f"{spec.name}: no template generates backend {spec.backend} yet")
    return backend.TEMPLATE, backend.tiling(spec, arches)


def template_for(spec: KernelSpec, arches=None) -> tuple[str, dict]:
    """The template file and its context for a validated spec built for
    `arches` (None: unknown)."""
    context = {
        "name": spec.name,
        "dtype_q": DTYPES[spec.dtype_q][1],
        "dtype_kv": DTYPES[spec.dtype_kv][1],
        "dtype_o": DTYPES[spec.dtype_o][1],
        "head_dim_qk": spec.head_dim_qk,
        "head_dim_vo": spec.head_dim_vo,
        "causal": spec.causal,
        "sliding_window": spec.sliding_window,
        "soft_cap": spec.soft_cap,
        "return_lse": spec.return_lse,
        "custom_mask": spec.custom_mask,
        "paged": spec.op in PAGED_OPS,
    }
    if spec.op == "append_paged":
        return "append_paged.cu.jinja", context
    template, context["tiling"] = tiling_for(spec, arches)
    return template, context
