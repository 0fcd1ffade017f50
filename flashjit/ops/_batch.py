"""What every batch wrapper shares: plan() turns a batch description into a
work plan (ops._plan) and one device array of int32 metadata; run() packs one
params struct and launches, allocating nothing but the output when none is given.
The first run() of an argument signature (every tensor's shape, strides, dtype
and device, out / lse, the options) checks it against the plan and leaves a
prepared call (ops._calls.batch_call) in `_launches`, which the next run()
with that signature calls directly; plan() empties it.

CUDA graphs (use_cuda_graph=True): a captured launch keeps its params struct,
so every pointer and count in it must stay valid across plans. The wrapper
then sizes its metadata array, the grid and the merge pass once, at the first
plan(), for that batch size (and that many query tokens), and later plans
rewrite the same device memory in place: empty work slots carry request -1,
tokens past the batch have no partial rows. Page ids go to the
paged_kv_indices buffer given at construction, a custom mask's bits to the
custom_mask_buf given there; its byte offsets are a section of the metadata
array (ops._masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import jit
from ..loader import KernelModule
from . import _checks, _dispatch, _invariant, _masks, _scales
from ._calls import PER_CALL, Signatures, batch_call, check_placement, resident_ctas
from ._launch import fill_params
from ._plan import WorkPlan, ceil_div, plan_work, walk_section
from ._walk import walks_positions


@dataclass(frozen=True)
class BatchPlan:
    module: KernelModule
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_vo: int                # V's, O's and the partial states' width: head_dim, or spec.QK_VO_HEAD_DIMS'
    q_dtype: torch.dtype
    qo_tokens: int
    page_size: int                  # 0: ragged K/V
    max_page: int                   # largest page id the plan reads (-1: none)
    kv_tokens: int                  # ragged: keys the plan reads
    scalars: tuple                  # sm_scale, window_left, soft_cap
    pointers: tuple                 # qo/kv indptr, page ids, last page lens, work, merge indptr
    partials: tuple                 # partial_o, partial_lse addresses (0, 0 when nothing is split)
    num_work: int
    merge_tokens: int
    work: WorkPlan
    # use_cuda_graph: the query tokens the first plan() sized the captured
    # buffers for (q may hold up to that many rows, k/v more than the plan
    # reads); 0 otherwise, where q and k/v hold exactly what the plan reads.
    graph_tokens: int = 0
    invariant_chunk: int = 0        # batch-invariant mode's chunk of keys (params.invariant_chunk), 0: normal mode
    # A custom mask's packed bits, byte offsets and full-key counts per request (0: none).
    mask: tuple = (0, 0, 0)
    walk: int = 0                   # a persistent grid's positions per CTA (ops._plan.walk_section), 0: its rounds


_EMPTY_ITEM = (-1, 0, -1, 0)


class BatchAttention:
    """Base of the batch wrappers: subclasses check their arguments, then call
    _plan_batch() from plan() and _launch() from run()."""

    def __init__(self, float_workspace_buffer, kv_layout: str, use_cuda_graph: bool, backend: str,
                 page_indices_buffer=None, strict: bool | None = None, mask_buffers: tuple = (None, None)):
        """mask_buffers: the prefill wrappers' custom_mask_buf and mask_indptr_buf (checked, see _plan_mask)."""
        _checks.check_layout(kv_layout)
        if not isinstance(float_workspace_buffer, torch.Tensor) or float_workspace_buffer.device.type != "cuda" \
                or not float_workspace_buffer.is_contiguous():
            got = f"{type(float_workspace_buffer).__name__}" if not isinstance(float_workspace_buffer, torch.Tensor) \
                else f"a tensor on {float_workspace_buffer.device}, contiguous={float_workspace_buffer.is_contiguous()}"
            raise ValueError(f"float_workspace_buffer: expected a CUDA tensor (contiguous), got {got}")
        if float_workspace_buffer.data_ptr() % 16:
            raise ValueError("float_workspace_buffer: expected a 16-byte aligned tensor")
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._backend = backend
        self._strict = strict  # see select_spec
        self._use_cuda_graph = bool(use_cuda_graph)
        if page_indices_buffer is not None:
            _checks.int_tensor("paged_kv_indices_buffer", page_indices_buffer)
            if page_indices_buffer.device != self._device:
                raise ValueError(f"paged_kv_indices_buffer: expected a tensor on {self._device} (the workspace's "
                                 f"device), got {page_indices_buffer.device}")
        self._page_buffer = page_indices_buffer
        for name, buffer in zip(("custom_mask_buf", "mask_indptr_buf"), mask_buffers):
            _masks.check_buffer(name, buffer, self._device)
        self._mask_buffer = mask_buffers[0]
        self._mask_bits: torch.Tensor | None = None  # the current plan's packed mask, on the device
        self._mask_full: torch.Tensor | None = None  # and its full-key counts (_masks.full_keys)
        self._plan: BatchPlan | None = None
        self._ints: torch.Tensor | None = None
        self._pages: torch.Tensor | None = None
        self._capacity: tuple | None = None  # graph mode: (batch, tokens, work items)
        self._launches = Signatures()  # argument signature -> prepared run() (ops._calls), for the current plan
        self._own_partials: torch.Tensor | None = None  # batch-invariant partial state past the workspace
        self._qo_rows = "qo_indptr[-1]"  # what sets q's row count, for error messages
        self._handle = _dispatch.register_wrapper(self)  # how run()'s torch.ops.flashjit operator finds this

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def _plan_batch(self, spec, qo_indptr: list[int], kv_indptr: list[int], kv_lens: list[int], *,
                    num_qo_heads: int, num_kv_heads: int, head_dim: int, q_dtype: torch.dtype, scalars: tuple,
                    head_dim_vo: int | None = None,
                    page_size: int = 0, last_page_len: list[int] | None = None, page_indices=None, max_page: int = -1,
                    fixed_chunk: int | None = None, allow_split: bool = True, non_blocking: bool = True,
                    batch_invariant: bool | None = None, mask: tuple | None = None) -> None:
        """head_dim_vo: V's and O's width (None: head_dim), which sizes the output
        and the fp32 partial states of split requests. mask: _plan_mask's
        (packed bits, byte offsets per request) of a custom mask, None: none.
        batch_invariant: split-KV in fixed chunks of keys from key 0 (ops._invariant),
        never resized for the batch, the GPU or the workspace (None: FLASHJIT_BATCH_INVARIANT)."""
        batch_invariant = _invariant.resolve(batch_invariant)
        dim_vo = head_dim if head_dim_vo is None else head_dim_vo
        group = num_qo_heads // num_kv_heads
        module = jit.get_module(spec)
        if hasattr(module, "for_group"):  # the shape of the kernel this head count runs (fa2 MLA)
            module = module.for_group(group)
        batch = len(qo_indptr) - 1
        qo_lens = [qo_indptr[i + 1] - qo_indptr[i] for i in range(batch)]
        tokens = qo_indptr[-1]
        wave = resident_ctas(module, self._device)
        walks = walks_positions(module.spec)  # a persistent grid that takes a plan's walk
        max_items = None
        chunk = _invariant.chunk_keys(fixed_chunk, allow_split, module.split_align) if batch_invariant else 0
        if self._use_cuda_graph:
            if self._capacity is None:
                slots = ceil_div(wave, num_kv_heads)
                items = ceil_div(tokens * group, module.rows_per_cta) + 2 * batch + slots
                if chunk:
                    # Chunks never grow in this mode: room for every chunk of the keys
                    # the page-id buffer can address (ragged: this plan's keys).
                    keys = self._page_buffer.shape[0] * page_size if page_size and self._page_buffer is not None \
                        else kv_indptr[-1]
                    tiles = 1 if self._op == "batch_decode_paged" else ceil_div(tokens * group, module.rows_per_cta)
                    items += (ceil_div(keys, chunk) + batch) * tiles
                self._capacity = (batch, tokens, items)
            cap_batch, cap_tokens, max_items = self._capacity
            if batch != cap_batch or tokens > cap_tokens:
                raise ValueError(f"qo_indptr: with use_cuda_graph=True the batch is fixed at the first plan() "
                                 f"({cap_batch} requests, at most {cap_tokens} query tokens), got {batch} requests "
                                 f"and {tokens} tokens; create a new wrapper for a larger batch")
        # Partial state: fp32 outputs from the workspace's start, LSEs at a fixed
        # offset behind room for as many rows as fit (fixed across plans, as a
        # captured graph needs). A small workspace means fewer, longer chunks.
        workspace_bytes = self._workspace.numel() * self._workspace.element_size()
        rows_fit = workspace_bytes // (4 * num_qo_heads * (dim_vo + 1))
        if batch_invariant:
            work = _invariant.plan(qo_lens, kv_lens, group=group, rows_per_cta=module.rows_per_cta,
                                   num_kv_heads=num_kv_heads, resident_ctas=wave, chunk=chunk, causal=spec.causal,
                                   max_items=max_items, fold=_invariant.folds(module.spec))
            rows = work.partial_rows
            if work.folds:  # the fold scratch, in partial rows (num_qo_heads x (head_dim_vo + 1) floats)
                rows = ceil_div(_invariant.scratch_floats(wave, module.rows_per_cta, dim_vo),
                                num_qo_heads * (dim_vo + 1))
            base, rows_fit = self._invariant_partials(rows, rows_fit, num_qo_heads, dim_vo)
        else:
            work = plan_work(qo_lens, kv_lens, group=group, rows_per_cta=module.rows_per_cta,
                             num_kv_heads=num_kv_heads, resident_ctas=wave, split_align=module.split_align,
                             causal=spec.causal, fixed_chunk=fixed_chunk, allow_split=allow_split,
                             max_items=max_items, max_partial_rows=rows_fit,
                             key_tile=module.split_align if walks else 1)
            base = self._workspace.data_ptr()
        partials = (base, base + 4 * rows_fit * num_qo_heads * dim_vo)

        merge = work.merge_indptr
        items = work.items
        merge_tokens = tokens if merge is not None else 0
        if self._use_cuda_graph:
            _, cap_tokens, cap_items = self._capacity
            merge = (merge or [0] * (tokens + 1)) + [merge[-1] if merge else 0] * (cap_tokens - tokens)
            items = items + [_EMPTY_ITEM] * (cap_items - len(items))
            merge_tokens = cap_tokens
        walk = []
        if work.costs and walks:
            # The launch's grid (fa3_launch.cuh): one CTA per SM, which is the wave of a kernel that
            # fits once per SM; a grid of another size takes its rounds (work.cuh CtaWalk).
            ctas = min(len(items) * num_kv_heads, wave)
            walk = walk_section(work, len(items), num_kv_heads, ctas, self._use_cuda_graph)
        sections = [qo_indptr, kv_indptr, last_page_len or [], merge or [], [x for item in items for x in item],
                    mask[1] if mask is not None else [], walk]
        host, offsets = [], []
        for values in sections:
            offsets.append(len(host))
            host.extend(values)
            host.extend([0] * (-len(host) % 4))  # 16-byte aligned sections (work items are int4)
        host_tensor = torch.tensor(host or [0], dtype=torch.int32)
        if self._use_cuda_graph and self._ints is not None and self._ints.numel() == host_tensor.numel():
            self._ints.copy_(host_tensor, non_blocking=non_blocking)
        else:
            self._ints = host_tensor.to(self._device, non_blocking=non_blocking)
        addr = self._ints.data_ptr()

        pages_ptr = 0
        if page_indices is not None:
            nnz = kv_indptr[-1]
            if self._use_cuda_graph:
                if self._page_buffer is None:
                    raise ValueError("paged_kv_indices_buffer: use_cuda_graph=True needs a page-id buffer given at "
                                     "construction (its address is captured)")
                if self._page_buffer.shape[0] < nnz:
                    raise ValueError(f"paged_kv_indices_buffer: expected room for {nnz} page ids, it holds "
                                     f"{self._page_buffer.shape[0]}")
                self._page_buffer[:nnz].copy_(page_indices[:nnz], non_blocking=non_blocking)
                self._pages = self._page_buffer
            else:
                self._pages = page_indices if page_indices.is_contiguous() else page_indices.contiguous()
            pages_ptr = self._pages.data_ptr()
        mask_pointers = (0, 0, 0)
        if mask is not None:
            bits_ptr, full_ptr = self._place_mask(*mask, qo_lens, kv_lens, non_blocking)
            mask_pointers = (bits_ptr, addr + 4 * offsets[5], full_ptr)
        elif not self._use_cuda_graph:
            self._mask_bits = self._mask_full = None
        pointers = (addr + 4 * offsets[0], addr + 4 * offsets[1], pages_ptr,
                    addr + 4 * offsets[2] if last_page_len is not None else 0, addr + 4 * offsets[4],
                    addr + 4 * offsets[3] if merge is not None else 0)
        self._plan = BatchPlan(module, num_qo_heads, num_kv_heads, head_dim, dim_vo, q_dtype, tokens, page_size,
                               max_page, kv_indptr[-1] if page_indices is None else 0, scalars, pointers, partials, len(items),
                               merge_tokens, work, graph_tokens=self._capacity[1] if self._use_cuda_graph else 0,
                               invariant_chunk=chunk, mask=mask_pointers, walk=addr + 4 * offsets[6] if walk else 0)
        self._launches = Signatures()

    def _plan_mask(self, custom_mask, packed_custom_mask, qo_indptr: list[int], kv_lens: list[int],
                   lengths: str) -> tuple | None:
        """A plan's custom mask checked against its (query, key) pairs and packed
        (ops._masks.batch_bits: `lengths` says where kv_lens come from), before
        anything is compiled: (packed bits, byte offsets per request), None: no mask."""
        mask = _masks.given(custom_mask, packed_custom_mask)
        if mask is None:
            return None
        qo_lens = [qo_indptr[i + 1] - qo_indptr[i] for i in range(len(qo_indptr) - 1)]
        bits, offsets = _masks.batch_bits(mask, qo_lens, kv_lens, self._device, lengths)
        if self._use_cuda_graph:
            if self._mask_buffer is None:
                raise ValueError(f"custom_mask_buf: use_cuda_graph=True with {mask.name} needs a uint8 buffer given "
                                 f"at construction (its address is captured), got none")
            if self._mask_buffer.shape[0] < offsets[-1]:
                raise ValueError(f"custom_mask_buf: expected room for the {offsets[-1]} bytes of this plan's packed "
                                 f"mask, it holds {self._mask_buffer.shape[0]}")
        return bits, offsets

    def _place_mask(self, bits: torch.Tensor, offsets: list[int], qo_lens: list[int], kv_lens: list[int],
                    non_blocking: bool) -> tuple[int, int]:
        """The addresses the kernels read a plan's packed mask and its full-key
        counts at (_masks.full_keys, counted where the bits are; 0: none). Under
        CUDA graphs, where a captured launch keeps both addresses: the bits in
        custom_mask_buf, written in place, and the counts in a tensor of the
        wrapper's own, one int32 a request (the batch is fixed), zeros where
        none were counted (every key tile tests the mask). Otherwise both on
        the device, kept by the wrapper until the next plan (a packed mask given
        on the device is the caller's tensor: in-place changes reach later runs,
        and must keep the counted keys visible)."""
        if self._use_cuda_graph:
            self._mask_buffer[:bits.shape[0]].copy_(bits, non_blocking=non_blocking)
            self._mask_bits = self._mask_buffer
            full = _masks.full_keys(bits, qo_lens, kv_lens, offsets)
            if self._mask_full is None:
                self._mask_full = torch.zeros(len(qo_lens), dtype=torch.int32, device=self._device)
            if full is None:
                self._mask_full.zero_()
            else:
                self._mask_full.copy_(full, non_blocking=non_blocking)
            return self._mask_bits.data_ptr() if offsets[-1] else 0, self._mask_full.data_ptr()
        self._mask_bits = bits.to(self._device, non_blocking=non_blocking)
        self._mask_full = _masks.full_keys(self._mask_bits, qo_lens, kv_lens, offsets)
        return (self._mask_bits.data_ptr() if self._mask_bits.numel() else 0,
                self._mask_full.data_ptr() if self._mask_full is not None else 0)

    def _invariant_partials(self, rows: int, rows_fit: int, num_qo_heads: int, head_dim_vo: int) -> tuple[int, int]:
        """(address, rows) of the partial state of a batch-invariant plan: the
        workspace where it holds them, else (chunks cannot grow in this mode) a
        buffer of this wrapper's own, or, with CUDA graphs (whose captured
        addresses must stay), a ValueError naming the workspace needed."""
        if rows <= rows_fit:
            return self._workspace.data_ptr(), rows_fit
        need = 4 * rows * num_qo_heads * (head_dim_vo + 1)
        if self._use_cuda_graph:
            have = self._workspace.numel() * self._workspace.element_size()
            raise ValueError(f"float_workspace_buffer: batch_invariant=True needs {need} bytes of partial state for "
                             f"this batch (split-KV chunks of fixed size), got {have}; with use_cuda_graph=True give "
                             f"a larger workspace")
        if self._own_partials is None or self._own_partials.numel() * 4 < need:
            self._own_partials = torch.empty(need // 4, dtype=torch.float32, device=self._device)
        return self._own_partials.data_ptr(), rows

    def _check_q(self, q, plan: BatchPlan) -> None:
        """Everything about q but its row count (see _check_q_rows)."""
        _checks.check_tensor("q", q, 3)
        if q.dtype != plan.q_dtype:
            raise ValueError(f"q: expected dtype {plan.q_dtype} as planned (q_data_type), got {q.dtype}")
        if q.shape[1] != plan.num_qo_heads:
            raise ValueError(f"q: expected {plan.num_qo_heads} qo heads (num_qo_heads) as planned, got {q.shape[1]} "
                             f"(shape {tuple(q.shape)})")
        if q.shape[2] != plan.head_dim:
            raise ValueError(f"q: expected head_dim {plan.head_dim} as planned, got {q.shape[2]} "
                             f"(shape {tuple(q.shape)})")

    def _check_q_rows(self, q, plan: BatchPlan) -> None:
        """On every call: the argument signatures run() remembers leave token
        counts out. Rows past the plan would come back unwritten, rows short of
        it would be read past q's end."""
        rows = q.shape[0]
        if rows == plan.qo_tokens or plan.qo_tokens <= rows <= plan.graph_tokens:
            return
        if plan.graph_tokens > plan.qo_tokens:
            raise ValueError(f"q: expected {plan.qo_tokens} to {plan.graph_tokens} rows ({self._qo_rows} as planned, "
                             f"up to the {plan.graph_tokens} query tokens use_cuda_graph=True fixed at the first "
                             f"plan()), got {rows} (shape {tuple(q.shape)})")
        raise ValueError(f"q: expected {plan.qo_tokens} rows ({self._qo_rows} as planned), got {rows} "
                         f"(shape {tuple(q.shape)})")

    def _outputs(self, q, plan: BatchPlan, out, lse, return_lse: bool):
        tokens = q.shape[0]
        shape = (tokens, plan.num_qo_heads, plan.head_dim_vo)
        if out is None:  # q has the output's shape where V is as wide (the checks saw to it): empty_like is cheaper
            same = q.is_contiguous() and plan.head_dim_vo == plan.head_dim
            out = torch.empty_like(q) if same else torch.empty(shape, dtype=q.dtype, device=q.device)
        else:
            check_out_buffer("out", out, shape, q.dtype, q.device, out_shape_words(plan))
        if return_lse:
            if lse is None:
                lse = torch.empty(tokens, plan.num_qo_heads, dtype=torch.float32, device=q.device)
            else:
                check_out_buffer("lse", lse, shape[:2], torch.float32, q.device, "q's rows x num_qo_heads")
        else:
            lse = None
        return out, lse

    def _launch(self, q, k, v, k_strides: tuple, v_strides: tuple, out, lse, v_offset: int = 0,
                scales: tuple = (_scales.UNIT, _scales.UNIT), sinks: int = 0):
        """The first run() of a signature, after its checks against the plan:
        placement, the params, the launch. Returns the prepared call that
        repeats it for that signature (ops._calls.batch_call). v_offset: bytes
        from v's address to V's first element (one 5-D paged cache passes
        itself as k and v). scales: an FP8 cache's k_scale and v_scale, checked
        (ops._scales.ScaleArg). sinks: the checked address of the attention
        sinks (ops._sinks; 0: none), passed by keyword and only where nonzero."""
        plan = self._plan
        spec = plan.module.spec
        check_placement(q, k, v, spec)
        if q.device != self._device:
            raise ValueError(f"q: expected a tensor on {self._device} (the workspace's device), got {q.device}")
        if spec.use_tensor_cores:  # its kernels write O in 16-byte vectors too
            _checks.check_vector_aligned("out", out)
        params = fill_params(q, plan.num_kv_heads, k_strides, v_strides, plan.page_size,
                             (plan.num_qo_heads * plan.head_dim_vo, plan.head_dim_vo), plan.num_qo_heads, *plan.scalars,
                             kv_element_size=k.element_size(), scales=scales, sinks=sinks, mask=plan.mask)
        # Negative: no CTA spans two chunks, the plain kernel runs (attention_params.cuh).
        params.invariant_chunk = plan.invariant_chunk if plan.work.folds else -plan.invariant_chunk
        params.cta_walk = plan.walk or None
        head = PER_CALL.pack(0, 0, 0, 0, 0, *plan.pointers, *plan.partials, plan.num_work, plan.merge_tokens, 0, 1,
                             0, plan.work.band_items)
        call = batch_call(plan.module, head + bytes(params)[PER_CALL.size:], self._device.index, v_offset, q,
                          plan.num_qo_heads, plan.head_dim_vo, lse is not None)
        call(q, k, v, out, lse)
        return call


def out_shape_words(plan: BatchPlan) -> str:
    """Where the output's expected shape comes from, for check_out_buffer."""
    dim = "head_dim_vo" if plan.head_dim_vo != plan.head_dim else "head_dim"
    return f"q's rows x num_qo_heads x {dim}, q's dtype"


def check_out_buffer(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device, what: str = "") -> None:
    """User-provided out / lse: the kernel writes them densely, so they must be
    contiguous; `what` says where the expected shape comes from."""
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype or t.device != device \
            or not t.is_contiguous():
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}, contiguous={t.is_contiguous()}" \
            if isinstance(t, torch.Tensor) else type(t).__name__
        what = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected a contiguous {dtype} tensor of shape {shape}{what} on {device}, "
                         f"got {got}")


def dtype_arg(name: str, value, kv: bool = False) -> torch.dtype:
    """A plan's dtype argument (a torch dtype or its name); kv: kv_data_type, which may be FP8."""
    if isinstance(value, str):
        from ..spec import canonical_dtype

        try:
            value = getattr(torch, canonical_dtype(value))
        except ValueError:
            pass
    if value in _scales.FNUZ_DTYPES or (not kv and _scales.is_fp8(value)):
        raise ValueError(f"{name}: {_scales.dtype_problem(value, kv)}")
    if value not in _checks.SUPPORTED_DTYPES and not (kv and _scales.is_fp8(value)):
        fp8 = " (or float8_e4m3fn / float8_e5m2)" if kv else ""
        raise ValueError(f"{name}: expected float16, bfloat16 or float32{fp8}, got {value!r}")
    return value
