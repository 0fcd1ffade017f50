"""MLA (DeepSeek multi-head latent attention) over a paged cache, with
FlashInfer's names and semantics: BatchMLAPagedAttentionWrapper.

Every token keeps ckv (512 wide: the keys' latent part and the values) and kpe
(64 wide: the keys' rotary part), shared by all query heads:
logits = sm_scale * (q_nope . ckv + q_pe . kpe), out = softmax(logits) . ckv.
The kernel sees MQA with one KV head: the planner's packed rows are (query
token x head), num_heads of them per token (fa2/fa2_mla.cuh).

An FP8 cache (kv_data_type float8_e4m3fn / float8_e5m2, q and out fp16 or
bf16) holds codes with per-tensor scales, FlashInfer 0.7's run(ckv_scale=,
kpe_scale=): a ckv value is code x ckv_scale, a kpe value code x kpe_scale
(docs/mla.md, "FP8 caches"). The params carry them as k_scale / v_scale (k is
the ckv cache, v the kpe cache).
"""

from __future__ import annotations

import ctypes
import struct

import torch

from ..loader import AttentionParams
from ..spec import MLA_HEAD_DIM_CKV, MLA_HEAD_DIM_KPE, TENSOR_CORE_DTYPES, canonical_dtype
from . import _checks, _dispatch, _scales
from ._dispatch import dispatch_modes, is_compiling
from ._batch import BatchAttention, dtype_arg
from ._calls import fill_slot, keep_run, mla_call, tensor_signature
from ._launch import PER_CALL, check_kv_strides, fill_params, select_spec

# q_pe is the struct's last field (attention_params.cuh): the host appends it per call.
_Q_PE = struct.Struct("=Q")
assert AttentionParams.q_pe.offset + _Q_PE.size == ctypes.sizeof(AttentionParams)
# FlashInfer's names of an FP8 cache's scales, as _scales names them in errors.
SCALE_NAMES = _scales.MLA_SCALE_NAMES
_FLOAT32_MIN_NORMAL, _FLOAT32_MAX = 2.0**-126, 3.4028234663852886e38


class BatchMLAPagedAttentionWrapper(BatchAttention):
    """q_nope [tokens, heads, 512], q_pe [tokens, heads, 64] against ckv_cache
    [pages, page_size, 512] and kpe_cache [pages, page_size, 64]; out [tokens,
    heads, 512], LSE base 2. Request i's keys are kv_len_arr[i] tokens in pages
    kv_indices[kv_indptr[i]:kv_indptr[i + 1]] (in that order, any page ids)."""

    _op = "mla_paged"

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend: str = "auto", *,
                 strict: bool | None = None):
        # kv_indices: with use_cuda_graph, the page-id buffer the captured launch reads.
        super().__init__(float_workspace_buffer, "NHD", use_cuda_graph, backend, kv_indices, strict)
        self._indices_name = "kv_indices"

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads: int, head_dim_ckv: int,
             head_dim_kpe: int, page_size: int, causal: bool, sm_scale: float, q_data_type, kv_data_type,
             use_profiler: bool = False, *, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             non_blocking: bool = True) -> None:
        """fixed_split_size: pages per split-KV chunk; disable_split_kv: none."""
        if use_profiler:
            raise NotImplementedError("use_profiler=True: flashjit's MLA kernel has no profiler build")
        if (head_dim_ckv, head_dim_kpe) != (MLA_HEAD_DIM_CKV, MLA_HEAD_DIM_KPE):
            raise ValueError(f"head_dim_ckv / head_dim_kpe: expected {MLA_HEAD_DIM_CKV} / {MLA_HEAD_DIM_KPE} "
                             f"(DeepSeek-V2/V3 MLA, the geometry flashjit generates), got {head_dim_ckv} / "
                             f"{head_dim_kpe}")
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
        q_dtype = dtype_arg("q_data_type", q_data_type)
        kv_dtype = dtype_arg("kv_data_type", kv_data_type, kv=True)
        if kv_dtype != q_dtype and not _scales.is_fp8(kv_dtype):
            raise ValueError(f"kv_data_type: expected {q_dtype} (as q_data_type) or an FP8 format (float8_e4m3fn, "
                             f"float8_e5m2), got {kv_data_type}")
        if canonical_dtype(q_dtype) not in TENSOR_CORE_DTYPES:
            fp8 = f" with an FP8 cache (kv_data_type={kv_dtype})" if kv_dtype != q_dtype else ""
            raise ValueError(f"q_data_type: MLA runs on tensor cores in float16 or bfloat16{fp8}, got {q_dtype}; "
                             f"cast q_nope and q_pe{'' if fp8 else ' and the caches'} to bfloat16")
        sm_scale = float(sm_scale)
        if not (sm_scale > 0 and sm_scale < float("inf")):
            raise ValueError(f"sm_scale: expected a finite positive number, got {sm_scale}")
        qo = _checks.check_indptr("qo_indptr", qo_indptr)
        batch = len(qo) - 1
        kv = _checks.check_indptr("kv_indptr", kv_indptr, batch_size=batch)
        lens_tensor = _checks.int_tensor("kv_len_arr", kv_len_arr, batch, exact=True, what=" (batch_size)")
        kv_lens = [int(x) for x in lens_tensor.tolist()]
        pages = [kv[i + 1] - kv[i] for i in range(batch)]
        # Exactly ceil(kv_len / page_size) pages each: FlashInfer 0.7.2 refuses extra
        # trailing pages too ("page counts in kv_indptr must equal ceil(kv_len_arr /
        # page_size)"), so code written for one runs on the other.
        for i, (n, length) in enumerate(zip(pages, kv_lens)):
            if length < 0 or -(-length // page_size) != n:
                raise ValueError(f"kv_len_arr: request {i} has {n} pages of {page_size} (kv_indptr), which hold "
                                 f"{(n - 1) * page_size + 1}..{n * page_size} keys, got {length}"
                                 if n else f"kv_len_arr: request {i} has no pages (kv_indptr), got {length} keys")
        indices = _checks.int_tensor("kv_indices", kv_indices, kv[-1], what=" (kv_indptr[-1])")
        max_page = _checks.page_ids("kv_indices", indices, kv[-1], self._device)
        spec = select_spec("mla_paged", q_dtype, MLA_HEAD_DIM_CKV + MLA_HEAD_DIM_KPE, backend=self._backend,
                           use_tensor_cores=None, causal=bool(causal), window=False, soft_cap=False,
                           return_lse=True, strict=self._strict, head_dim_vo=MLA_HEAD_DIM_CKV,
                           dtype_kv=kv_dtype if kv_dtype != q_dtype else None)
        last = [length - (n - 1) * page_size if n else 0 for n, length in zip(pages, kv_lens)]
        fixed = fixed_split_size * page_size if fixed_split_size is not None and fixed_split_size > 0 else None
        self._plan_batch(spec, qo, kv, kv_lens, num_qo_heads=num_heads, num_kv_heads=1, head_dim=MLA_HEAD_DIM_CKV,
                         q_dtype=q_dtype, scalars=(sm_scale, -1, 0.0), page_size=page_size, last_page_len=last,
                         page_indices=indices, max_page=max_page, fixed_chunk=fixed,
                         allow_split=not disable_split_kv, non_blocking=non_blocking)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse: bool = False,
            profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e: bool = False, *,
            ckv_scale=None, ckv_scale_arr=None, kpe_scale=None):
        """ckv_scale / kpe_scale (an FP8 cache's, FlashInfer's names; default 1):
        a ckv value is code x ckv_scale, a kpe value code x kpe_scale. Python
        floats (checked: finite, positive, a ratio within float32's range), or
        one-element float32 tensors on q's device, which the kernel reads (a
        CUDA graph replays with the values they hold then; ops._scales; under
        torch.compile a graph input, so a new value needs no recompile)."""
        if profiler_buffer is not None or kv_len is not None or page_table is not None:
            raise NotImplementedError("profiler_buffer / kv_len / page_table: flashjit's MLA run() reads the "
                                      "batch from plan() only")
        if return_lse_base_on_e:
            raise NotImplementedError("return_lse_base_on_e=True: flashjit returns base-2 LSE, as its other ops")
        if ckv_scale_arr is not None:
            raise NotImplementedError("ckv_scale_arr: per-token scales of each 128 ckv columns are not supported; "
                                      "flashjit takes per-tensor scales (ckv_scale=, kpe_scale=)")
        if is_compiling() or dispatch_modes():  # _dispatch.tracing()
            return _dispatch.run_mla(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, ckv_scale,
                                     kpe_scale)
        if ckv_scale is not None or kpe_scale is not None:
            scales = (_scales.scale_key(ckv_scale), _scales.scale_key(kpe_scale))
            return self._run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, scales)
        if lse is None:  # the last run, if these tensors are its signature (ops._calls.Signatures)
            if out is None:
                known, check, call = self._launches.fast
                if known == return_lse and check(q_nope, q_pe, ckv_cache, kpe_cache):
                    return call(q_nope, q_pe, ckv_cache, kpe_cache, None, None)
            else:
                known, check, call = self._launches.fast_out
                if known == return_lse and check(q_nope, q_pe, ckv_cache, kpe_cache, out):
                    return call(q_nope, q_pe, ckv_cache, kpe_cache, out, None)
        return self._run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse)

    def _run(self, q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse: bool, scales=(None, None)):
        """run()'s eager body, which the torch.ops.flashjit.mla_paged_run* operators call too.
        scales: (ckv_scale, kpe_scale) as ops._scales.scale_key gave them (the
        fast slots hold only runs without them)."""
        plain = scales == (None, None)
        try:  # the argument signature of a prepared run() (see ops._batch)
            key = (q_nope.shape, q_nope.stride(), q_nope.dtype, q_nope.device, tensor_signature(q_pe),
                   tensor_signature(ckv_cache), tensor_signature(kpe_cache), return_lse,
                   out if out is None else tensor_signature(out), lse if lse is None else tensor_signature(lse),
                   scales)
            launches = self._launches
            last_key, launch = launches.last
            if key != last_key:
                launch = launches.get(key)
                if launch is not None:
                    launches.last = (key, launch)
        except (AttributeError, TypeError):  # something is no tensor: the checks say which
            key = launch = None
        if launch is not None:
            if lse is None and plain:
                fill_slot(launches, return_lse, out, launch)
            return launch(q_nope, q_pe, ckv_cache, kpe_cache, out, lse)
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() called before plan()")
        given = (q_nope, q_pe, ckv_cache, kpe_cache) if out is None else (q_nope, q_pe, ckv_cache, kpe_cache, out)
        given_out, given_lse = out, lse
        self._check_mla(q_nope, q_pe, ckv_cache, kpe_cache, plan)
        rows = q_nope.shape[0]
        if not (rows == plan.qo_tokens or plan.qo_tokens <= rows <= plan.graph_tokens):
            cap = f" to {plan.graph_tokens} (use_cuda_graph=True)" if plan.graph_tokens > plan.qo_tokens else ""
            raise ValueError(f"q_nope: expected {plan.qo_tokens}{cap} rows (qo_indptr[-1] as planned), got {rows} "
                             f"(shape {tuple(q_nope.shape)})")
        num_pages = ckv_cache.shape[0]
        if plan.max_page >= num_pages:
            raise ValueError(f"kv_indices: page id {plan.max_page} is past the caches' {num_pages} pages "
                             f"(ckv_cache / kpe_cache: expected at least {plan.max_page + 1} pages, as planned, got "
                             f"shape {tuple(ckv_cache.shape)})")
        checked = check_scales(ckv_cache.dtype, scales, q_nope.device)
        out, lse = self._outputs(q_nope, plan, out, lse, return_lse)
        launch = self._launch_mla(q_nope, q_pe, ckv_cache, kpe_cache, out, lse,
                                  **({} if plain else {"scales": checked}))
        keep_run(self._launches, key, launch, given, return_lse, given_out, given_lse is None and plain)
        return (out, lse) if return_lse else out

    def _check_mla(self, q_nope, q_pe, ckv_cache, kpe_cache, plan) -> None:
        """The inputs against the plan, all but q_nope's row count and the page ids
        (what the operator's fake kernel checks too: no token counts, no device data)."""
        _checks.check_tensor("q_nope", q_nope, 3)
        if tuple(q_nope.shape[1:]) != (plan.num_qo_heads, MLA_HEAD_DIM_CKV) or q_nope.dtype != plan.q_dtype:
            raise ValueError(f"q_nope: expected a {plan.q_dtype} tensor of shape [tokens, {plan.num_qo_heads}, "
                             f"{MLA_HEAD_DIM_CKV}] (num_heads and q_data_type as planned, head_dim_ckv), got "
                             f"{q_nope.dtype} {tuple(q_nope.shape)}")
        _checks.check_tensor("q_pe", q_pe, 3)
        if tuple(q_pe.shape) != (q_nope.shape[0], plan.num_qo_heads, MLA_HEAD_DIM_KPE) or q_pe.dtype != plan.q_dtype:
            raise ValueError(f"q_pe: expected a {plan.q_dtype} tensor of shape ({q_nope.shape[0]}, "
                             f"{plan.num_qo_heads}, {MLA_HEAD_DIM_KPE}) (q_nope's tokens and heads, head_dim_kpe), "
                             f"got {q_pe.dtype} {tuple(q_pe.shape)}")
        kv_dtype = getattr(torch, plan.module.spec.dtype_kv)
        for name, cache, dim in (("ckv_cache", ckv_cache, MLA_HEAD_DIM_CKV), ("kpe_cache", kpe_cache, MLA_HEAD_DIM_KPE)):
            _checks.check_tensor(name, cache, 3, kv=True)
            if cache.shape[1:] != (plan.page_size, dim) or cache.dtype != kv_dtype:
                hint = f"; plan with kv_data_type={cache.dtype} for it" \
                    if cache.dtype != kv_dtype and (_scales.is_fp8(cache.dtype) or _scales.is_fp8(kv_dtype)) else ""
                raise ValueError(f"{name}: expected a {kv_dtype} tensor of shape [num_pages, {plan.page_size}, "
                                 f"{dim}] (page_size, head_dim and kv_data_type as planned), got {cache.dtype} "
                                 f"{tuple(cache.shape)}{hint}")
        if kpe_cache.shape[0] != ckv_cache.shape[0]:
            raise ValueError(f"kpe_cache: expected {ckv_cache.shape[0]} pages (as ckv_cache), got "
                             f"{kpe_cache.shape[0]}")

    def _launch_mla(self, q_nope, q_pe, ckv, kpe, out, lse, scales: tuple = (_scales.UNIT, _scales.UNIT)):
        """The first run() of a signature, after its checks against the plan; returns
        the prepared call that repeats it (ops._calls.mla_call). scales: the
        checked (ckv_scale, kpe_scale) (check_scales), as params k_scale / v_scale."""
        plan = self._plan
        self._check_placement(q_nope, q_pe, ckv, kpe, out)
        k_strides, v_strides = (ckv.stride(1), 0, ckv.stride(0)), (kpe.stride(1), 0, kpe.stride(0))
        for name, strides in (("ckv_cache", k_strides), ("kpe_cache", v_strides)):
            check_kv_strides(name, strides, plan.page_size, ckv.element_size())
        params = fill_params(q_nope, 1, k_strides, v_strides, plan.page_size,
                             (plan.num_qo_heads * MLA_HEAD_DIM_CKV, MLA_HEAD_DIM_CKV), plan.num_qo_heads,
                             *plan.scalars, kv_element_size=ckv.element_size(), scales=scales)
        params.q_pe_stride_n, params.q_pe_stride_h = q_pe.stride(0), q_pe.stride(1)
        params.invariant_chunk = -plan.invariant_chunk  # MLA kernels never fold: the merge pass does
        head = PER_CALL.pack(0, 0, 0, 0, 0, *plan.pointers, *plan.partials, plan.num_work, plan.merge_tokens, 0, 1, 0,
                             plan.work.band_items)
        launch = mla_call(plan.module, head + bytes(params)[PER_CALL.size:], self._device.index, q_nope,
                          plan.num_qo_heads, lse is not None, self._check_placement)
        launch(q_nope, q_pe, ckv, kpe, out, lse)
        return launch

    def _check_placement(self, q_nope, q_pe, ckv, kpe, out) -> None:
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv), ("kpe_cache", kpe)):
            _checks.check_device(name, t, self._device)
            _checks.check_vector_aligned(name, t)
        _checks.check_vector_aligned("out", out)

    forward = run


def check_scales(kv_dtype, scales: tuple, device) -> tuple:
    """(ckv_scale, kpe_scale) as scale_key gave them, checked for a launch on
    `device` against a cache of kv_dtype (ops._scales.checked, under FlashInfer's
    names): two ScaleArg. The kernels multiply S's ckv part by ckv_scale /
    kpe_scale (fa2/fa2_mla_fp8.cuh), so two numbers must also have a ratio in
    float32's normal range; a tensor's values are the caller's to keep so."""
    checked = _scales.checked(kv_dtype, scales, device, SCALE_NAMES)
    ckv, kpe = checked
    if not ckv.address and not kpe.address:
        check_scale_ratio(ckv.value, kpe.value)
    return checked


def check_scale_ratio(ckv_scale: float, kpe_scale: float) -> None:
    """Two numbers, each checked (ops._scales.scale_arg): their ratio in float32's normal range."""
    ratio = ckv_scale / kpe_scale
    if not _FLOAT32_MIN_NORMAL <= ratio <= _FLOAT32_MAX:
        raise ValueError(f"ckv_scale: expected ckv_scale / kpe_scale within float32's normal range (the kernel "
                         f"scales S's ckv part by it), got {ckv_scale} / {kpe_scale} = {ratio}")
