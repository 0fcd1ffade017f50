"""The public ops as torch.library operators in the `flashjit` namespace, so that
torch.compile(fullgraph=True) traces a model that calls them without a graph
break (see docs/torch_compile.md).

This module is the top layer of flashjit.ops: it imports the ops whose eager
bodies the operators run, and none of them imports it; they ask ops._dispatch
whether a call must go through an operator. The operators are defined with
Library.define and not with the torch.library.custom_op decorator, whose Python
autograd and view kernels add host time to every call. The real kernels (CPU and
CUDA) run the same eager bodies, so compiled and eager outputs are bit-identical;
the fake kernels check structure and return outputs of the eager shapes.

A wrapper's plan stays in Python: its run() operator takes an integer handle
(ops._dispatch.register_wrapper), and the kernel looks the wrapper up.

An FP8 cache's dequantisation scales are four optional operands of the attention
operators (_SCALES): k_scale / v_scale as floats, or k_scale_tensor /
v_scale_tensor as one-element tensors, which are graph inputs: the kernel reads
the value a tensor holds when the graph runs, so it may change between calls
without a recompile (ops._dispatch.scale_operands splits what run() was given).
The MLA operators take an FP8 cache's scales the same way, under FlashInfer's
names: ckv_scale / kpe_scale and their tensor forms (_MLA_SCALES).
Attention sinks are the operand after them, `Tensor? sinks`, a graph input as
well: the kernel reads its values when the graph runs (ops._sinks).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import _checks, _dispatch, _scales, _sinks, append, decode, merge, mla, prefill
from ._batch import check_out_buffer, out_shape_words
from ._dispatch import cache_of as _cache_of, wrapper_of
from ._launch import check_qkv

# ---------------------------------------------------------------------------
# Real and fake kernels

def _outputs(q, return_lse: bool, lse_dims: int, head_dim_vo: int | None = None) -> list:
    """Dense outputs shaped as the eager ones: o like q but head_dim_vo wide (None:
    q's head_dim), LSE q's shape without head_dim."""
    out = q.new_empty(q.shape if head_dim_vo is None else (*q.shape[:-1], head_dim_vo))
    return [out, q.new_empty(q.shape[:lse_dims], dtype=torch.float32)] if return_lse else [out]


def _scale_keys(k_scale=None, v_scale=None, k_scale_tensor=None, v_scale_tensor=None) -> tuple:
    """(k_scale, v_scale) as the eager bodies take them (ops._scales.scale_key), from the four
    operands (the dispatcher leaves out trailing ones at their default)."""
    return (_scales.scale_key(k_scale if k_scale_tensor is None else k_scale_tensor),
            _scales.scale_key(v_scale if v_scale_tensor is None else v_scale_tensor))


def _check_scales(kv, device, k_scale=None, v_scale=None, k_scale_tensor=None, v_scale_tensor=None, *,
                  names: tuple[str, str] = ("k_scale", "v_scale")) -> tuple:
    """The fake kernels' scale checks, as the eager ones read without tensor data: scales
    belong to an FP8 cache (kv's dtype); a tensor is one float32 element on q's device
    (a one-element CPU tensor is read as a number); a number, where it is not symbolic, is
    finite and positive. Returns the two scales, each a number, a tensor or None."""
    scales = (k_scale if k_scale_tensor is None else k_scale_tensor,
              v_scale if v_scale_tensor is None else v_scale_tensor)
    _scales.check_scales_for(kv.dtype, *scales, names=names)
    for name, t in zip(names, (k_scale_tensor, v_scale_tensor)):
        if t is not None and not (t.device.type == "cpu" and t.numel() == 1 and t.dtype.is_floating_point):
            _scales.scale_arg(name, _scales.TensorScale(0, t.dtype, t.device, t.numel()), device)
    for name, number in zip(names, (k_scale, v_scale)):
        if isinstance(number, (int, float)):
            _scales.scale_arg(name, number, device)
    return scales


# The eager bodies the real kernels run, looked up at each call (tests replace them
# to tell an operator's kernel from the eager path).
_eager = SimpleNamespace(single_prefill=prefill.run_single, single_decode=decode.run_single,
                         append=append.append_eager, merge_state=merge.merge_state_eager,
                         merge_states=merge.merge_states_eager,
                         merge_state_in_place=merge.merge_state_in_place_eager)


def _sinks_of(operands: tuple) -> tuple:
    """(the four scale operands, sinks) from the operands after the options (the
    dispatcher leaves out trailing ones at their default)."""
    return operands[:4], operands[4] if len(operands) > 4 else None


def _single_prefill(q, k, v, kv_layout, causal, sm_scale, window_left, logits_soft_cap, backend, return_lse,
                    use_tensor_cores, strict, *operands):
    scales, sinks = _sinks_of(operands)
    k_scale, v_scale = _scale_keys(*scales) if scales else (None, None)
    options = (None, k_scale, v_scale, None, None, None, causal, "NONE", False, sm_scale, window_left, logits_soft_cap,
               backend, return_lse, use_tensor_cores, strict)
    res = _eager.single_prefill(q, k, v, kv_layout, options) if sinks is None else \
        _eager.single_prefill(q, k, v, kv_layout, options, sinks=sinks)
    return list(res) if return_lse else [res]


def _single_prefill_fake(q, k, v, kv_layout, causal, sm_scale, window_left, logits_soft_cap, backend, return_lse,
                         use_tensor_cores, strict, *operands):
    scales, sinks = _sinks_of(operands)
    check_qkv(q, k, v, kv_layout, op="single_prefill")
    _checks.variant_values(sm_scale, q.shape[-1], window_left, logits_soft_cap)
    _check_scales(k, q.device, *scales)
    _sinks.check_fake(sinks, q.shape[-2], q.device)
    return _outputs(q, return_lse, 2, v.shape[-1])


def _single_decode(q, k, v, kv_layout, use_tensor_cores, sm_scale, window_left, logits_soft_cap, backend,
                   return_lse, strict, *operands):
    scales, sinks = _sinks_of(operands)
    k_scale, v_scale = _scale_keys(*scales) if scales else (None, None)
    options = ("NONE", use_tensor_cores, None, k_scale, v_scale, window_left, logits_soft_cap, sm_scale, return_lse,
               backend, strict)
    res = _eager.single_decode(q, k, v, kv_layout, options) if sinks is None else \
        _eager.single_decode(q, k, v, kv_layout, options, sinks=sinks)
    return list(res) if return_lse else [res]


def _single_decode_fake(q, k, v, kv_layout, use_tensor_cores, sm_scale, window_left, logits_soft_cap, backend,
                        return_lse, strict, *operands):
    scales, sinks = _sinks_of(operands)
    check_qkv(q, k, v, kv_layout, q_ndim=2)
    _checks.variant_values(sm_scale, q.shape[-1], window_left, logits_soft_cap)
    _check_scales(k, q.device, *scales)
    _sinks.check_fake(sinks, q.shape[-2], q.device)
    return _outputs(q, return_lse, 1)


def _run(handle, q, k, v, return_lse, window_left=None, *operands):
    wrapper = wrapper_of(handle)
    scales, sinks = _sinks_of(operands)
    scales = _scale_keys(*scales) if scales else (None, None)
    if scales != (None, None) or sinks is not None:  # prepared calls keyed by a tensor's address: no fast slot
        res = wrapper._run(q, k, v, None, None, return_lse, window_left, scales, sinks)
        return list(res) if return_lse else [res]
    known, check, call = wrapper._launches.fast
    res = None
    if window_left is None and known == return_lse:  # run()'s fast slot, its tensors as run() passes them
        if wrapper._op == "batch_prefill_ragged":
            res = call(q, k, v, None, None) if check(q, k, v) else None
        else:
            cache = _cache_of(k, v)
            res = call(q, cache, cache, None, None) if check(q, cache) else None
    if res is None:
        res = wrapper._run(q, k, v, None, None, return_lse, window_left)
    return list(res) if return_lse else [res]


def _run_out(handle, q, k, v, out, lse, window_left=None, *operands):
    scales, sinks = _sinks_of(operands)
    scales = _scale_keys(*scales) if scales else (None, None)
    extra = (scales, sinks) if sinks is not None else (scales,) if scales != (None, None) else ()
    wrapper_of(handle)._run(q, k, v, out, lse, lse is not None, window_left, *extra)


def _ragged_run(handle, q, k, v, return_lse, *operands):
    return _run(handle, q, k, v, return_lse, None, *operands)


def _ragged_run_out(handle, q, k, v, out, lse, *operands):
    _run_out(handle, q, k, v, out, lse, None, *operands)


def _planned(handle):
    wrapper = wrapper_of(handle)
    if wrapper._plan is None:
        raise RuntimeError("run() called before plan()")
    return wrapper, wrapper._plan


def _check_run(handle, q, k, v, out=None, lse=None, window_left=None):
    """What run() checks against the plan without reading token counts (which
    are symbolic while tracing) or page ids (device data); returns the plan."""
    wrapper, plan = _planned(handle)
    wrapper._check_planned(q, k, v, plan, window_left)
    _check_out_lse(q, plan, out, lse)
    return plan


def _check_out_lse(q, plan, out, lse) -> None:
    shape = (q.shape[0], plan.num_qo_heads, plan.head_dim_vo)
    if out is not None:
        check_out_buffer("out", out, shape, q.dtype, q.device, out_shape_words(plan))
    if lse is not None:
        check_out_buffer("lse", lse, shape[:2], torch.float32, q.device, "q's rows x num_qo_heads")


def _run_fake(handle, q, k, v, return_lse, window_left=None, *operands):
    scales, sinks = _sinks_of(operands)
    plan = _check_run(handle, q, k, v, window_left=window_left)
    _check_scales(k, q.device, *scales)
    _sinks.check_fake(sinks, q.shape[-2], q.device)
    return _outputs(q, return_lse, 2, plan.head_dim_vo)


def _run_out_fake(handle, q, k, v, out, lse, window_left=None, *operands):
    scales, sinks = _sinks_of(operands)
    _check_run(handle, q, k, v, out, lse, window_left)
    _check_scales(k, q.device, *scales)
    _sinks.check_fake(sinks, q.shape[-2], q.device)


def _ragged_run_fake(handle, q, k, v, return_lse, *operands):
    return _run_fake(handle, q, k, v, return_lse, None, *operands)


def _ragged_run_out_fake(handle, q, k, v, out, lse, *operands):
    _run_out_fake(handle, q, k, v, out, lse, None, *operands)


def _mla_run(handle, q_nope, q_pe, ckv_cache, kpe_cache, return_lse, *scales):
    wrapper = wrapper_of(handle)
    scales = _scale_keys(*scales) if scales else (None, None)
    known, check, call = wrapper._launches.fast  # run()'s fast slot, which holds runs without scales
    if scales == (None, None) and known == return_lse and check(q_nope, q_pe, ckv_cache, kpe_cache):
        res = call(q_nope, q_pe, ckv_cache, kpe_cache, None, None)
    else:
        res = wrapper._run(q_nope, q_pe, ckv_cache, kpe_cache, None, None, return_lse, scales)
    return list(res) if return_lse else [res]


def _mla_run_out(handle, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, *scales):
    scales = _scale_keys(*scales) if scales else (None, None)
    wrapper_of(handle)._run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, lse is not None, scales)


def _check_mla_run(handle, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, scales=()) -> None:
    """What the eager run() checks without tensor data; of the scales (ckv_scale, kpe_scale,
    their tensor forms), also the ratio of two numbers that are not symbolic."""
    wrapper, plan = _planned(handle)
    wrapper._check_mla(q_nope, q_pe, ckv_cache, kpe_cache, plan)
    _check_out_lse(q_nope, plan, out, lse)
    ckv, kpe = _check_scales(ckv_cache, q_nope.device, *scales, names=mla.SCALE_NAMES)
    numbers = [1.0 if s is None else s for s in (ckv, kpe)]
    if all(isinstance(n, (int, float)) for n in numbers):
        mla.check_scale_ratio(*map(float, numbers))


def _mla_run_fake(handle, q_nope, q_pe, ckv_cache, kpe_cache, return_lse, *scales):
    _check_mla_run(handle, q_nope, q_pe, ckv_cache, kpe_cache, scales=scales)
    return _outputs(q_nope, return_lse, 2)


def _mla_run_out_fake(handle, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, *scales):
    _check_mla_run(handle, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, scales)


def _append(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
            kv_last_page_len, kv_layout):
    _eager.append(append_key, append_value, batch_indices, positions, _cache_of(k_cache, v_cache), kv_indices,
                  kv_indptr, kv_last_page_len, kv_layout)


def _append_fake(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
                 kv_last_page_len, kv_layout):
    append.check_append(append_key, append_value, batch_indices, positions, _cache_of(k_cache, v_cache), kv_indices,
                 kv_indptr, kv_last_page_len, kv_layout)


def _merge_state(v_a, s_a, v_b, s_b):
    v, s = _eager.merge_state(v_a, s_a, v_b, s_b)
    # The fake says dense: permuted inputs would otherwise give permuted outputs.
    return v.contiguous(), s.contiguous()


def _merge_state_fake(v_a, s_a, v_b, s_b):
    merge.check_pair("v_a", v_a, "s_a", s_a, "v_b", v_b, "s_b", s_b)
    return v_a.new_empty(v_a.shape), v_a.new_empty(v_a.shape[:2], dtype=torch.float32)


def _merge_state_in_place(v, s, v_other, s_other, mask):
    _eager.merge_state_in_place(v, s, v_other, s_other, mask)


def _merge_state_in_place_fake(v, s, v_other, s_other, mask):
    merge.check_in_place(v, s, v_other, s_other, mask)


def _merge_states(v, s):
    v, s = _eager.merge_states(v, s)
    return v.contiguous(), s.contiguous()


def _merge_states_fake(v, s):
    merge.check_states(v, s)
    seq_len, _, num_heads, head_dim = v.shape
    return v.new_empty((seq_len, num_heads, head_dim)), v.new_empty((seq_len, num_heads), dtype=torch.float32)


# ---------------------------------------------------------------------------
# Registration

_PAGED_RUN = "int handle, Tensor q, Tensor k_cache, Tensor? v_cache"
# An FP8 cache's scales (ops._dispatch.scale_operands): numbers, or one-element tensors read when the graph runs.
_SCALES = "float? k_scale=None, float? v_scale=None, Tensor? k_scale_tensor=None, Tensor? v_scale_tensor=None"
# Attention sinks (ops._sinks): after the scales, a tensor read when the graph runs.
_SINKS = "Tensor? sinks=None"
_MLA_RUN = "int handle, Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache"
# MLA's scales as _SCALES, under FlashInfer's names (ckv for k, kpe for v).
_MLA_SCALES = ("float? ckv_scale=None, float? kpe_scale=None, Tensor? ckv_scale_tensor=None, "
               "Tensor? kpe_scale_tensor=None")
_SCHEMAS = {
    "single_prefill": ("single_prefill(Tensor q, Tensor k, Tensor v, str kv_layout, bool causal, float? sm_scale, "
                       "int? window_left, float? logits_soft_cap, str backend, bool return_lse, "
                       f"bool? use_tensor_cores, bool? strict, {_SCALES}, {_SINKS}) -> Tensor[]", _single_prefill,
                       _single_prefill_fake),
    "single_decode": ("single_decode(Tensor q, Tensor k, Tensor v, str kv_layout, bool? use_tensor_cores, "
                      "float? sm_scale, int? window_left, float? logits_soft_cap, str backend, bool return_lse, "
                      f"bool? strict, {_SCALES}, {_SINKS}) -> Tensor[]", _single_decode, _single_decode_fake),
    "batch_prefill_ragged_run": ("batch_prefill_ragged_run(int handle, Tensor q, Tensor k, Tensor v, "
                                 f"bool return_lse, {_SCALES}, {_SINKS}) -> Tensor[]", _ragged_run, _ragged_run_fake),
    "batch_prefill_ragged_run_out": ("batch_prefill_ragged_run_out(int handle, Tensor q, Tensor k, Tensor v, "
                                     f"Tensor(a!) out, Tensor(b!)? lse, {_SCALES}, {_SINKS}) -> ()", _ragged_run_out,
                                     _ragged_run_out_fake),
    **{f"{op}_run": (f"{op}_run({_PAGED_RUN}, bool return_lse, int? window_left, {_SCALES}, {_SINKS}) -> Tensor[]",
                     _run, _run_fake) for op in ("batch_prefill_paged", "batch_decode_paged")},
    **{f"{op}_run_out": (f"{op}_run_out({_PAGED_RUN}, Tensor(a!) out, Tensor(b!)? lse, int? window_left, "
                         f"{_SCALES}, {_SINKS}) -> ()", _run_out, _run_out_fake)
       for op in ("batch_prefill_paged", "batch_decode_paged")},
    "mla_paged_run": (f"mla_paged_run({_MLA_RUN}, bool return_lse, {_MLA_SCALES}) -> Tensor[]", _mla_run,
                      _mla_run_fake),
    "mla_paged_run_out": (f"mla_paged_run_out({_MLA_RUN}, Tensor(a!) out, Tensor(b!)? lse, {_MLA_SCALES}) -> ()",
                          _mla_run_out, _mla_run_out_fake),
    "append_paged_kv_cache": ("append_paged_kv_cache(Tensor append_key, Tensor append_value, Tensor batch_indices, "
                              "Tensor positions, Tensor(a!) k_cache, Tensor(b!)? v_cache, Tensor kv_indices, "
                              "Tensor kv_indptr, Tensor kv_last_page_len, str kv_layout) -> ()", _append,
                              _append_fake),
    "merge_state": ("merge_state(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b) -> (Tensor, Tensor)", _merge_state,
                    _merge_state_fake),
    "merge_state_in_place": ("merge_state_in_place(Tensor(a!) v, Tensor(b!) s, Tensor v_other, Tensor s_other, "
                             "Tensor? mask) -> ()", _merge_state_in_place, _merge_state_in_place_fake),
    "merge_states": ("merge_states(Tensor v, Tensor s) -> (Tensor, Tensor)", _merge_states, _merge_states_fake),
}
OP_NAMES = tuple(_SCHEMAS)

_lib = None


def _tags() -> tuple:
    # The kernels read the strides they are given (alignment, contiguous head_dim):
    # inductor must hand them the eager layout, or compiled and eager calls could differ.
    names = ("needs_exact_strides", "pt2_compliant_tag") if hasattr(torch.Tag, "needs_exact_strides") \
        else ("needs_fixed_stride_order", "pt2_compliant_tag")
    return tuple(getattr(torch.Tag, n) for n in names if hasattr(torch.Tag, n))


def register() -> None:
    """Defines every operator once (flashjit.ops calls it on import)."""
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library("flashjit", "DEF")
    tags = _tags()
    for name, (schema, impl, fake) in _SCHEMAS.items():
        lib.define(schema, tags=tags)
        lib.impl(name, impl, "CPU")
        lib.impl(name, impl, "CUDA")
        torch.library.register_fake(f"flashjit::{name}", fake, lib=lib)
    _lib = lib
    for op in ("batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged", "mla_paged"):
        _dispatch.RUN_OPS[op] = (getattr(torch.ops.flashjit, f"{op}_run").default,
                        getattr(torch.ops.flashjit, f"{op}_run_out").default)
