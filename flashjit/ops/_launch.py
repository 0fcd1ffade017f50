"""Shared by every attention op: choose the configuration, fill the C params
from tensors, launch on torch's current stream."""

from __future__ import annotations

import logging

import torch

from .. import arch, jit
from ..loader import AttentionParams, KernelModule
from ..spec import KernelSpec, canonical_dtype
from . import _checks

log = logging.getLogger("flashjit")
_announced: set = set()


def select_spec(op: str, dtype: torch.dtype, head_dim: int, *, backend: str, use_tensor_cores: bool | None,
                causal: bool, window: bool, soft_cap: bool, return_lse: bool) -> KernelSpec:
    """Resolves backend/tensor cores (logging the choice once per configuration) and validates."""
    name = canonical_dtype(dtype)
    chosen_backend, tc, reason = arch.choose_backend(name, use_tensor_cores, backend)
    spec = KernelSpec.make(op, name, head_dim, backend=chosen_backend, use_tensor_cores=tc, causal=bool(causal),
                           sliding_window=window, soft_cap=soft_cap, return_lse=return_lse).validate()
    if (backend == "auto" or use_tensor_cores is None) and spec not in _announced:
        _announced.add(spec)
        log.info("flashjit: %s -> %s (%s)", op, spec.name, reason)
    return spec


def make_params(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
                kv_layout: str, sm_scale: float, window_left: int, soft_cap: float) -> AttentionParams:
    """Params for q/o [tokens, heads, dim] and k/v in kv_layout (strides taken as they are)."""
    _, num_kv_heads, _, k_sn, k_sh = _checks.kv_dims("k", k, kv_layout)
    _, _, _, v_sn, v_sh = _checks.kv_dims("v", v, kv_layout)
    p = AttentionParams()
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr()
    p.lse = lse.data_ptr() if lse is not None else None
    p.num_qo_heads, p.num_kv_heads = q.shape[1], num_kv_heads
    p.q_stride_n, p.q_stride_h = q.stride(0), q.stride(1)
    p.k_stride_n, p.k_stride_h = k_sn, k_sh
    p.v_stride_n, p.v_stride_h = v_sn, v_sh
    p.o_stride_n, p.o_stride_h = o.stride(0), o.stride(1)
    p.lse_stride_n = lse.stride(0) if lse is not None else 0
    p.sm_scale, p.logits_soft_cap, p.window_left = sm_scale, soft_cap, window_left
    return p


def launch(module: KernelModule, params: AttentionParams, device: torch.device) -> None:
    if device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            module.run(params, torch.cuda.current_stream(device).cuda_stream)
    else:
        module.run(params, torch.cuda.current_stream(device).cuda_stream)


def check_qkv(q, k, v, kv_layout: str, q_ndim: int = 3) -> tuple[int, int, int, int]:
    """Checks q [tokens, qo_heads, dim] (or [qo_heads, dim]) against k/v; returns
    (kv_tokens, num_qo_heads, num_kv_heads, head_dim)."""
    _checks.check_layout(kv_layout)
    _checks.check_tensor("q", q, q_ndim)
    _checks.check_tensor("k", k, 3)
    _checks.check_tensor("v", v, 3)
    _checks.check_same_dtype(q=q, k=k, v=v)
    kv_tokens, num_kv_heads, head_dim_k, _, _ = _checks.kv_dims("k", k, kv_layout)
    v_tokens, v_heads, head_dim_v, _, _ = _checks.kv_dims("v", v, kv_layout)
    num_qo_heads, head_dim_q = q.shape[-2], q.shape[-1]
    _checks.check_head_dim("q.shape[-1] (head_dim)", head_dim_q)
    if head_dim_k != head_dim_q:
        raise ValueError(f"k: expected head_dim {head_dim_q} (as q), got {head_dim_k}")
    if head_dim_v != head_dim_q:
        raise ValueError(f"v: expected head_dim {head_dim_q} (as q; head_dim_qk != head_dim_vo is not "
                         f"supported for this op), got {head_dim_v}")
    if (v_tokens, v_heads) != (kv_tokens, num_kv_heads):
        raise ValueError(f"v: expected {kv_tokens} tokens x {num_kv_heads} heads in layout {kv_layout} (as k), "
                         f"got shape {tuple(v.shape)}")
    _checks.check_heads(num_qo_heads, num_kv_heads)
    _checks.check_device("q", q)
    _checks.check_device("k", k, q.device)
    _checks.check_device("v", v, q.device)
    _checks.check_vector_aligned("k", k)
    _checks.check_vector_aligned("v", v)
    return kv_tokens, num_qo_heads, num_kv_heads, head_dim_q


def get_module(spec: KernelSpec) -> KernelModule:
    return jit.get_module(spec)
