"""Shared by every attention op: choose the configuration, fill the C params
from tensors, prepare the call of a signature (ops._calls) and launch it on
torch's current stream."""

from __future__ import annotations

import logging

import torch

from .. import arch, jit
from ..loader import AttentionParams
from ..spec import MLA_OPS, QK_VO_HEAD_DIMS, QK_VO_OPS, KernelSpec, canonical_dtype, or_list, qk_vo_pairs
from . import _calls, _checks, _invariant, _masks, _scales, _sinks
from ._calls import Signatures, check_placement, remember, single_request_call

# For the ops that pack their own params (mla, append), which import them from here.
PER_CALL, run_on = _calls.PER_CALL, _calls.run_on

log = logging.getLogger("flashjit")
_announced: set = set()


def select_spec(op: str, dtype: torch.dtype, head_dim: int, *, backend: str, use_tensor_cores: bool | None,
                causal: bool, window: bool, soft_cap: bool, return_lse: bool, strict: bool | None = None,
                head_dim_vo: int | None = None, batch_invariant: bool = False, dtype_kv=None,
                custom_mask: str | None = None) -> KernelSpec:
    """Resolves backend/tensor cores (logging the choice once per configuration) and validates.
    strict: an explicit backend this GPU or op cannot run raises instead of running fa2
    (None: FLASHJIT_STRICT_BACKEND). head_dim_vo: V's width where it differs from head_dim (MLA,
    spec.QK_VO_HEAD_DIMS, which fa2 and fa3 take for QK_VO_OPS).
    batch_invariant: ops._invariant.kernel_choice (decode on its prefill op's backend and tiling).
    dtype_kv: the KV cache's dtype where it differs from q's (FP8).
    custom_mask: the name of the mask argument given (custom_mask or
    packed_custom_mask; None: no mask): the _mask configuration, on fa2 tensor
    cores (a ValueError naming the argument where the call chose CUDA cores)."""
    name = canonical_dtype(dtype)
    backend_op = op
    if batch_invariant:
        backend_op, use_tensor_cores, causal = _invariant.kernel_choice(op, name, causal)
    kv_name = canonical_dtype(dtype_kv) if dtype_kv is not None else None
    chosen_backend, tc, reason = arch.choose_backend(backend_op, name, use_tensor_cores, backend, strict=strict,
                                                     kv_dtype=kv_name, head_dim=head_dim,
                                                     head_dim_vo=head_dim_vo if op not in MLA_OPS else None,
                                                     custom_mask=custom_mask is not None)
    _masks.check_cores(custom_mask, name, tc, batch_invariant)
    if batch_invariant:
        reason += f"; batch-invariant mode: {backend_op}'s backend and tiling" if backend_op != op \
            else "; batch-invariant mode"
    spec = KernelSpec.make(op, name, head_dim, head_dim_vo=head_dim_vo, dtype_kv=dtype_kv, backend=chosen_backend,
                           use_tensor_cores=tc,
                           causal=bool(causal), sliding_window=window, soft_cap=soft_cap,
                           return_lse=return_lse, custom_mask=custom_mask is not None).validate()
    if (backend == "auto" or use_tensor_cores is None or batch_invariant) and spec not in _announced:
        _announced.add(spec)
        log.info("flashjit: %s -> %s (%s)", op, spec.name, reason)
    return spec


def make_params(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_strides: tuple[int, int],
                lse_stride: int, kv_layout: str, sm_scale: float, window_left: int, soft_cap: float
                ) -> AttentionParams:
    """The non-pointer fields for q/o [tokens, heads, dim] and k/v in kv_layout."""
    _, num_kv_heads, _, k_sn, k_sh = _checks.kv_dims("k", k, kv_layout)
    _, _, _, v_sn, v_sh = _checks.kv_dims("v", v, kv_layout)
    return fill_params(q, num_kv_heads, (k_sn, k_sh, 0), (v_sn, v_sh, 0), 0, out_strides, lse_stride, sm_scale,
                       window_left, soft_cap, kv_element_size=k.element_size())


def check_kv_strides(name: str, strides: tuple, page_size: int, element_size: int) -> None:
    """Decode kernels address K/V rows with 32-bit byte strides: each stride
    below 2 GiB, and one page's tokens below 4 GiB."""
    for label, stride in zip(("token", "head", "page"), strides):
        if stride * element_size >= 2**31:
            raise ValueError(f"{name}: expected a {label} stride below 2 GiB, got {stride * element_size} bytes "
                             f"({stride} elements)")
    if page_size and strides[0] * element_size * page_size >= 2**32:
        raise ValueError(f"{name}: expected the {page_size} tokens of a page to span below 4 GiB, got "
                         f"{strides[0] * element_size * page_size} bytes")


def fill_params(q: torch.Tensor, num_kv_heads: int, k_strides: tuple, v_strides: tuple, page_size: int,
                out_strides: tuple[int, int], lse_stride: int, sm_scale: float, window_left: int, soft_cap: float,
                kv_element_size: int | None = None, scales: tuple = (_scales.UNIT, _scales.UNIT),
                sinks: int = 0, mask: tuple = (0, 0, 0)) -> AttentionParams:
    """The non-pointer fields; k/v strides are (token, head, page) in elements of
    kv_element_size bytes (None: q's). scales: the checked (k_scale, v_scale)
    (ops._scales), which only FP8 configurations read. sinks: the checked
    address of the attention sinks (ops._sinks; 0: none). mask: the addresses
    of a custom mask's packed bits, of its byte offsets per request and of its
    full-key counts per request (ops._masks; 0: none; a single request: bits alone).
    Raises ValueError for K/V strides the kernels cannot address (see check_kv_strides)."""
    for name, strides in (("k", k_strides), ("v", v_strides)):
        check_kv_strides(name, strides, page_size, kv_element_size or q.element_size())
    p = AttentionParams()
    p.num_qo_heads, p.num_kv_heads, p.page_size = q.shape[-2], num_kv_heads, page_size
    p.q_stride_n, p.q_stride_h = (q.stride(0), q.stride(1)) if q.dim() == 3 else (0, q.stride(0))
    p.k_stride_n, p.k_stride_h, p.k_stride_page = k_strides
    p.v_stride_n, p.v_stride_h, p.v_stride_page = v_strides
    p.o_stride_n, p.o_stride_h = out_strides
    p.lse_stride_n = lse_stride
    p.sm_scale, p.logits_soft_cap, p.window_left = sm_scale, soft_cap, window_left
    _scales.apply(p, *scales)
    p.sinks = sinks or None
    p.custom_mask, p.mask_indptr = mask[0] or None, mask[1] or None
    p.mask_full_keys = mask[2] or None
    return p


def prepare_single_request(op: str, q, k, v, kv_layout: str, head_dim: int, num_qo_heads: int, num_kv_heads: int,
                           *, causal: bool, sm_scale, window_left, logits_soft_cap, backend: str,
                           use_tensor_cores, return_lse: bool, strict: bool | None = None,
                           batch_invariant: bool = False, k_scale=None, v_scale=None,
                           scale_names: tuple[str, str] = ("k_scale", "v_scale"), sinks=None,
                           mask: _masks.Mask | None = None):
    """The shared end of single_prefill / single_decode preparation, after their
    own structural checks: scalars, configuration, placement, kernel, params.
    k_scale / v_scale: as ops._scales.scale_key gave them (an FP8 cache's only),
    named scale_names in errors (single prefill takes FlashInfer's scale_k / scale_v).
    sinks: the call's attention sinks as given (ops._sinks: structure checked
    first, device and values after q's placement).
    mask: single prefill's custom mask (ops._masks), its structure checked: its
    device is checked and its bits packed after q's placement; the prepared call
    then holds them (call.mask_bits) and is for this call only.
    Returns the prepared call (ops._calls.single_request_call)."""
    _sinks.check_structure(_sinks.key(sinks), num_qo_heads)
    scales = _scales.checked(k.dtype, (k_scale, v_scale), q.device, scale_names)
    sm_scale, window_left, cap, has_window, has_cap = _checks.variant_values(sm_scale, head_dim, window_left,
                                                                             logits_soft_cap)
    head_dim_vo = v.shape[-1]  # V's width (check_qkv: head_dim, or a QK_VO_HEAD_DIMS pair's)
    spec = select_spec(op, q.dtype, head_dim, backend=backend, use_tensor_cores=use_tensor_cores, causal=causal,
                       window=has_window, soft_cap=has_cap, return_lse=return_lse, strict=strict,
                       head_dim_vo=head_dim_vo, batch_invariant=batch_invariant, dtype_kv=k.dtype,
                       custom_mask=mask.name if mask is not None else None)
    check_placement(q, k, v, spec)
    sinks_address = _sinks.checked_address(sinks, num_qo_heads, q.device)
    mask_bits = None
    if mask is not None:
        _masks.check_device(mask, q.device, "where q is: the kernel reads it there")
        mask_bits = _masks.single_bits(mask)
    module = jit.get_module(spec)
    params = make_params(q, k, v, (num_qo_heads * head_dim_vo, head_dim_vo), num_qo_heads, kv_layout, sm_scale,
                         window_left, cap)
    _scales.apply(params, *scales)
    params.sinks = sinks_address or None
    params.custom_mask = mask_bits.data_ptr() if mask_bits is not None and mask_bits.numel() else None
    chunk = _invariant.chunk_keys(None, True, module.split_align) if batch_invariant else 0
    call = single_request_call(module, params, q, k, v, kv_layout, num_qo_heads // num_kv_heads, q.dim() == 3,
                               bool(return_lse), invariant_chunk=chunk)
    if mask_bits is not None and call is not None:
        # Held until the launch is queued; freed then, its block goes only to work queued after the kernel.
        call.mask_bits = mask_bits
    return call


def run_single_request(cache: Signatures, prepare, q, k, v, options: tuple, sinks=None):
    """single_prefill / single_decode past the tracing test and their `fast`
    slot: the prepared call of the arguments' signature, made by
    prepare(q, k, v, *options[:-1], sinks) (every check) on its first call, then
    the call, which becomes the slot's. options: kv_layout, then the op's
    options, the last the sinks' key (ops._sinks.key; the address, not the
    tensor, whose values prepare reads). The signature leaves out the token
    counts, which the call reads and checks."""
    kv_layout = options[0]
    heads = 1 if kv_layout == "NHD" else 0  # HND: heads first, tokens second
    try:
        qs, ks, vs = q.shape, k.shape, v.shape
        key = (options, qs[-2], qs[-1], q.stride(), q.dtype, q.device, ks[heads], ks[2], k.stride(), k.dtype,
               k.device, vs[heads], vs[2], v.stride(), v.dtype, v.device)
        last_key, call = cache.last
        if key != last_key:
            call = cache.get(key)
            if call is not None:
                cache.last = (key, call)
    except (AttributeError, IndexError, TypeError):  # no tensors, too few dims, unhashable options
        key = call = None
    if call is None:
        call = remember(cache, key, prepare(q, k, v, *options[:-1], sinks))
    if key is not None and call is not None:
        cache.fast = (options, call.check, call)
    return call(q, k, v)


def kv_tokens(k: torch.Tensor, v: torch.Tensor, kv_layout: str) -> int:
    token_dim = 1 if kv_layout == "HND" else 0
    n = k.shape[token_dim]
    if v.shape[token_dim] != n:
        raise ValueError(f"v: expected {n} tokens (as k) in layout {kv_layout}, got shape {tuple(v.shape)}")
    return n


def check_qkv(q, k, v, kv_layout: str, q_ndim: int = 3, op: str = "") -> tuple[int, int, int, int]:
    """Structure of q [tokens, qo_heads, dim] (or [qo_heads, dim]) against k/v;
    returns (kv_tokens, num_qo_heads, num_kv_heads, head_dim). V is as wide as
    q and k, or for an op of spec.QK_VO_OPS the narrower width of a
    QK_VO_HEAD_DIMS pair (v.shape[-1]: head_dim_vo). Devices are
    check_placement's job, so that shape mistakes read the same on any machine."""
    _checks.check_layout(kv_layout)
    _checks.check_tensor("q", q, q_ndim)
    _checks.check_tensor("k", k, 3, kv=True)
    _checks.check_tensor("v", v, 3, kv=True)
    _checks.check_kv_dtype("q", q, "k", k)
    _checks.check_kv_dtype("q", q, "v", v)
    _checks.check_same_dtype(k=k, v=v)
    kv_tokens, num_kv_heads, head_dim_k, _, _ = _checks.kv_dims("k", k, kv_layout)
    v_tokens, v_heads, head_dim_v, _, _ = _checks.kv_dims("v", v, kv_layout)
    num_qo_heads, head_dim_q = q.shape[-2], q.shape[-1]
    _checks.check_head_dim("q.shape[-1] (head_dim)", head_dim_q)
    if head_dim_k != head_dim_q:
        raise ValueError(f"k: expected head_dim {head_dim_q} (as q), got {head_dim_k}")
    if head_dim_v != head_dim_q:
        check_head_dim_vo(head_dim_q, head_dim_v, op)
    if (v_tokens, v_heads) != (kv_tokens, num_kv_heads):
        raise ValueError(f"v: expected {kv_tokens} tokens x {num_kv_heads} heads in layout {kv_layout} (as k), "
                         f"got shape {tuple(v.shape)}")
    _checks.check_heads(num_qo_heads, num_kv_heads)
    return kv_tokens, num_qo_heads, num_kv_heads, head_dim_q


def check_head_dim_vo(head_dim_q: int, head_dim_v: int, op: str) -> None:
    """A V narrower than q and k: a QK_VO_HEAD_DIMS pair, for the ops that take one."""
    pairs = qk_vo_pairs()
    if op not in QK_VO_OPS:
        raise ValueError(f"v: expected head_dim {head_dim_q} (as q), got {head_dim_v}; a V narrower than q and k "
                         f"(head_dim_qk/head_dim_vo {pairs}) is taken by single_prefill_with_kv_cache and "
                         f"BatchPrefillWithRaggedKVCacheWrapper only")
    if (head_dim_q, head_dim_v) not in QK_VO_HEAD_DIMS:
        narrower = [vo for qk, vo in QK_VO_HEAD_DIMS if qk == head_dim_q]
        also = f" or {or_list(narrower)} (head_dim_vo)" if narrower else ""
        raise ValueError(f"v: expected head_dim {head_dim_q} (as q){also}, got {head_dim_v}; head_dim_qk/head_dim_vo "
                         f"pairs generated: {pairs}")
