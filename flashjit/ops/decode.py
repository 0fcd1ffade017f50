"""Decode attention (one query token) with FlashInfer 0.7's names and semantics."""

from __future__ import annotations

import torch

from . import _checks, _invariant, _scales, _sinks
from ._dispatch import dispatch_modes, is_compiling, scale_operands, sinks_operands
from ._invariant import ENV_KEY as _ENV_KEY, MODES as _MODES, environ_get as _environ_get
from ._calls import Signatures
from ._launch import check_qkv, prepare_single_request, run_single_request
from .prefill import _check_traced_mode

_prepared = Signatures()  # signature -> prepared call (ops._calls)


def single_decode_with_kv_cache(q, k, v, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
                                use_tensor_cores: bool = False, q_scale=None, k_scale=None, v_scale=None,
                                window_left: int = -1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                                rope_theta=None, return_lse: bool = False, *, backend: str = "auto",
                                strict: bool | None = None, batch_invariant: bool | None = None,
                                sinks: torch.Tensor | None = None):
    """q [num_qo_heads, head_dim] against k/v [kv_len, num_kv_heads, head_dim] (NHD)
    or [num_kv_heads, kv_len, head_dim] (HND). Returns o like q, and with
    return_lse the base-2 log-sum-exp [num_qo_heads]. batch_invariant=True: the
    prefill kernel's output for this query row (docs/numerics.md); None:
    FLASHJIT_BATCH_INVARIANT. k/v may be an FP8 cache (float8_e4m3fn,
    float8_e5m2) with q fp16 or bf16: keys are k * k_scale, values v * v_scale
    (Python floats or one-element float32 tensors, ops._scales; default 1).
    sinks (flashjit's keyword; FlashInfer's single decode has none): attention
    sinks, a contiguous float32 tensor [num_qo_heads] on q's device, natural-log
    units (ops._sinks): the softmax runs over the logits and sinks[h]; the
    sink's probability is left out of o, and the LSE includes it (no keys:
    o = 0, lse = sinks[h] * log2(e)); -inf is no sink. Its values are checked
    (NaN, +inf refused) at the first call with that tensor, not after later
    in-place writes, which the kernel reads."""
    if is_compiling() or dispatch_modes():  # _dispatch.tracing()
        _check_traced_mode(batch_invariant)
        _checks.check_unsupported(pos_encoding_mode=pos_encoding_mode, q_scale=q_scale)
        res = torch.ops.flashjit.single_decode.default(q, k, v, kv_layout, use_tensor_cores, sm_scale, window_left,
                                                       logits_soft_cap, backend, bool(return_lse), strict,
                                                       *scale_operands(k_scale, v_scale),
                                                       *sinks_operands(sinks))
        return (res[0], res[1]) if return_lse else res[0]
    # run_single's body, spelled out: one Python call less on a path measured against 10 us.
    if k_scale is not None or v_scale is not None:  # the signature holds a tensor scale's address, not the tensor
        k_scale, v_scale = _scales.scale_key(k_scale), _scales.scale_key(v_scale)
    invariant = _MODES[_environ_get(_ENV_KEY, b"")] if batch_invariant is None else _invariant.resolve(batch_invariant)
    options = (kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
               logits_soft_cap, sm_scale, return_lse, backend, strict, invariant,
               sinks if sinks is None else _sinks.key(sinks))
    known, check, call = _prepared.fast  # the last call, if these options (the sinks' address too) and tensors
    if options == known and check(q, k, v):  # are its signature
        return call(q, k, v)
    return run_single_request(_prepared, _prepare, q, k, v, options, sinks)


def run_single(q, k, v, kv_layout: str, options: tuple, batch_invariant=None, sinks=None):
    """The eager body of single_decode_with_kv_cache; options in its argument order,
    pos_encoding_mode to strict."""
    invariant = _invariant.resolve(batch_invariant)
    pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, *rest = options
    options = (pos_encoding_mode, use_tensor_cores, q_scale, _scales.scale_key(k_scale), _scales.scale_key(v_scale),
               *rest)
    return run_single_request(_prepared, _prepare, q, k, v, (kv_layout, *options, invariant, _sinks.key(sinks)),
                              sinks)


def _prepare(q, k, v, kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
             logits_soft_cap, sm_scale, return_lse, backend, strict, batch_invariant: bool = False, sinks=None):
    _checks.check_unsupported(pos_encoding_mode=pos_encoding_mode, q_scale=q_scale)
    _, num_qo_heads, num_kv_heads, head_dim = check_qkv(q, k, v, kv_layout, q_ndim=2)
    return prepare_single_request("single_decode", q, k, v, kv_layout, head_dim, num_qo_heads, num_kv_heads,
                                  causal=False, sm_scale=sm_scale, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, backend=backend,
                                  use_tensor_cores=use_tensor_cores, return_lse=return_lse, strict=strict,
                                  batch_invariant=batch_invariant, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
