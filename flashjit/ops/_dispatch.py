"""How a public op decides between its eager body and its torch.library operator,
and what a wrapper's traced run() passes to the operator.

The public functions and the wrappers' run() ask `tracing()` first (the
attention ops spell out its two tests). Under dynamo or a torch dispatch mode
(FakeTensorMode, make_fx, torch.export) they call torch.ops.flashjit.*;
otherwise they run their Python body directly, because a trip through the
dispatcher costs host time on every call (docs/torch_compile.md, "How a call
reaches the operator").

This module sits below the ops: it imports none of them. The operators
themselves are defined in ops._library, the layer above every op, which fills
RUN_OPS when it registers them.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from . import _checks, _scales, _sinks

# tracing()'s two tests; the attention ops and wrappers' run() ask them inline
# (a Python call less on paths measured against 10 us).
is_compiling = torch.compiler.is_compiling
dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def tracing() -> bool:
    """True where the ops must appear as operators: while dynamo traces (where
    this folds to a constant) or under a torch dispatch mode."""
    return is_compiling() or dispatch_modes() > 0


# ---------------------------------------------------------------------------
# Wrapper handles: a wrapper's run() operator takes an integer handle, fixed at
# construction, and the operator's kernel looks the wrapper up, so a graph
# compiled once reads whatever plan() last set, without recompiling.

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


# ---------------------------------------------------------------------------
# Traced calls

def cache_args(paged_kv_cache) -> tuple:
    """(k, v) operator arguments of a paged cache: one 5-D tensor as (cache, None)."""
    if isinstance(paged_kv_cache, torch.Tensor):
        return paged_kv_cache, None
    if isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2 \
            and all(isinstance(t, torch.Tensor) for t in paged_kv_cache):
        return paged_kv_cache[0], paged_kv_cache[1]
    _checks.unpack_paged_cache(paged_kv_cache)  # raises the eager ValueError
    raise AssertionError("unreachable")


def cache_of(k, v):
    """The paged cache as the eager ops take it, from its cache_args()."""
    return k if v is None else (k, v)


# op -> (its run operator, its run_out operator), filled by ops._library.register().
RUN_OPS: dict = {}


def scale_operands(k_scale, v_scale, names: tuple[str, str] = ("k_scale", "v_scale")) -> tuple:
    """(k_scale, v_scale, k_scale_tensor, v_scale_tensor) as the operators take an
    FP8 cache's scales: a tensor is a graph input (its value is read when the graph
    runs, so it may change between calls); a number is a float operand, which
    dynamo guards on (a new value recompiles). names: the two in errors (MLA's
    ckv_scale / kpe_scale)."""
    numbers, tensors = [], []
    for name, scale in zip(names, (k_scale, v_scale)):
        if isinstance(scale, torch.Tensor):
            numbers.append(None)
            tensors.append(scale)
            continue
        if isinstance(scale, int) and not isinstance(scale, bool):
            scale = float(scale)
        elif scale is not None and not isinstance(scale, (float, torch.SymFloat)):
            _scales.scale_arg(name, scale, None)  # the eager ValueError for what is not a number
            scale = float(scale)
        numbers.append(scale)
        tensors.append(None)
    return (*numbers, *tensors)


def sinks_operands(sinks) -> tuple:
    """The operators' operands after the scales: (sinks,), or none (the schema's default)."""
    return () if sinks is None else (_sinks.operand(sinks),)


def run_batch(wrapper, q, k, v, out, lse, return_lse: bool, window_left=None, k_scale=None, v_scale=None,
              sinks=None):
    """The traced run() of a batch wrapper (k, v as cache_args gives them for a paged cache;
    k_scale / v_scale: an FP8 cache's, which the operators take as scale_operands gives them;
    sinks: a tensor operand after them, a graph input whose values the kernel reads when the
    graph runs)."""
    scales = scale_operands(k_scale, v_scale) + sinks_operands(sinks)
    extra = scales if wrapper._op == "batch_prefill_ragged" else (window_left, *scales)
    return _run_traced(wrapper, (q, k, v), extra, out, lse, return_lse)


def run_mla(wrapper, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse: bool, ckv_scale=None,
            kpe_scale=None):
    """The traced run() of BatchMLAPagedAttentionWrapper (ckv_scale / kpe_scale: an FP8
    cache's, operands as scale_operands gives them, under FlashInfer's names)."""
    scales = scale_operands(ckv_scale, kpe_scale, _scales.MLA_SCALE_NAMES)
    return _run_traced(wrapper, (q_nope, q_pe, ckv_cache, kpe_cache), scales, out, lse, return_lse)


def _run_traced(wrapper, inputs: tuple, extra: tuple, out, lse, return_lse: bool):
    """out / lse given: the in-place operator, with what is missing allocated in the
    graph, shaped as the eager outputs: o like inputs[0] (q, or MLA's q_nope, whose
    width is V's) but as wide as the planned V (head_dim_vo), LSE without its head_dim."""
    ops, q = RUN_OPS[wrapper._op], inputs[0]
    return_lse = bool(return_lse)
    if out is None and lse is None:
        res = ops[0](wrapper._handle, *inputs, return_lse, *extra)
        return (res[0], res[1]) if return_lse else res[0]
    if out is None:
        plan = wrapper._plan  # None: the operator raises run()'s error
        out = q.new_empty(q.shape if plan is None else (*q.shape[:-1], plan.head_dim_vo))
    if not return_lse:
        lse = None
    elif lse is None:
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    ops[1](wrapper._handle, *inputs, out, lse, *extra)
    return (out, lse) if return_lse else out
