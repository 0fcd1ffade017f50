"""Multi-level cascade attention with FlashInfer 0.7's names and semantics:
MultiLevelCascadeAttentionWrapper.

The keys of each request are split into levels: level 0 holds pages that many
requests share (a system prompt, a few-shot prefix, the prompt of parallel
samples), the last level each request's own pages, levels between them pages
shared by groups. Level l is a paged batch of its own: qo_indptr_arr[l] groups
the query tokens (every level covers the same tokens, in the same order) into
the requests of that level, paged_kv_*_arr[l] give each group's pages. A shared
level then reads its pages once for all the queries of the group, not once per
request.

Each level runs as one BatchPrefillWithPagedKVCacheWrapper returning its
output and base-2 LSE; merge_state_in_place folds levels 0 .. L-2 into the last
level's state, which is attention over the concatenation of the levels' keys.
As in FlashInfer, only the last level is causal (when causal=True): the shared
levels precede every query. That equals causal attention over the concatenated
keys where each request's last-level keys are at least its query tokens; a
query token that would see only part of a shared level is not expressible.

No operator of its own is registered for torch.compile: run() is a composition
of the paged wrappers' run() and merge_state_in_place, whose operators trace.
CUDA graphs (use_cuda_graph=True): each level wrapper runs in graph mode (its
page ids in paged_kv_indices_buf_arr[l]), and the output and LSE buffers are
allocated by the first plan(), so a replayed run() writes to the same memory
and run() allocates no output (the merge's float32 temporaries come from the
graph's memory pool under capture)."""

from __future__ import annotations

import torch

from . import _checks
from ._batch import dtype_arg
from .merge import merge_state_in_place
from .paged import BatchPrefillWithPagedKVCacheWrapper

# Per-level arguments of the level wrappers' plan() and how the cascade names them.
_LEVEL_NAMES = (("qo_indptr", "qo_indptr_arr"), ("paged_kv_indptr", "paged_kv_indptr_arr"),
                ("paged_kv_indices", "paged_kv_indices_arr"), ("paged_kv_last_page_len", "paged_kv_last_page_len"))


class MultiLevelCascadeAttentionWrapper:
    """Attention over levels of pages in one paged KV cache; see the module docstring.
    backend / strict (keyword only, flashjit's): as the paged prefill wrapper takes them."""

    _level_wrapper = BatchPrefillWithPagedKVCacheWrapper

    def __init__(self, num_levels: int, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None,
                 paged_kv_indices_buf_arr=None, paged_kv_last_page_len_buf_arr=None, *, backend: str = "auto",
                 strict: bool | None = None):
        if not isinstance(num_levels, int) or isinstance(num_levels, bool) or num_levels < 1:
            raise ValueError(f"num_levels: expected a positive int, got {num_levels!r}")
        _checks.check_layout(kv_layout)
        buffers = {"qo_indptr_buf": qo_indptr_buf_arr, "paged_kv_indptr_buf": paged_kv_indptr_buf_arr,
                   "paged_kv_indices_buf": paged_kv_indices_buf_arr,
                   "paged_kv_last_page_len_buf": paged_kv_last_page_len_buf_arr}
        per_level = [{} for _ in range(num_levels)]
        if use_cuda_graph:
            if paged_kv_indices_buf_arr is None:
                raise ValueError("paged_kv_indices_buf_arr: use_cuda_graph=True needs one page-id buffer per level "
                                 "(their addresses are captured)")
            for keyword, values in buffers.items():
                if values is not None:
                    for level, value in enumerate(_level_list(f"{keyword}_arr", values, num_levels)):
                        per_level[level][keyword] = value
        # Without CUDA graphs FlashInfer ignores the buffers too: plan() takes the tensors it is given.
        self._batch_prefill_wrappers = [
            self._level_wrapper(float_workspace_buffer, kv_layout, use_cuda_graph=bool(use_cuda_graph),
                                backend=backend, strict=strict, **per_level[level])
            for level in range(num_levels)]
        self._num_levels = num_levels
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._device = float_workspace_buffer.device
        self._planned = False
        self._graph_outputs: tuple | None = None  # (key, out, lse, level out, level lse) in graph mode

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffers) -> None:
        raise NotImplementedError("reset_workspace_buffer: flashjit's wrappers keep the workspace they were created "
                                  "with (captured CUDA graphs hold its address); create a new wrapper instead")

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """Nothing to do: flashjit's paged kernels take K and V strides as runtime
        values, and run()'s first call of a signature prepares it (do that before a
        CUDA-graph capture)."""
        if variant != "independent":
            raise ValueError(f"variant: expected 'independent', got {variant!r}")

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale=None,
             window_left: int = -1, logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16",
             kv_data_type=None, *, use_tensor_cores: bool | None = None) -> None:
        """Plans every level: lists of num_levels tensors, level 0 the most shared;
        causal applies to the last level only. use_tensor_cores (flashjit's):
        as the paged prefill wrapper's plan() takes it."""
        _checks.check_unsupported(pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction)
        if window_left is not None and window_left >= 0:
            raise NotImplementedError(f"window_left={window_left}: a sliding window spans levels, and each level would "
                                      f"apply it to its own keys, not to the concatenated sequence; use "
                                      f"BatchPrefillWithPagedKVCacheWrapper over the whole pages")
        tokens = check_levels(self._num_levels, self._device, qo_indptr_arr, paged_kv_indptr_arr,
                              paged_kv_indices_arr, paged_kv_last_page_len, page_size)
        self._planned = False
        last = self._num_levels - 1
        for level, wrapper in enumerate(self._batch_prefill_wrappers):
            try:
                wrapper.plan(qo_indptr_arr[level], paged_kv_indptr_arr[level], paged_kv_indices_arr[level],
                             paged_kv_last_page_len[level], num_qo_heads, num_kv_heads, head_dim, page_size,
                             causal=bool(causal) and level == last, sm_scale=sm_scale, window_left=-1,
                             logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                             q_data_type=q_data_type, kv_data_type=kv_data_type, use_tensor_cores=use_tensor_cores)
            except ValueError as error:
                raise ValueError(_level_message(str(error), level)) from error
        if self._use_cuda_graph:
            self._keep_graph_outputs(tokens, num_qo_heads, head_dim, dtype_arg("q_data_type", q_data_type))
        self._planned = True

    begin_forward = plan

    def _keep_graph_outputs(self, tokens: int, num_qo_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Graph mode: output and LSE buffers for the token count of the first plan()
        (the level wrappers refuse more later), kept while heads, head_dim and dtype
        stay; a plan that changes them allocates anew (and needs a new capture)."""
        key = (num_qo_heads, head_dim, dtype)
        if self._graph_outputs is not None and self._graph_outputs[0][:3] == key:
            return
        rows = tokens if self._graph_outputs is None else max(tokens, self._graph_outputs[0][3])
        shape, device = (rows, num_qo_heads, head_dim), self._device
        self._graph_outputs = ((*key, rows),
                               torch.empty(shape, dtype=dtype, device=device),
                               torch.empty(shape[:2], dtype=torch.float32, device=device),
                               torch.empty(shape, dtype=dtype, device=device),
                               torch.empty(shape[:2], dtype=torch.float32, device=device))

    def run(self, q: torch.Tensor, paged_kv_cache) -> torch.Tensor:
        """q [tokens, num_qo_heads, head_dim] (the tokens of qo_indptr_arr[l][-1]),
        paged_kv_cache as the paged wrappers take it (5-D tensor or (K, V) tuple).
        Returns the output in q's dtype; in graph mode a view of the wrapper's own
        buffer, which the next run() overwrites."""
        if not self._planned:
            raise RuntimeError("run() called before plan()")
        levels = self._batch_prefill_wrappers
        if not self._use_cuda_graph:
            out, lse = levels[-1].run(q, paged_kv_cache, return_lse=True)
            for level in levels[:-1]:
                part, part_lse = level.run(q, paged_kv_cache, return_lse=True)
                merge_state_in_place(out, lse, part, part_lse)
            return out
        _checks.check_tensor("q", q, 3)
        (*_, capacity), out_buf, lse_buf, part_buf, part_lse_buf = self._graph_outputs
        rows = q.shape[0]
        if rows > capacity:
            raise ValueError(f"q: expected at most {capacity} rows (the query tokens use_cuda_graph=True fixed at the "
                             f"first plan()), got {rows} (shape {tuple(q.shape)})")
        out, lse = levels[-1].run(q, paged_kv_cache, out=out_buf[:rows], lse=lse_buf[:rows], return_lse=True)
        part, part_lse = part_buf[:rows], part_lse_buf[:rows]
        for level in levels[:-1]:
            level.run(q, paged_kv_cache, out=part, lse=part_lse, return_lse=True)
            merge_state_in_place(out, lse, part, part_lse)
        return out

    forward = run


def _level_list(name: str, values, num_levels: int) -> list:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name}: expected a list of {num_levels} tensors (num_levels), got {type(values).__name__}")
    if len(values) != num_levels:
        raise ValueError(f"{name}: expected {num_levels} entries (num_levels), got {len(values)}")
    return list(values)


def check_levels(num_levels: int, device: torch.device, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
                 paged_kv_last_page_len, page_size: int) -> int:
    """The levels' page tables, on the host, before any level is planned: one
    entry per level in each list, each level's indptrs of one batch size, as
    many page ids as its indptr counts (on `device`, the workspace's), one last
    page length per request within 1..page_size, and the same query tokens in
    every level. Returns that token count; a ValueError names the argument and
    its level."""
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    qo_arr = _level_list("qo_indptr_arr", qo_indptr_arr, num_levels)
    kv_arr = _level_list("paged_kv_indptr_arr", paged_kv_indptr_arr, num_levels)
    indices_arr = _level_list("paged_kv_indices_arr", paged_kv_indices_arr, num_levels)
    last_arr = _level_list("paged_kv_last_page_len", paged_kv_last_page_len, num_levels)
    tokens = None
    for level in range(num_levels):
        qo = _checks.check_indptr(f"qo_indptr_arr[{level}]", qo_arr[level])
        if tokens is None:
            tokens = qo[-1]
        elif qo[-1] != tokens:
            raise ValueError(f"qo_indptr_arr[{level}]: expected its last element to be {tokens} (as in "
                             f"qo_indptr_arr[0]: every level attends for the same query tokens), got {qo[-1]}")
        batch = len(qo) - 1
        kv_name = f"paged_kv_indptr_arr[{level}]"
        kv = _checks.check_indptr(kv_name, kv_arr[level])
        if len(kv) != batch + 1:
            raise ValueError(f"{kv_name}: expected {batch + 1} elements (the {batch} requests of "
                             f"qo_indptr_arr[{level}], plus one), got {len(kv)}")
        indices_name = f"paged_kv_indices_arr[{level}]"
        indices = _checks.int_tensor(indices_name, indices_arr[level], kv[-1],
                                     what=f" (the pages {kv_name}[-1] counts)")
        if indices.device != device:
            raise ValueError(f"{indices_name}: expected a tensor on {device} (the workspace's device), "
                             f"got {indices.device}")
        last_name = f"paged_kv_last_page_len[{level}]"
        last = _checks.int_tensor(last_name, last_arr[level], batch, exact=True,
                                  what=f" (one per request of qo_indptr_arr[{level}])")
        pages = [kv[i + 1] - kv[i] for i in range(batch)]
        _checks.last_page_lens(last_name, last.tolist(), pages, page_size)
    return tokens


def _level_message(message: str, level: int) -> str:
    """A level wrapper's ValueError in the cascade's words: its per-level argument
    named as the cascade's list entry (paged_kv_indices -> paged_kv_indices_arr[1])."""
    for own, cascade in _LEVEL_NAMES:
        if message.startswith(f"{own}:"):
            return f"{cascade}[{level}]:{message[len(own) + 1:]}"
    return message
