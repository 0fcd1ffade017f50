"""Prefill attention with FlashInfer 0.7's names and semantics:
single_prefill_with_kv_cache and BatchPrefillWithRaggedKVCacheWrapper."""

from __future__ import annotations

import torch

from ..spec import QK_VO_HEAD_DIMS, QK_VO_OPS, qk_vo_pairs
from . import _checks, _dispatch, _invariant, _masks, _scales, _sinks
from ._aliases import RaggedPrefillAliases, remembers_plan
from ._dispatch import dispatch_modes, is_compiling
from ._invariant import ENV_KEY as _ENV_KEY, MODES as _MODES, environ_get as _environ_get
from ._batch import BatchAttention, dtype_arg
from ._calls import Signatures, fill_slot, keep_run, tensor_signature
from ._launch import check_qkv, kv_tokens, prepare_single_request, run_single_request, select_spec


_prepared = Signatures()  # signature -> prepared call (ops._calls)


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None, custom_mask=None,
                                 packed_custom_mask=None, causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                                 sm_scale=None, window_left: int = -1, logits_soft_cap=None, rope_scale=None,
                                 rope_theta=None, backend: str = "auto", return_lse: bool = False, *,
                                 use_tensor_cores: bool | None = None, strict: bool | None = None,
                                 batch_invariant: bool | None = None, sinks: torch.Tensor | None = None):
    """Attention of one request: q [qo_len, num_qo_heads, head_dim_qk], k [kv_len,
    num_kv_heads, head_dim_qk] and v [kv_len, num_kv_heads, head_dim_vo] (NHD) or
    [num_kv_heads, kv_len, head_dim] (HND); head_dim_vo is head_dim_qk, or the V
    width of a spec.QK_VO_HEAD_DIMS pair (192/128: DeepSeek-V2/V3's prefill).
    Returns o [qo_len, num_qo_heads, head_dim_vo], and with return_lse the base-2
    log-sum-exp [qo_len, num_qo_heads].
    sinks (flashjit's keyword; FlashInfer's single prefill has none): attention
    sinks, a contiguous float32 tensor [num_qo_heads] on q's device, natural-log
    units (ops._sinks): each row's softmax runs over its logits and sinks[h];
    the sink's probability is left out of o, and the LSE includes it (a row
    with no visible key: o = 0, lse = sinks[h] * log2(e)); -inf is no sink.
    Its values are checked (NaN, +inf refused) at the first call with that
    tensor, not after later in-place writes, which the kernel reads.
    strict=True: a backend this GPU cannot run (fa3 off sm_90a) raises instead of running fa2.
    batch_invariant=True: the output is the one every op gives this request in
    batch-invariant mode (docs/numerics.md); None: FLASHJIT_BATCH_INVARIANT.
    k/v may be an FP8 cache (float8_e4m3fn, float8_e5m2) with q fp16 or bf16:
    keys are k * scale_k, values v * scale_v (FlashInfer's names here; Python
    floats or one-element float32 tensors, ops._scales; default 1).
    custom_mask: which keys each query sees, a bool tensor [qo_len, kv_len] (or
    flat; integer 0/1 too) on q's device, True: visible; packed_custom_mask:
    those bits packed little-endian (packbits(mask.flatten(), "little"), uint8
    of ceil(qo_len * kv_len / 8) bytes), used where both are given. With
    causal=False only, on fa2 tensor cores (fp16/bf16; `auto` picks fa2);
    packed and prepared at every call, not under torch.compile (docs/masks.md)."""
    if is_compiling() or dispatch_modes():  # _dispatch.tracing()
        _check_traced_mode(batch_invariant)
        _check_options(q, scale_q, o_dtype, custom_mask, packed_custom_mask, pos_encoding_mode,
                       use_fp16_qk_reduction)
        res = torch.ops.flashjit.single_prefill.default(q, k, v, kv_layout, bool(causal), sm_scale, window_left,
                                                        logits_soft_cap, backend, bool(return_lse),
                                                        use_tensor_cores, strict,
                                                        *_dispatch.scale_operands(scale_k, scale_v),
                                                        *_dispatch.sinks_operands(sinks))
        return (res[0], res[1]) if return_lse else res[0]
    # run_single's body, spelled out: one Python call less on a path measured against 10 us.
    if scale_k is not None or scale_v is not None:  # the signature holds a tensor scale's address, not the tensor
        scale_k, scale_v = _scales.scale_key(scale_k), _scales.scale_key(scale_v)
    invariant = _MODES[_environ_get(_ENV_KEY, b"")] if batch_invariant is None else _invariant.resolve(batch_invariant)
    options = (kv_layout, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal,
               pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, backend, return_lse,
               use_tensor_cores, strict, invariant, sinks if sinks is None else _sinks.key(sinks))
    known, check, call = _prepared.fast  # the last call, if these options (the sinks' address too) and tensors
    if options == known and check(q, k, v):  # are its signature
        return call(q, k, v)
    if custom_mask is not None or packed_custom_mask is not None:  # its bits are this call's: prepared for it alone
        return _prepare_single(q, k, v, *options[:-1], sinks)(q, k, v)
    return run_single_request(_prepared, _prepare_single, q, k, v, options, sinks)


def _check_traced_mode(batch_invariant) -> None:
    """The operators take the mode from FLASHJIT_BATCH_INVARIANT alone (their
    eager bodies read it): an argument that says otherwise cannot be traced."""
    if batch_invariant is not None and _invariant.resolve(batch_invariant) != _invariant.env_setting():
        raise NotImplementedError(f"batch_invariant={batch_invariant}: not an argument of the torch.ops.flashjit "
                                  f"operators; under tracing set {_invariant.ENV_VAR} for the process instead")


def run_single(q, k, v, kv_layout: str, options: tuple, batch_invariant=None, sinks=None):
    """The eager body of single_prefill_with_kv_cache; options in its argument order, scale_q to strict."""
    invariant = _invariant.resolve(batch_invariant)
    scale_q, scale_k, scale_v, *rest = options
    options = (scale_q, _scales.scale_key(scale_k), _scales.scale_key(scale_v), *rest)
    return run_single_request(_prepared, _prepare_single, q, k, v, (kv_layout, *options, invariant, _sinks.key(sinks)),
                              sinks)


def _prepare_single(q, k, v, kv_layout, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal,
                    pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, backend,
                    return_lse, use_tensor_cores, strict, batch_invariant: bool = False, sinks=None):
    _checks.check_unsupported(scale_q=scale_q, pos_encoding_mode=pos_encoding_mode,
                              use_fp16_qk_reduction=use_fp16_qk_reduction)
    kv_len, num_qo_heads, num_kv_heads, head_dim = check_qkv(q, k, v, kv_layout, op="single_prefill")
    _check_o_dtype(q, o_dtype)
    mask = _masks.given(custom_mask, packed_custom_mask)
    if mask is not None:
        _masks.check_causal(mask, causal)
        qo_len = q.shape[0]
        _masks.check_tensor(mask, qo_len * kv_len, _masks.byte_indptr([qo_len], [kv_len])[-1],
                            f"q's {qo_len} tokens x k's {kv_len}", shape=(qo_len, kv_len))
    return prepare_single_request("single_prefill", q, k, v, kv_layout, head_dim, num_qo_heads, num_kv_heads,
                                  causal=causal, sm_scale=sm_scale, window_left=window_left,
                                  logits_soft_cap=logits_soft_cap, backend=backend,
                                  use_tensor_cores=use_tensor_cores, return_lse=return_lse, strict=strict,
                                  batch_invariant=batch_invariant, k_scale=scale_k, v_scale=scale_v,
                                  scale_names=("scale_k", "scale_v"), sinks=sinks, mask=mask)


def _check_options(q, scale_q, o_dtype, custom_mask, packed_custom_mask, pos_encoding_mode,
                   use_fp16_qk_reduction) -> None:
    """The options the operator does not take: at their defaults, or an error as in eager calls.
    A custom mask is not an operand: the wrappers, planned outside the compiled
    region, hold theirs (docs/torch_compile.md)."""
    _checks.check_unsupported(scale_q=scale_q, pos_encoding_mode=pos_encoding_mode,
                              use_fp16_qk_reduction=use_fp16_qk_reduction)
    mask = _masks.given(custom_mask, packed_custom_mask)
    if mask is not None:
        raise NotImplementedError(f"{mask.name}: single_prefill_with_kv_cache takes no custom mask under "
                                  f"torch.compile or a dispatch mode; plan a BatchPrefillWithRaggedKVCacheWrapper "
                                  f"with it outside the compiled region and call its run() inside")
    _check_o_dtype(q, o_dtype)


def _check_o_dtype(q, o_dtype) -> None:
    if o_dtype is not None and o_dtype != q.dtype:
        raise ValueError(f"o_dtype: expected None or {q.dtype} (the output has q's dtype), got {o_dtype}")


class BatchPrefillWithRaggedKVCacheWrapper(RaggedPrefillAliases, BatchAttention):
    """Prefill over a ragged batch: q packed as [qo_indptr[-1], heads, head_dim_qk],
    k/v packed as [kv_indptr[-1], kv_heads, dim] (NHD) or [kv_heads, kv_indptr[-1],
    dim] (HND), dim head_dim_qk for k and head_dim_vo for v; the output is
    [qo_indptr[-1], heads, head_dim_vo]. plan() once per batch shape on the host,
    run() many times."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend: str = "auto", jit_args=None, *, strict: bool | None = None):
        """custom_mask_buf: with use_cuda_graph=True, where plan() writes a custom
        mask's packed bits (its address is captured; sized for the largest mask).
        mask_indptr_buf: accepted, not written: the byte offsets live in the
        wrapper's metadata array, which stays in place under CUDA graphs."""
        if jit_args is not None:
            raise NotImplementedError("jit_args: custom JIT modules are not supported; flashjit generates its own")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, strict=strict,
                         mask_buffers=(custom_mask_buf, mask_indptr_buf))

    @remembers_plan
    def plan(self, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
             head_dim_vo: int | None = None, custom_mask=None, packed_custom_mask=None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, window_left: int = -1,
             logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, non_blocking: bool = True, *, fixed_split_size: int | None = None,
             disable_split_kv: bool = False, use_tensor_cores: bool | None = None,
             batch_invariant: bool | None = None) -> None:
        """head_dim_vo: V's and the output's width (None: head_dim_qk), narrower
        than head_dim_qk for the pairs of spec.QK_VO_HEAD_DIMS (192/128, DeepSeek's
        prefill: CUDA cores, fa2, or fa3 on sm_90a, which `auto` picks there; K/V of q's dtype).
        fixed_split_size: keys per split-KV chunk (rounded up to the kernel's
        tile); disable_split_kv: every request in one CTA per row tile.
        batch_invariant=True: each request's output does not depend on the rest
        of the batch, nor on the op that computes it (docs/numerics.md); None:
        FLASHJIT_BATCH_INVARIANT.
        custom_mask: each request's [qo_len, kv_len] bool mask (True: the query
        sees the key), flattened row-major and concatenated request after request
        (sum of qo_len * kv_len elements; integer 0/1 too), on the workspace's
        device or the CPU; packed_custom_mask: the same bits as
        segment_packbits(custom_mask, bit_indptr, "little") returns them (uint8,
        each request's segment from a byte boundary), used where both are given.
        Either with causal=False only, on fa2 tensor cores (docs/masks.md)."""
        invariant = _invariant.resolve(batch_invariant)
        qo = _checks.check_indptr("qo_indptr", qo_indptr)
        kv = _checks.check_indptr("kv_indptr", kv_indptr, batch_size=len(qo) - 1)
        spec, scalars, q_dtype = plan_spec(
            "batch_prefill_ragged", self._backend, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, custom_mask,
            packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
            sm_scale, q_data_type, kv_data_type, o_data_type, use_tensor_cores, strict=self._strict,
            batch_invariant=invariant)
        kv_lens = [kv[i + 1] - kv[i] for i in range(len(kv) - 1)]
        mask = self._plan_mask(custom_mask, packed_custom_mask, qo, kv_lens, "kv lengths from kv_indptr")
        self._plan_batch(spec, qo, kv, kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim_qk, head_dim_vo=spec.head_dim_vo, q_dtype=q_dtype, scalars=scalars,
                         fixed_chunk=fixed_split_size, mask=mask,
                         allow_split=not disable_split_kv, non_blocking=non_blocking, batch_invariant=invariant)

    _op = "batch_prefill_ragged"

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, sinks: torch.Tensor | None = None):
        """k_scale / v_scale (an FP8 K/V's dequantisation scales): Python floats or
        one-element float32 tensors, which the kernel reads (ops._scales).
        sinks (flashjit's keyword; FlashInfer's ragged run() has none): attention
        sinks, a contiguous float32 tensor [num_qo_heads] on q's device,
        natural-log units (ops._sinks): each row's softmax runs over its logits
        and sinks[h]; the sink's probability is left out of out, and the LSE
        includes it (a row with no visible key: out = 0, lse = sinks[h] *
        log2(e)); -inf is no sink. Its values are checked (NaN, +inf refused) at
        the first run() with that tensor, not after later in-place writes,
        which the kernel reads (a CUDA graph replays with the values then)."""
        if args:
            _checks.check_no_extra_args("run()", args)
        _checks.check_unsupported(q_scale=q_scale)
        if is_compiling() or dispatch_modes():  # _dispatch.tracing()
            return _dispatch.run_batch(self, q, k, v, out, lse, return_lse, None, k_scale, v_scale, sinks)
        if k_scale is not None or v_scale is not None or sinks is not None:
            return self._run(q, k, v, out, lse, return_lse, scales=(_scales.scale_key(k_scale),
                                                                    _scales.scale_key(v_scale)), sinks=sinks)
        if lse is None:  # the last run, if these tensors are its signature (ops._calls.Signatures)
            if out is None:
                known, check, call = self._launches.fast
                if known == return_lse and check(q, k, v):
                    return call(q, k, v, None, None)
            else:
                known, check, call = self._launches.fast_out
                if known == return_lse and check(q, k, v, out):
                    return call(q, k, v, out, None)
        return self._run(q, k, v, out, lse, return_lse)

    def _run(self, q, k, v, out, lse, return_lse: bool, window_left=None, scales=(None, None), sinks=None):
        """run()'s eager body (window_left: the paged wrappers' argument, never given here);
        scales: (k_scale, v_scale) as ops._scales.scale_key gave them; sinks: the
        tensor as given (its key joins the signature; the fast slots hold only
        runs with neither scales nor sinks)."""
        plain = scales == (None, None) and sinks is None
        try:
            key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
                   v.dtype, v.device, return_lse, out if out is None else tensor_signature(out),
                   lse if lse is None else tensor_signature(lse), scales, _sinks.key(sinks))
            launches = self._launches
            last_key, launch = launches.last
            if key != last_key:
                launch = launches.get(key)
                if launch is not None:
                    launches.last = (key, launch)
        except (AttributeError, TypeError):  # no tensors, or an unhashable option: the checks say which
            key = launch = None
        if launch is not None:
            if lse is None and plain:
                fill_slot(launches, return_lse, out, launch)
            return launch(q, k, v, out, lse)
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() called before plan()")
        given_out, given_lse = out, lse
        self._check_planned(q, k, v, plan)
        self._check_q_rows(q, plan)
        kv_len = kv_tokens(k, v, self._kv_layout)
        if kv_len != plan.kv_tokens and not (plan.graph_tokens and kv_len > plan.kv_tokens):
            at_least = "at least " if plan.graph_tokens else ""
            raise ValueError(f"k: expected {at_least}{plan.kv_tokens} tokens (kv_indptr[-1] as planned) in layout "
                             f"{self._kv_layout}, got {kv_len} (shape {tuple(k.shape)})")
        checked = _scales.checked(k.dtype, scales, q.device)
        sinks_address = _sinks.checked_address(sinks, plan.num_qo_heads, q.device)
        out, lse = self._outputs(q, plan, out, lse, return_lse)
        _, _, _, k_sn, k_sh = _checks.kv_dims("k", k, self._kv_layout)
        _, _, _, v_sn, v_sh = _checks.kv_dims("v", v, self._kv_layout)
        launch = self._launch(q, k, v, (k_sn, k_sh, 0), (v_sn, v_sh, 0), out, lse, scales=checked,
                              **({"sinks": sinks_address} if sinks_address else {}))
        keep_run(self._launches, key, launch, (q, k, v) if given_out is None else (q, k, v, given_out), return_lse,
                 given_out, given_lse is None and plain)
        return (out, lse) if return_lse else out

    def _check_planned(self, q, k, v, plan, window_left=None) -> None:
        """q, k and v against the plan, all but the token counts."""
        self._check_q(q, plan)
        self._check_kv("k", k, plan)
        self._check_kv("v", v, plan)
        check_qkv(q, k, v, self._kv_layout, op=self._op)

    def _check_kv(self, name: str, t, plan) -> None:
        """k or v against the plan: rank, dtype, kv heads, head_dim (v: head_dim_vo) in the wrapper's layout."""
        _checks.check_tensor(name, t, 3, kv=True)
        _scales.check_planned_dtype(name, t.dtype, getattr(torch, plan.module.spec.dtype_kv))
        _, heads, dim, _, _ = _checks.kv_dims(name, t, self._kv_layout)
        planned, dim_name = (plan.head_dim_vo, "head_dim_vo") if name == "v" and plan.head_dim_vo != plan.head_dim \
            else (plan.head_dim, "head_dim")
        if (heads, dim) != (plan.num_kv_heads, planned):
            other_heads = t.shape[0] if self._kv_layout == "NHD" else t.shape[1]
            hint = _checks.other_layout_hint(self._kv_layout, dim == planned and other_heads == plan.num_kv_heads)
            raise ValueError(f"{name}: expected {plan.num_kv_heads} kv heads of {dim_name} {planned} as planned "
                             f"(layout {self._kv_layout}), got {heads} of {dim} (shape {tuple(t.shape)}){hint}")


def plan_spec(op: str, backend: str, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo,
              custom_mask=None, packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
              use_fp16_qk_reduction: bool = False, window_left=-1, logits_soft_cap=None, sm_scale=None,
              q_data_type="float16", kv_data_type=None, o_data_type=None, use_tensor_cores=None, strict=None,
              batch_invariant: bool = False):
    """The checks every batch plan() shares; returns (spec, scalars, q dtype).
    The LSE variant writes LSE only when run() passes a buffer, so one plan serves both.
    A custom mask selects the _mask configuration; its tensor is checked at
    packing (BatchAttention._plan_mask), once the kv lengths are known."""
    _checks.check_unsupported(pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction)
    mask = _masks.given(custom_mask, packed_custom_mask)
    _masks.check_causal(mask, causal)
    _checks.check_heads(num_qo_heads, num_kv_heads)
    _checks.check_head_dim("head_dim_qk" if op != "batch_decode_paged" else "head_dim", head_dim_qk)
    head_dim_vo = check_plan_head_dim_vo(op, head_dim_qk, head_dim_vo)
    q_dtype = dtype_arg("q_data_type", q_data_type)
    kv_dtype = q_dtype if kv_data_type is None else dtype_arg("kv_data_type", kv_data_type, kv=True)
    if kv_dtype != q_dtype and not _scales.is_fp8(kv_dtype):
        raise ValueError(f"kv_data_type: expected {q_dtype} (as q_data_type) or an FP8 format (float8_e4m3fn, "
                         f"float8_e5m2), got {kv_data_type}")
    if _scales.is_fp8(kv_dtype) and q_dtype == torch.float32:
        raise ValueError(f"q_data_type: expected float16 or bfloat16 with an FP8 KV cache (kv_data_type={kv_dtype}), "
                         f"got {q_dtype}; FP8 caches are not read by the float32 kernels")
    if o_data_type is not None and dtype_arg("o_data_type", o_data_type) != q_dtype:
        raise ValueError(f"o_data_type: expected {q_dtype} (as q_data_type), got {o_data_type}")
    sm_scale, window_left, cap, has_window, has_cap = _checks.variant_values(sm_scale, head_dim_qk, window_left,
                                                                             logits_soft_cap)
    spec = select_spec(op, q_dtype, head_dim_qk, backend=backend, use_tensor_cores=use_tensor_cores, causal=causal,
                       window=has_window, soft_cap=has_cap, return_lse=True, strict=strict,
                       head_dim_vo=head_dim_vo, batch_invariant=batch_invariant, dtype_kv=kv_dtype,
                       custom_mask=mask.name if mask is not None else None)
    return spec, (sm_scale, window_left, cap), q_dtype


def check_plan_head_dim_vo(op: str, head_dim_qk: int, head_dim_vo) -> int:
    """plan()'s head_dim_vo (None: head_dim_qk): head_dim_qk, or for the ragged
    op the V width of a spec.QK_VO_HEAD_DIMS pair (the spec names the pairs)."""
    if head_dim_vo is None or head_dim_vo == head_dim_qk:
        return head_dim_qk
    if op not in QK_VO_OPS:
        raise ValueError(f"head_dim_vo: expected {head_dim_qk} (as head_dim_qk) for {op}, got {head_dim_vo}; a V "
                         f"narrower than Q and K (head_dim_qk/head_dim_vo {qk_vo_pairs()}) is taken by "
                         f"BatchPrefillWithRaggedKVCacheWrapper and single_prefill_with_kv_cache")
    _checks.check_head_dim("head_dim_vo", head_dim_vo)
    if head_dim_vo > head_dim_qk:
        raise ValueError(f"head_dim_vo: {head_dim_vo} above head_dim_qk {head_dim_qk} is not generated; expected "
                         f"{head_dim_qk} (as head_dim_qk), or the V width of a pair ({qk_vo_pairs()})")
    if (head_dim_qk, head_dim_vo) not in QK_VO_HEAD_DIMS:
        raise ValueError(f"head_dim_vo: expected {head_dim_qk} (as head_dim_qk), or the V width of a generated "
                         f"head_dim_qk/head_dim_vo pair ({qk_vo_pairs()}), got {head_dim_vo} with head_dim_qk "
                         f"{head_dim_qk}")
    return head_dim_vo
