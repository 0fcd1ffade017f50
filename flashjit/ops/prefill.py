"""Prefill attention with FlashInfer 0.7's names and semantics:
single_prefill_with_kv_cache and BatchPrefillWithRaggedKVCacheWrapper."""

from __future__ import annotations

import torch

from .. import jit
from . import _checks
from ._launch import (Prepared, ceil_div, check_placement, check_qkv, kv_tokens, make_params,
                      prepare_single_request, remember, select_spec, signature)


def _check_out_buffer(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """User-provided out / lse: the kernel writes them densely, so they must be contiguous."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype or t.device != device \
            or not t.is_contiguous():
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}" \
            if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape {shape} on {device}, got {got}")


_prepared: dict[tuple, Prepared] = {}


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
                                 packed_custom_mask=None, causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                                 sm_scale=None, window_left: int = -1, logits_soft_cap=None, rope_scale=None,
                                 rope_theta=None, backend: str = "auto", return_lse: bool = False, *,
                                 use_tensor_cores: bool | None = None):
    """Attention of one request: q [qo_len, num_qo_heads, head_dim], k/v [kv_len,
    num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND).
    Returns o like q, and with return_lse the base-2 log-sum-exp [qo_len, num_qo_heads]."""
    options = (scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
               use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, backend, return_lse, use_tensor_cores)
    key = signature(q, k, v, kv_layout, True, options)
    prep = _prepared.get(key) if key is not None else None
    if prep is None:
        prep = remember(_prepared, key, _prepare_single(q, k, v, kv_layout, *options))
    qo_len = q.shape[0]
    out = torch.empty((qo_len, *prep.out_shape), dtype=q.dtype, device=q.device)
    lse = torch.empty((qo_len, *prep.lse_shape), dtype=torch.float32, device=q.device) if return_lse else None
    prep.launch(q, k, v, out, lse, prep.num_work(qo_len), qo_len, kv_tokens(k, v, kv_layout))
    return (out, lse) if return_lse else out


def _prepare_single(q, k, v, kv_layout, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal,
                    pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, backend,
                    return_lse, use_tensor_cores) -> Prepared:
    _checks.check_unsupported(scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, custom_mask=custom_mask,
                              packed_custom_mask=packed_custom_mask, pos_encoding_mode=pos_encoding_mode,
                              use_fp16_qk_reduction=use_fp16_qk_reduction)
    _, num_qo_heads, num_kv_heads, head_dim = check_qkv(q, k, v, kv_layout)
    if o_dtype is not None and o_dtype != q.dtype:
        raise ValueError(f"o_dtype: expected None or {q.dtype} (the output has q's dtype), got {o_dtype}")
    return prepare_single_request("single_prefill", q, k, v, kv_layout, head_dim, num_qo_heads, num_kv_heads,
                                  causal=causal, sm_scale=sm_scale, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, backend=backend,
                                  use_tensor_cores=use_tensor_cores, return_lse=return_lse)


class BatchPrefillWithRaggedKVCacheWrapper:
    """Prefill over a ragged batch: q packed as [qo_indptr[-1], heads, dim], k/v
    packed as [kv_indptr[-1], kv_heads, dim] (NHD) or [kv_heads, kv_indptr[-1], dim]
    (HND). plan() once per batch shape on the host, run() many times."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None):
        _checks.check_layout(kv_layout)
        _checks.check_unsupported(use_cuda_graph=use_cuda_graph, custom_mask=custom_mask_buf)
        if jit_args is not None:
            raise NotImplementedError("jit_args: custom JIT modules are not supported; flashjit generates its own")
        if not isinstance(float_workspace_buffer, torch.Tensor) or float_workspace_buffer.device.type != "cuda":
            raise ValueError("float_workspace_buffer: expected a CUDA tensor")
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._backend = backend
        self._plan = None

    def plan(self, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, window_left: int = -1,
             logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, *,
             use_tensor_cores: bool | None = None) -> None:
        _checks.check_unsupported(custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                                  pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction)
        qo = _checks.check_indptr("qo_indptr", qo_indptr)
        kv = _checks.check_indptr("kv_indptr", kv_indptr, batch_size=len(qo) - 1)
        _checks.check_heads(num_qo_heads, num_kv_heads)
        _checks.check_head_dim("head_dim_qk", head_dim_qk)
        if head_dim_vo is not None and head_dim_vo != head_dim_qk:
            raise ValueError(f"head_dim_vo: expected {head_dim_qk} (as head_dim_qk) for ragged prefill, "
                             f"got {head_dim_vo}")
        q_dtype = _dtype_arg("q_data_type", q_data_type)
        for name, value in (("kv_data_type", kv_data_type), ("o_data_type", o_data_type)):
            if value is not None and _dtype_arg(name, value) != q_dtype:
                raise ValueError(f"{name}: expected {q_dtype} (as q_data_type), got {value}")
        sm_scale, window_left, cap, has_window, has_cap = _checks.variant_values(sm_scale, head_dim_qk, window_left,
                                                                                 logits_soft_cap)
        # The LSE variant writes LSE only when run() passes a buffer, so one plan serves both.
        spec = select_spec("batch_prefill_ragged", q_dtype, head_dim_qk, backend=self._backend,
                           use_tensor_cores=use_tensor_cores, causal=causal, window=has_window, soft_cap=has_cap,
                           return_lse=True)
        module = jit.get_module(spec)
        group = num_qo_heads // num_kv_heads
        work = []  # (estimated cost, request, tile); longest first so the tail is short
        for i in range(len(qo) - 1):
            qo_len, kv_len = qo[i + 1] - qo[i], kv[i + 1] - kv[i]
            tiles = ceil_div(qo_len * group, module.rows_per_cta)
            work.extend((max(kv_len, 1), i, t) for t in range(tiles))
        work.sort(key=lambda item: -item[0])
        # Device copies stay referenced by the wrapper; run() only passes their addresses.
        self._indptrs = torch.tensor([qo, kv], dtype=torch.int32).to(self._device, non_blocking=non_blocking)
        self._work = torch.tensor([[r for _, r, _ in work], [t for _, _, t in work]],
                                  dtype=torch.int32).reshape(2, -1).to(self._device, non_blocking=non_blocking)
        self._plan = {
            "module": module, "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim_qk,
            "q_dtype": q_dtype, "qo_tokens": qo[-1], "kv_tokens": kv[-1], "num_work": len(work),
            "scalars": (sm_scale, window_left, cap),
            "pointers": (self._indptrs[0].data_ptr(), self._indptrs[1].data_ptr(), self._work[0].data_ptr(),
                         self._work[1].data_ptr()),
        }
        self._prepared = {}

    def run(self, q, k, v, *args, out=None, lse=None, return_lse: bool = False, enable_pdl=None):
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() called before plan()")
        key = signature(q, k, v, self._kv_layout, True, ())
        prep = self._prepared.get(key) if key is not None else None
        if prep is None:
            prep = remember(self._prepared, key, self._prepare(q, k, v))
        tokens = q.shape[0]
        if tokens < plan["qo_tokens"]:
            raise ValueError(f"qo_indptr: its last offset {plan['qo_tokens']} is past the end of q ({tokens} tokens)")
        kv_len = kv_tokens(k, v, self._kv_layout)
        if kv_len < plan["kv_tokens"]:
            raise ValueError(f"kv_indptr: its last offset {plan['kv_tokens']} is past the end of k/v "
                             f"({kv_len} tokens)")
        if out is None:
            out = torch.empty((tokens, *prep.out_shape), dtype=q.dtype, device=q.device)
        else:
            _check_out_buffer("out", out, (tokens, *prep.out_shape), q.dtype, q.device)
        if return_lse:
            if lse is None:
                lse = torch.empty((tokens, plan["num_qo_heads"]), dtype=torch.float32, device=q.device)
            else:
                _check_out_buffer("lse", lse, (tokens, plan["num_qo_heads"]), torch.float32, q.device)
        else:
            lse = None
        prep.launch(q, k, v, out, lse, plan["num_work"])
        return (out, lse) if return_lse else out

    def _prepare(self, q, k, v) -> Prepared:
        plan = self._plan
        _, num_qo_heads, num_kv_heads, head_dim = check_qkv(q, k, v, self._kv_layout)
        check_placement(q, k, v, plan["module"].spec)
        if q.device != self._device:
            raise ValueError(f"q: expected a tensor on {self._device} (the workspace's device), got {q.device}")
        if (num_qo_heads, num_kv_heads, head_dim) != (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim"]):
            raise ValueError(f"q/k: expected {plan['num_qo_heads']} qo heads, {plan['num_kv_heads']} kv heads, "
                             f"head_dim {plan['head_dim']} as planned, got {num_qo_heads}, {num_kv_heads}, {head_dim}")
        if q.dtype != plan["q_dtype"]:
            raise ValueError(f"q: expected dtype {plan['q_dtype']} as planned (q_data_type), got {q.dtype}")
        params = make_params(q, k, v, (num_qo_heads * head_dim, head_dim), num_qo_heads, self._kv_layout,
                             *plan["scalars"])
        return Prepared.make(plan["module"], params, (num_qo_heads, head_dim), None, q.device,
                             extra_pointers=plan["pointers"])

    forward = run


def _dtype_arg(name: str, value) -> torch.dtype:
    if isinstance(value, str):
        value = getattr(torch, value, None) if value in ("float16", "bfloat16", "float32") else value
    if value not in _checks.SUPPORTED_DTYPES:
        raise ValueError(f"{name}: expected float16, bfloat16 or float32, got {value!r}")
    return value
