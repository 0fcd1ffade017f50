"""Attention over a paged KV cache with FlashInfer 0.7's names and semantics:
BatchPrefillWithPagedKVCacheWrapper and BatchDecodeWithPagedKVCacheWrapper.

Request i owns pages paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]]
in that order; all but the last are full, the last holds paged_kv_last_page_len[i]
keys. plan() checks the page table (indptr monotone, last page lengths within
1..page_size, page ids non-negative) and remembers its largest page id, which
run() compares with the cache it is given: a bad table is a ValueError, never
an out-of-bounds read.
"""

from __future__ import annotations

import torch

from . import _checks, _dispatch, _invariant, _scales, _sinks
from ._aliases import DecodeAliases, PagedPrefillAliases, remembers_plan
from ._dispatch import dispatch_modes, is_compiling
from ._batch import BatchAttention
from ._calls import fill_slot, keep_run, tensor_signature
from .prefill import plan_spec


class _PagedAttention(BatchAttention):
    def _plan_paged(self, qo: list[int], paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size: int,
                    spec, scalars, q_dtype, num_qo_heads, num_kv_heads, head_dim, fixed_split_size,
                    disable_split_kv: bool, non_blocking: bool,
                    names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
                    batch_invariant: bool = False, masks: tuple = (None, None)) -> None:
        """masks: plan()'s (custom_mask, packed_custom_mask), checked against each
        request's qo_len x kv_len, kv_len = (pages - 1) * page_size + last page length."""
        kv = _checks.check_indptr(names[0], paged_kv_indptr, batch_size=len(qo) - 1)
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
        pages = [kv[i + 1] - kv[i] for i in range(len(kv) - 1)]
        indices = _checks.int_tensor(names[1], paged_kv_indices, kv[-1])
        last_tensor = _checks.int_tensor(names[2], paged_kv_last_page_len)
        if last_tensor.shape[0] != len(pages):
            raise ValueError(f"{names[2]}: expected {len(pages)} elements (batch_size), got {last_tensor.shape[0]}")
        last = last_tensor.tolist()
        _checks.last_page_lens(names[2], last, pages, page_size)
        max_page = _checks.page_ids(names[1], indices, kv[-1], self._device)
        self._indices_name = names[1]
        kv_lens = [(n - 1) * page_size + l if n > 0 else 0 for n, l in zip(pages, last)]
        mask = self._plan_mask(*masks, qo, kv_lens, f"kv lengths from {names[0]}, {names[2]} and page_size")
        # Split-KV chunk sizes come in pages, as FlashInfer's fixed_split_size does.
        fixed = fixed_split_size * page_size if fixed_split_size is not None and fixed_split_size > 0 else None
        self._plan_batch(spec, qo, kv, kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, q_dtype=q_dtype, scalars=scalars, page_size=page_size,
                         last_page_len=last, page_indices=indices, max_page=max_page, fixed_chunk=fixed,
                         allow_split=not disable_split_kv, non_blocking=non_blocking, batch_invariant=batch_invariant,
                         mask=mask)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None, window_left=None, sinks: torch.Tensor | None = None,
            **kwargs):
        """k_scale / v_scale (an FP8 cache's dequantisation scales): Python floats or
        one-element float32 tensors, which the kernel reads (ops._scales).
        sinks (FlashInfer's name and place): attention sinks, a contiguous
        float32 tensor [num_qo_heads] on q's device, natural-log units
        (ops._sinks): each row's softmax runs over its logits and sinks[h]; the
        sink's probability is left out of out, and the LSE includes it (a row
        with no visible key: out = 0, lse = sinks[h] * log2(e)); -inf is no
        sink. Its values are checked (NaN, +inf refused) at the first run() with
        that tensor, not after later in-place writes, which the kernel reads (a
        CUDA graph replays with the values then)."""
        if args or kwargs or q_scale is not None:
            _checks.check_no_extra_args("run()", args)
            _checks.check_unsupported(q_scale=q_scale)
            raise NotImplementedError(f"{sorted(kwargs)}: not supported by flashjit's {type(self).__name__}.run()")
        if is_compiling() or dispatch_modes():  # _dispatch.tracing()
            k, v = _dispatch.cache_args(paged_kv_cache)
            return _dispatch.run_batch(self, q, k, v, out, lse, return_lse, window_left, k_scale, v_scale, sinks)
        if k_scale is not None or v_scale is not None or sinks is not None:
            scales = (_scales.scale_key(k_scale), _scales.scale_key(v_scale))
            return self._run(q, paged_kv_cache, None, out, lse, return_lse, window_left, scales, sinks)
        if lse is None and window_left is None:  # the last run, if these are its signature (ops._calls.Signatures)
            if out is None:
                known, check, call = self._launches.fast
                if known == return_lse and check(q, paged_kv_cache):
                    return call(q, paged_kv_cache, paged_kv_cache, None, None)
            else:
                known, check, call = self._launches.fast_out
                if known == return_lse and check(q, paged_kv_cache, out):
                    return call(q, paged_kv_cache, paged_kv_cache, out, None)
        return self._run(q, paged_kv_cache, None, out, lse, return_lse, window_left)

    def _run(self, q, k, v, out, lse, return_lse: bool, window_left, scales=(None, None), sinks=None):
        """run()'s eager body: the cache is k alone (a 5-D tensor or a (K, V) tuple) or (k, v);
        scales: (k_scale, v_scale) as ops._scales.scale_key gave them; sinks: the
        tensor as given (its key joins the signature; the fast slots hold only
        runs with neither scales nor sinks)."""
        paged_kv_cache = k if v is None else (k, v)
        plain = window_left is None and scales == (None, None) and sinks is None
        try:
            if isinstance(paged_kv_cache, torch.Tensor):
                k_src = v_src = paged_kv_cache
                cache_key = (paged_kv_cache.shape, paged_kv_cache.stride(), paged_kv_cache.dtype, paged_kv_cache.device)
            else:
                k_src, v_src = paged_kv_cache
                cache_key = (tensor_signature(k_src), tensor_signature(v_src))
            key = (q.shape, q.stride(), q.dtype, q.device, cache_key, return_lse, window_left,
                   out if out is None else tensor_signature(out), lse if lse is None else tensor_signature(lse), scales,
                   _sinks.key(sinks))
            launches = self._launches
            last_key, launch = launches.last
            if key != last_key:
                launch = launches.get(key)
                if launch is not None:
                    launches.last = (key, launch)
        except (AttributeError, TypeError, ValueError):  # the checks below say what is wrong
            key = launch = None
        if launch is not None:
            if lse is None and plain:
                fill_slot(launches, return_lse, out, launch)
            return launch(q, k_src, v_src, out, lse)
        plan = self._plan
        if plan is None:
            raise RuntimeError("run() called before plan()")
        given_out, given_lse = out, lse
        self._check_window(window_left, plan)
        k, v, v_offset, num_pages, page_size, heads, dim, k_strides, v_strides = _checks.paged_kv_sources(
            paged_kv_cache, self._kv_layout)
        self._check_q(q, plan)
        self._check_cache(paged_kv_cache, k, page_size, heads, dim, plan)
        self._check_q_rows(q, plan)
        if plan.max_page >= num_pages:
            raise ValueError(f"{self._indices_name}: page id {plan.max_page} is past the cache's {num_pages} pages "
                             f"(paged_kv_cache: expected at least {plan.max_page + 1} pages, as planned, got "
                             f"{_shape_text(paged_kv_cache)})")
        checked = _scales.checked(k.dtype, scales, q.device)
        sinks_address = _sinks.checked_address(sinks, plan.num_qo_heads, q.device)
        out, lse = self._outputs(q, plan, out, lse, return_lse)
        launch = self._launch(q, k, v, k_strides, v_strides, out, lse, v_offset, checked,
                              **({"sinks": sinks_address} if sinks_address else {}))
        # The cache as run() passes it: one tensor, or a pair whose tensors the check takes apart.
        caches = (k,) if k is v else (k, v)
        keep_run(self._launches, key, launch, (q, *caches) if given_out is None else (q, *caches, given_out),
                 return_lse, given_out, given_lse is None and plain, pair=k is not v)
        return (out, lse) if return_lse else out

    @staticmethod
    def _check_window(window_left, plan) -> None:
        if window_left is not None and window_left != plan.scalars[1]:
            raise ValueError(f"window_left: expected {plan.scalars[1]} (as planned) or None, got {window_left}")

    def _check_planned(self, q, k, v, plan, window_left=None) -> None:
        """q and the cache (k alone, or k and v) against the plan, all but the token
        counts and page ids."""
        cache = k if v is None else (k, v)
        self._check_window(window_left, plan)
        k, _, _, page_size, heads, dim, _, _ = _checks.paged_kv_cache(cache, self._kv_layout)
        self._check_q(q, plan)
        self._check_cache(cache, k, page_size, heads, dim, plan)

    def _check_cache(self, cache, k, page_size: int, heads: int, dim: int, plan) -> None:
        """The cache's dtype and page geometry against the plan (paged_kv_sources
        has checked its structure; V has K's shape and dtype)."""
        _scales.check_planned_dtype("paged_kv_cache", k.dtype, getattr(torch, plan.module.spec.dtype_kv))
        if (page_size, heads, dim) != (plan.page_size, plan.num_kv_heads, plan.head_dim):
            fits_other = (heads, page_size, dim) == (plan.page_size, plan.num_kv_heads, plan.head_dim)
            pages = "[page_size, kv heads, head_dim]" if self._kv_layout == "NHD" else "[kv heads, page_size, head_dim]"
            raise ValueError(f"paged_kv_cache: expected page_size {plan.page_size}, {plan.num_kv_heads} kv heads and "
                             f"head_dim {plan.head_dim} as planned (layout {self._kv_layout}: pages of {pages}), got "
                             f"{page_size}, {heads} and {dim} ({_shape_text(cache)})"
                             f"{_checks.other_layout_hint(self._kv_layout, fits_other)}")


def _shape_text(cache) -> str:
    """The shape of a cache that paged_kv_sources has accepted: one 5-D tensor or a (K, V) tuple."""
    if isinstance(cache, torch.Tensor):
        return f"shape {tuple(cache.shape)}"
    return f"shape {tuple(cache[0].shape)} for K"


class BatchPrefillWithPagedKVCacheWrapper(PagedPrefillAliases, _PagedAttention):
    """Prefill (or append / chunked prefill) of a ragged batch of queries,
    q [qo_indptr[-1], heads, dim], against a paged KV cache."""

    _op = "batch_prefill_paged"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args=None, *, strict: bool | None = None):
        """custom_mask_buf: with use_cuda_graph=True, where plan() writes a custom
        mask's packed bits (its address is captured; sized for the largest mask).
        mask_indptr_buf: accepted, not written: the byte offsets live in the
        wrapper's metadata array, which stays in place under CUDA graphs."""
        if jit_args is not None:
            raise NotImplementedError("jit_args: custom JIT modules are not supported; flashjit generates its own")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, paged_kv_indices_buf, strict,
                         mask_buffers=(custom_mask_buf, mask_indptr_buf))

    @remembers_plan
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo: int | None = None, custom_mask=None,
             packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale=None, window_left: int = -1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, *, fixed_split_size: int | None = None, disable_split_kv: bool = False,
             use_tensor_cores: bool | None = None, batch_invariant: bool | None = None) -> None:
        """fixed_split_size: pages per split-KV chunk; disable_split_kv: none.
        batch_invariant=True: each request's output does not depend on the rest
        of the batch, the page size or the op (docs/numerics.md); None:
        FLASHJIT_BATCH_INVARIANT.
        custom_mask / packed_custom_mask: as the ragged wrapper's plan() takes
        them, request i's kv_len being (pages_i - 1) * page_size +
        paged_kv_last_page_len[i] (docs/masks.md)."""
        invariant = _invariant.resolve(batch_invariant)
        qo = _checks.check_indptr("qo_indptr", qo_indptr)
        spec, scalars, q_dtype = plan_spec(
            "batch_prefill_paged", self._backend, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, custom_mask,
            packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
            sm_scale, q_data_type, kv_data_type, o_data_type, use_tensor_cores, strict=self._strict,
            batch_invariant=invariant)
        self._plan_paged(qo, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, spec, scalars,
                         q_dtype, num_qo_heads, num_kv_heads, head_dim_qk, fixed_split_size, disable_split_kv,
                         non_blocking, batch_invariant=invariant, masks=(custom_mask, packed_custom_mask))


class BatchDecodeWithPagedKVCacheWrapper(DecodeAliases, _PagedAttention):
    """One query token per request, q [batch_size, heads, dim], against a paged
    KV cache. use_tensor_cores=False keeps fp32 softmax and P.V on CUDA cores;
    True packs the query heads of each KV head as the rows of the MMA."""

    _op = "batch_decode_paged"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None, *,
                 strict: bool | None = None):
        if jit_args is not None:
            raise NotImplementedError("jit_args: custom JIT modules are not supported; flashjit generates its own")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, paged_kv_indices_buffer, strict)
        self._use_tensor_cores = bool(use_tensor_cores)
        self._qo_rows = "batch_size: one query token per request of indptr"

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @remembers_plan
    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking: bool = True, block_tables=None, seq_lens=None,
             fixed_split_size: int | None = None, disable_split_kv: bool = False, *,
             batch_invariant: bool | None = None) -> None:
        """fixed_split_size: pages per split-KV chunk; disable_split_kv: none.
        batch_invariant=True: each output row is the one prefill of the same
        tokens gives, whatever the batch (docs/numerics.md): the prefill kernel
        runs, on tensor cores for fp16/bf16 whatever use_tensor_cores says;
        None: FLASHJIT_BATCH_INVARIANT."""
        invariant = _invariant.resolve(batch_invariant)
        if block_tables is not None or seq_lens is not None:
            raise NotImplementedError("block_tables / seq_lens: pass indptr, indices and last_page_len instead")
        if data_type is not None:
            kv_data_type = kv_data_type if kv_data_type is not None else data_type
            q_data_type = data_type if q_data_type == "float16" else q_data_type
        batch = len(_checks.check_indptr("indptr", indptr)) - 1
        spec, scalars, q_dtype = plan_spec("batch_decode_paged", self._backend, num_qo_heads, num_kv_heads,
                                           head_dim, None, pos_encoding_mode=pos_encoding_mode, causal=False,
                                           window_left=window_left, logits_soft_cap=logits_soft_cap,
                                           sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
                                           o_data_type=o_data_type, use_tensor_cores=self._use_tensor_cores,
                                           strict=self._strict, batch_invariant=invariant)
        self._plan_paged(list(range(batch + 1)), indptr, indices, last_page_len, page_size, spec, scalars, q_dtype,
                         num_qo_heads, num_kv_heads, head_dim, fixed_split_size, disable_split_kv, non_blocking,
                         names=("indptr", "indices", "last_page_len"), batch_invariant=invariant)
