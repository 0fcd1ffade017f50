"""Prefill attention with FlashInfer 0.7's names and semantics:
single_prefill_with_kv_cache and BatchPrefillWithRaggedKVCacheWrapper."""

from __future__ import annotations

import torch

from . import _checks
from ._launch import check_qkv, get_module, launch, make_params, select_spec


def _outputs(q: torch.Tensor, num_qo_heads: int, tokens: int, return_lse: bool, out=None, lse=None):
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out: expected a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device} with a "
                         f"contiguous last dim, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not return_lse:
        return out, None
    if lse is None:
        lse = torch.empty((tokens, num_qo_heads), dtype=torch.float32, device=q.device)
    elif lse.shape != (tokens, num_qo_heads) or lse.dtype != torch.float32 or lse.device != q.device \
            or lse.stride(-1) != 1:
        raise ValueError(f"lse: expected a float32 tensor of shape {(tokens, num_qo_heads)} on {q.device}, "
                         f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")
    return out, lse


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
                                 packed_custom_mask=None, causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                                 sm_scale=None, window_left: int = -1, logits_soft_cap=None, rope_scale=None,
                                 rope_theta=None, backend: str = "auto", return_lse: bool = False, *,
                                 use_tensor_cores: bool | None = None):
    """Attention of one request: q [qo_len, num_qo_heads, head_dim], k/v [kv_len,
    num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND).
    Returns o like q, and with return_lse the base-2 log-sum-exp [qo_len, num_qo_heads]."""
    _checks.check_unsupported(scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, custom_mask=custom_mask,
                              packed_custom_mask=packed_custom_mask, pos_encoding_mode=pos_encoding_mode,
                              use_fp16_qk_reduction=use_fp16_qk_reduction)
    kv_len, num_qo_heads, num_kv_heads, head_dim = check_qkv(q, k, v, kv_layout)
    if o_dtype is not None and o_dtype != q.dtype:
        raise ValueError(f"o_dtype: expected None or {q.dtype} (the output has q's dtype), got {o_dtype}")
    sm_scale, window_left, cap, has_window, has_cap = _checks.variant_values(sm_scale, head_dim, window_left,
                                                                             logits_soft_cap)
    spec = select_spec("single_prefill", q.dtype, head_dim, backend=backend, use_tensor_cores=use_tensor_cores,
                       causal=causal, window=has_window, soft_cap=has_cap, return_lse=return_lse)
    module = get_module(spec)
    qo_len = q.shape[0]
    out, lse = _outputs(q, num_qo_heads, qo_len, return_lse)
    params = make_params(q, k, v, out, lse, kv_layout, sm_scale, window_left, cap)
    params.qo_len, params.kv_len = qo_len, kv_len
    rows = qo_len * (num_qo_heads // num_kv_heads)
    params.num_work = -(-rows // module.rows_per_cta)
    launch(module, params, q.device)
    return (out, lse) if return_lse else out


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
        module = get_module(spec)
        group = num_qo_heads // num_kv_heads
        work = []  # (estimated cost, request, tile); longest first so the tail is short
        for i in range(len(qo) - 1):
            qo_len, kv_len = qo[i + 1] - qo[i], kv[i + 1] - kv[i]
            tiles = -(-qo_len * group // module.rows_per_cta)
            work.extend((max(kv_len, 1), i, t) for t in range(tiles))
        work.sort(key=lambda item: -item[0])
        host = torch.tensor([[r for _, r, _ in work], [t for _, _, t in work]], dtype=torch.int32).reshape(2, -1)
        indptrs = torch.tensor([qo, kv], dtype=torch.int32)
        self._plan = {
            "module": module, "spec": spec, "num_qo_heads": num_qo_heads, "num_kv_heads": num_kv_heads,
            "head_dim": head_dim_qk, "q_dtype": q_dtype, "qo_tokens": qo[-1], "kv_tokens": kv[-1],
            "sm_scale": sm_scale, "window_left": window_left, "cap": cap,
            "num_work": len(work),
        }
        # Device copies stay referenced by the plan; run() only passes their pointers.
        self._indptrs = indptrs.to(self._device, non_blocking=non_blocking)
        self._work = host.to(self._device, non_blocking=non_blocking)
        self._plan["pointers"] = (self._indptrs[0].data_ptr(), self._indptrs[1].data_ptr(),
                                  self._work[0].data_ptr(), self._work[1].data_ptr())

    def run(self, q, k, v, *args, out=None, lse=None, return_lse: bool = False, enable_pdl=None):
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() called before plan()")
        kv_tokens, num_qo_heads, num_kv_heads, head_dim = check_qkv(q, k, v, self._kv_layout)
        if q.device != self._device:
            raise ValueError(f"q: expected a tensor on {self._device} (the workspace's device), got {q.device}")
        if (num_qo_heads, num_kv_heads, head_dim) != (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim"]):
            raise ValueError(f"q/k: expected {plan['num_qo_heads']} qo heads, {plan['num_kv_heads']} kv heads, "
                             f"head_dim {plan['head_dim']} as planned, got {num_qo_heads}, {num_kv_heads}, {head_dim}")
        if q.dtype != plan["q_dtype"]:
            raise ValueError(f"q: expected dtype {plan['q_dtype']} as planned (q_data_type), got {q.dtype}")
        if q.shape[0] < plan["qo_tokens"]:
            raise ValueError(f"qo_indptr: its last offset {plan['qo_tokens']} is past the end of q "
                             f"({q.shape[0]} tokens)")
        if kv_tokens < plan["kv_tokens"]:
            raise ValueError(f"kv_indptr: its last offset {plan['kv_tokens']} is past the end of k/v "
                             f"({kv_tokens} tokens)")
        out, lse = _outputs(q, num_qo_heads, q.shape[0], return_lse, out, lse)
        params = make_params(q, k, v, out, lse, self._kv_layout, plan["sm_scale"], plan["window_left"], plan["cap"])
        params.qo_indptr, params.kv_indptr, params.work_request, params.work_tile = plan["pointers"]
        params.num_work = plan["num_work"]
        launch(plan["module"], params, q.device)
        return (out, lse) if return_lse else out

    forward = run


def _dtype_arg(name: str, value) -> torch.dtype:
    if isinstance(value, str):
        value = getattr(torch, value, None) if value in ("float16", "bfloat16", "float32") else value
    if value not in _checks.SUPPORTED_DTYPES:
        raise ValueError(f"{name}: expected float16, bfloat16 or float32, got {value!r}")
    return value
