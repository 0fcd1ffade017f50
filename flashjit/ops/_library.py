"""The public ops as torch.library operators in the `flashjit` namespace, so that
torch.compile(fullgraph=True) traces a model that calls them without a graph
break (see docs/torch_compile.md).

The public functions and the wrappers' run() ask `tracing()` first (the
attention ops spell out its two tests). Under dynamo or a torch dispatch mode
(FakeTensorMode, make_fx, torch.export) they call torch.ops.flashjit.*;
otherwise they run their Python body directly,
because a trip through the dispatcher costs host time on every call (paged
decode run() on an H200 host: 25.5 us eager, 32.1 us through its operator,
benchmarks/results/2026-11-25-h200-jit-overhead.md). The operators are defined
with Library.define and not with the torch.library.custom_op decorator, whose
Python autograd and view kernels add host time to every call. The real kernels (CPU and CUDA)
run the same eager bodies, so compiled and eager outputs are bit-identical;
the fake kernels check structure and return outputs of the eager shapes.

A wrapper's plan stays in Python: its run() operator takes an integer handle,
fixed at construction, and the kernel looks the wrapper up, so a graph compiled
once reads whatever plan() last set, without recompiling.
"""

from __future__ import annotations

import itertools
import weakref
from types import SimpleNamespace

import torch

from . import _checks
from ._launch import check_qkv

# tracing()'s two tests; the attention ops and wrappers' run() ask them inline
# (a Python call less on paths measured against 10 us).
is_compiling = torch.compiler.is_compiling
dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def tracing() -> bool:
    """True where the ops must appear as operators: while dynamo traces (where
    this folds to a constant) or under a torch dispatch mode."""
    return is_compiling() or dispatch_modes() > 0


# ---------------------------------------------------------------------------
# Wrapper handles

_wrappers: dict[int, weakref.ref] = {}
_handles = itertools.count(1)


def register_wrapper(wrapper) -> int:
    """A handle for the wrapper's run() operators; it lives as long as the wrapper."""
    handle = next(_handles)
    _wrappers[handle] = weakref.ref(wrapper, lambda _, h=handle: _wrappers.pop(h, None))
    return handle


def wrapper_of(handle: int):
    ref = _wrappers.get(handle)
    wrapper = ref() if ref is not None else None
    if wrapper is None:
        raise RuntimeError(f"flashjit: no live wrapper has handle {handle}; a compiled graph outlived the wrapper "
                           f"whose run() it calls")
    return wrapper


def cache_args(paged_kv_cache) -> tuple:
    """(k, v) operator arguments of a paged cache: one 5-D tensor as (cache, None)."""
    if isinstance(paged_kv_cache, torch.Tensor):
        return paged_kv_cache, None
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2 \
            and all(isinstance(t, torch.Tensor) for t in paged_kv_cache):
        return paged_kv_cache[0], paged_kv_cache[1]
    _checks.unpack_paged_cache(paged_kv_cache)  # raises the eager ValueError
    raise AssertionError("unreachable")


def _cache_of(k, v):
    return k if v is None else (k, v)


def run_batch(wrapper, q, k, v, out, lse, return_lse: bool, window_left=None):
    """The traced run() of a batch wrapper (k, v as cache_args gives them for a paged cache)."""
    extra = () if wrapper._op == "batch_prefill_ragged" else (window_left,)
    return _run_traced(wrapper, (q, k, v), extra, out, lse, return_lse)


def run_mla(wrapper, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse: bool):
    """The traced run() of BatchMLAPagedAttentionWrapper."""
    return _run_traced(wrapper, (q_nope, q_pe, ckv_cache, kpe_cache), (), out, lse, return_lse)


def _run_traced(wrapper, inputs: tuple, extra: tuple, out, lse, return_lse: bool):
    """out / lse given: the in-place operator, with what is missing allocated in the
    graph, shaped as the eager outputs: o like inputs[0] (q, or MLA's q_nope, whose
    width is V's), LSE without its head_dim."""
    ops, q = _RUN_OPS[wrapper._op], inputs[0]
    return_lse = bool(return_lse)
    if out is None and lse is None:
        res = ops[0](wrapper._handle, *inputs, return_lse, *extra)
        return (res[0], res[1]) if return_lse else res[0]
    if out is None:
        out = q.new_empty(q.shape)
    if not return_lse:
        lse = None
    elif lse is None:
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    ops[1](wrapper._handle, *inputs, out, lse, *extra)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------
# Real and fake kernels

def _outputs(q, return_lse: bool, lse_dims: int) -> list:
    """Dense outputs shaped as the eager ones: o like q, LSE q's shape without head_dim."""
    out = q.new_empty(q.shape)
    return [out, q.new_empty(q.shape[:lse_dims], dtype=torch.float32)] if return_lse else [out]


# The eager bodies, bound by register(): the modules that hold them import this one.
_eager = SimpleNamespace()


def _single_prefill(q, k, v, kv_layout, causal, sm_scale, window_left, logits_soft_cap, backend, return_lse,
                    use_tensor_cores, strict):
    res = _eager.single_prefill(q, k, v, kv_layout, (None,) * 6 + (causal, "NONE", False, sm_scale, window_left,
                                                                   logits_soft_cap, backend, return_lse,
                                                                   use_tensor_cores, strict))
    return list(res) if return_lse else [res]


def _single_prefill_fake(q, k, v, kv_layout, causal, sm_scale, window_left, logits_soft_cap, backend, return_lse,
                         use_tensor_cores, strict):
    check_qkv(q, k, v, kv_layout)
    _checks.variant_values(sm_scale, q.shape[-1], window_left, logits_soft_cap)
    return _outputs(q, return_lse, 2)


def _single_decode(q, k, v, kv_layout, use_tensor_cores, sm_scale, window_left, logits_soft_cap, backend,
                   return_lse, strict):
    res = _eager.single_decode(q, k, v, kv_layout, ("NONE", use_tensor_cores, None, None, None, window_left,
                                                    logits_soft_cap, sm_scale, return_lse, backend, strict))
    return list(res) if return_lse else [res]


def _single_decode_fake(q, k, v, kv_layout, use_tensor_cores, sm_scale, window_left, logits_soft_cap, backend,
                        return_lse, strict):
    check_qkv(q, k, v, kv_layout, q_ndim=2)
    _checks.variant_values(sm_scale, q.shape[-1], window_left, logits_soft_cap)
    return _outputs(q, return_lse, 1)


def _run(handle, q, k, v, return_lse, window_left=None):
    wrapper = wrapper_of(handle)
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


def _run_out(handle, q, k, v, out, lse, window_left=None):
    wrapper_of(handle)._run(q, k, v, out, lse, lse is not None, window_left)


def _planned(handle):
    wrapper = wrapper_of(handle)
    if wrapper._plan is None:
        raise RuntimeError("run() called before plan()")
    return wrapper, wrapper._plan


def _check_run(handle, q, k, v, out=None, lse=None, window_left=None) -> None:
    """What run() checks against the plan without reading token counts (which
    are symbolic while tracing) or page ids (device data)."""
    wrapper, plan = _planned(handle)
    wrapper._check_planned(q, k, v, plan, window_left)
    _check_out_lse(q, plan, out, lse)


def _check_out_lse(q, plan, out, lse) -> None:
    from ._batch import check_out_buffer

    shape = (q.shape[0], plan.num_qo_heads, plan.head_dim)
    if out is not None:
        check_out_buffer("out", out, shape, q.dtype, q.device, "q's rows x num_qo_heads x head_dim, q's dtype")
    if lse is not None:
        check_out_buffer("lse", lse, shape[:2], torch.float32, q.device, "q's rows x num_qo_heads")


def _run_fake(handle, q, k, v, return_lse, window_left=None):
    _check_run(handle, q, k, v, window_left=window_left)
    return _outputs(q, return_lse, 2)


def _run_out_fake(handle, q, k, v, out, lse, window_left=None):
    _check_run(handle, q, k, v, out, lse, window_left)


def _mla_run(handle, q_nope, q_pe, ckv_cache, kpe_cache, return_lse):
    wrapper = wrapper_of(handle)
    known, check, call = wrapper._launches.fast  # run()'s fast slot
    if known == return_lse and check(q_nope, q_pe, ckv_cache, kpe_cache):
        res = call(q_nope, q_pe, ckv_cache, kpe_cache, None, None)
    else:
        res = wrapper._run(q_nope, q_pe, ckv_cache, kpe_cache, None, None, return_lse)
    return list(res) if return_lse else [res]


def _mla_run_out(handle, q_nope, q_pe, ckv_cache, kpe_cache, out, lse):
    wrapper_of(handle)._run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, lse is not None)


def _check_mla_run(handle, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None) -> None:
    wrapper, plan = _planned(handle)
    wrapper._check_mla(q_nope, q_pe, ckv_cache, kpe_cache, plan)
    _check_out_lse(q_nope, plan, out, lse)


def _mla_run_fake(handle, q_nope, q_pe, ckv_cache, kpe_cache, return_lse):
    _check_mla_run(handle, q_nope, q_pe, ckv_cache, kpe_cache)
    return _outputs(q_nope, return_lse, 2)


def _mla_run_out_fake(handle, q_nope, q_pe, ckv_cache, kpe_cache, out, lse):
    _check_mla_run(handle, q_nope, q_pe, ckv_cache, kpe_cache, out, lse)


def _append(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
            kv_last_page_len, kv_layout):
    _eager.append(append_key, append_value, batch_indices, positions, _cache_of(k_cache, v_cache), kv_indices,
                  kv_indptr, kv_last_page_len, kv_layout)


def _append_fake(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
                 kv_last_page_len, kv_layout):
    from .append import check_append

    check_append(append_key, append_value, batch_indices, positions, _cache_of(k_cache, v_cache), kv_indices,
                 kv_indptr, kv_last_page_len, kv_layout)


def _merge_state(v_a, s_a, v_b, s_b):
    v, s = _eager.merge_state(v_a, s_a, v_b, s_b)
    # The fake says dense: permuted inputs would otherwise give permuted outputs.
    return v.contiguous(), s.contiguous()


def _merge_state_fake(v_a, s_a, v_b, s_b):
    from .merge import check_pair

    check_pair("v_a", v_a, "s_a", s_a, "v_b", v_b, "s_b", s_b)
    return v_a.new_empty(v_a.shape), v_a.new_empty(v_a.shape[:2], dtype=torch.float32)


def _merge_state_in_place(v, s, v_other, s_other, mask):
    _eager.merge_state_in_place(v, s, v_other, s_other, mask)


def _merge_state_in_place_fake(v, s, v_other, s_other, mask):
    from .merge import check_in_place

    check_in_place(v, s, v_other, s_other, mask)


def _merge_states(v, s):
    v, s = _eager.merge_states(v, s)
    return v.contiguous(), s.contiguous()


def _merge_states_fake(v, s):
    from .merge import check_states

    check_states(v, s)
    seq_len, _, num_heads, head_dim = v.shape
    return v.new_empty((seq_len, num_heads, head_dim)), v.new_empty((seq_len, num_heads), dtype=torch.float32)


# ---------------------------------------------------------------------------
# Registration

_PAGED_RUN = "int handle, Tensor q, Tensor k_cache, Tensor? v_cache"
_MLA_RUN = "int handle, Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache"
_SCHEMAS = {
    "single_prefill": ("single_prefill(Tensor q, Tensor k, Tensor v, str kv_layout, bool causal, float? sm_scale, "
                       "int? window_left, float? logits_soft_cap, str backend, bool return_lse, "
                       "bool? use_tensor_cores, bool? strict) -> Tensor[]", _single_prefill, _single_prefill_fake),
    "single_decode": ("single_decode(Tensor q, Tensor k, Tensor v, str kv_layout, bool? use_tensor_cores, "
                      "float? sm_scale, int? window_left, float? logits_soft_cap, str backend, bool return_lse, "
                      "bool? strict) -> Tensor[]", _single_decode, _single_decode_fake),
    "batch_prefill_ragged_run": ("batch_prefill_ragged_run(int handle, Tensor q, Tensor k, Tensor v, "
                                 "bool return_lse) -> Tensor[]", _run, _run_fake),
    "batch_prefill_ragged_run_out": ("batch_prefill_ragged_run_out(int handle, Tensor q, Tensor k, Tensor v, "
                                     "Tensor(a!) out, Tensor(b!)? lse) -> ()", _run_out, _run_out_fake),
    **{f"{op}_run": (f"{op}_run({_PAGED_RUN}, bool return_lse, int? window_left) -> Tensor[]", _run, _run_fake)
       for op in ("batch_prefill_paged", "batch_decode_paged")},
    **{f"{op}_run_out": (f"{op}_run_out({_PAGED_RUN}, Tensor(a!) out, Tensor(b!)? lse, int? window_left) -> ()",
                         _run_out, _run_out_fake) for op in ("batch_prefill_paged", "batch_decode_paged")},
    "mla_paged_run": (f"mla_paged_run({_MLA_RUN}, bool return_lse) -> Tensor[]", _mla_run, _mla_run_fake),
    "mla_paged_run_out": (f"mla_paged_run_out({_MLA_RUN}, Tensor(a!) out, Tensor(b!)? lse) -> ()", _mla_run_out,
                          _mla_run_out_fake),
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
_RUN_OPS: dict = {}


def _tags() -> tuple:
    # The kernels read the strides they are given (alignment, contiguous head_dim):
    # inductor must hand them the eager layout, or compiled and eager calls could differ.
    names = ("needs_exact_strides", "pt2_compliant_tag") if hasattr(torch.Tag, "needs_exact_strides") \
        else ("needs_fixed_stride_order", "pt2_compliant_tag")
    return tuple(getattr(torch.Tag, n) for n in names if hasattr(torch.Tag, n))


def register() -> None:
    """Defines every operator once (flashjit.ops imports this after its modules)."""
    global _lib
    if _lib is not None:
        return
    from . import append, decode, merge, prefill

    _eager.single_prefill, _eager.single_decode = prefill.run_single, decode.run_single
    _eager.append = append.append_eager
    _eager.merge_state, _eager.merge_states = merge.merge_state_eager, merge.merge_states_eager
    _eager.merge_state_in_place = merge.merge_state_in_place_eager
    lib = torch.library.Library("flashjit", "DEF")
    tags = _tags()
    for name, (schema, impl, fake) in _SCHEMAS.items():
        lib.define(schema, tags=tags)
        lib.impl(name, impl, "CPU")
        lib.impl(name, impl, "CUDA")
        torch.library.register_fake(f"flashjit::{name}", fake, lib=lib)
    _lib = lib
    for op in ("batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged", "mla_paged"):
        _RUN_OPS[op] = (getattr(torch.ops.flashjit, f"{op}_run").default,
                        getattr(torch.ops.flashjit, f"{op}_run_out").default)
