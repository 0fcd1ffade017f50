"""Decode attention (one query token) with FlashInfer 0.7's names and semantics."""

from __future__ import annotations

import torch

from . import _checks
from ._launch import check_qkv, get_module, launch, make_params, select_spec


def single_decode_with_kv_cache(q, k, v, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                use_tensor_cores: bool = False, q_scale=None, k_scale=None, v_scale=None,
                                window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                                rope_theta=None, return_lse: bool = False, *, backend: str = "auto"):
    """q [num_qo_heads, head_dim] against k/v [kv_len, num_kv_heads, head_dim] (NHD)
    or [num_kv_heads, kv_len, head_dim] (HND). Returns o like q, and with
    return_lse the base-2 log-sum-exp [num_qo_heads]."""
    _checks.check_unsupported(pos_encoding_mode=pos_encoding_mode, q_scale=q_scale, k_scale=k_scale,
                              v_scale=v_scale)
    kv_len, num_qo_heads, num_kv_heads, head_dim = check_qkv(q, k, v, kv_layout, q_ndim=2)
    sm_scale, window_left, cap, has_window, has_cap = _checks.variant_values(sm_scale, head_dim, window_left,
                                                                             logits_soft_cap)
    spec = select_spec("single_decode", q.dtype, head_dim, backend=backend, use_tensor_cores=use_tensor_cores,
                       causal=False, window=has_window, soft_cap=has_cap, return_lse=return_lse)
    module = get_module(spec)
    q3 = q.unsqueeze(0)
    out = torch.empty_like(q3)
    lse = torch.empty((1, num_qo_heads), dtype=torch.float32, device=q.device) if return_lse else None
    params = make_params(q3, k, v, out, lse, kv_layout, sm_scale, window_left, cap)
    params.qo_len, params.kv_len = 1, kv_len
    params.num_work = -(-(num_qo_heads // num_kv_heads) // module.rows_per_cta)
    launch(module, params, q.device)
    return (out[0], lse[0]) if return_lse else out[0]
