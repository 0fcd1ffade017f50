"""Batch-invariant mode: the decisions that make a request's output the same
bit for bit whatever else is in its batch and whichever op computes it (ragged
or paged prefill, paged decode one token at a time, any page size).

A row's result depends on the arithmetic applied to it and its order, never on
the other rows of its CTA: the tensor-core kernels decide the lazy max per row
(fa2_softmax.cuh) and every MMA element sums its own products, so the position
of a row in a tile, the rows per CTA and the launch order do not matter. What
the mode pins is everything else that normal mode lets the batch decide:

- the kernel family: one for every op. Decode runs the prefill kernel of its
  backend (rows split over warps, the same key tiles from key 0 of the request;
  on fa3 with one consumer warpgroup) instead of the split-keys decode kernel,
  whose warps merge their states; fp16/bf16 always on tensor cores
  (use_tensor_cores is not a choice here), fp32 on the CUDA-core prefill kernel;
- the backend: `auto` resolves as for prefill (fa3 where every target is
  sm_90a, else fa2) for decode too;
- split-KV: a fixed chunk of keys from key 0, the same for every op, instead of
  a chunk sized from the batch, the SM count or the workspace. A row that sees
  keys in one chunk is written directly (the fold of one state and empty ones
  is exact: weight 1, sum 1); a row that sees several has its chunks' states
  folded in chunk order (common/chunk_fold.cuh), by the merge pass over split
  chunks or, on fa3, by the CTA that walks them (folds()), with one arithmetic:
  whether a request's chunks are split across CTAs is free to follow the batch,
  as in normal mode (plan()).

Pure host arithmetic (no torch), so that the CPU tests check it.
"""

from __future__ import annotations

import os

from .. import arch
from ._plan import (_ITEM_OVERHEAD, _MIN_GAIN, WorkPlan, _estimate, _item_cost, ceil_div, choose_band_items,
                    tile_items, unsplit_plan)

ENV_VAR = "FLASHJIT_BATCH_INVARIANT"
# Keys per split-KV chunk. Decode needs chunks this short to fill the GPU
# (1 x 32k with 8 KV heads: 128 CTAs; longer chunks leave SMs idle on the
# long decode rows), and prefill pays for every row past the first chunk in
# fp32 partial state and a merge pass (docs/numerics.md#batch-invariant-mode,
# "Cost", has the table).
CHUNK_KEYS = 2048

# Decode ops run their backend's prefill kernel, as the spec of a decode op
# with causal=True (spec.KernelSpec.invariant_decode: one query row sees every
# key under the bottom-right causal mask, so the flag changes no output): fa2's
# and the CUDA cores' prefill tilings, fa3's prefill key tiles on one consumer
# warpgroup. The backend is the one their prefill op resolves to.
PREFILL_OPS = {"batch_decode_paged": "batch_prefill_paged", "single_decode": "single_prefill"}

class _Modes(dict):
    """FLASHJIT_BATCH_INVARIANT's raw value -> the mode, each value parsed once
    (arch parses) on its first lookup."""

    def __missing__(self, raw):
        value = self[raw] = arch.batch_invariant()
        return value


# os.environ.get encodes the key and decodes the value in Python (about 0.5 us):
# the single-request ops ask on every call, so they read the mapping os.environ
# keeps in step with every assignment (its bytes keys on POSIX), as
# MODES[environ_get(ENV_KEY, b"")], two C calls and no Python frame.
MODES = _Modes()
try:
    environ_get, ENV_KEY = os.environ._data.get, os.environ.encodekey(ENV_VAR)
except AttributeError:  # another platform's os.environ: the public path
    environ_get, ENV_KEY = os.environ.get, ENV_VAR


def env_setting() -> bool:
    """FLASHJIT_BATCH_INVARIANT=1 turns the mode on for every op of the process
    (an argument batch_invariant=False still turns it off for that call)."""
    return MODES[environ_get(ENV_KEY, b"")]


def resolve(batch_invariant) -> bool:
    """The mode of one call or plan: the argument where given, else the process setting."""
    if batch_invariant is None:
        return env_setting()
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant: expected True, False or None (None: {ENV_VAR}), got "
                         f"{batch_invariant!r}")
    return batch_invariant


def kernel_choice(op: str, dtype: str, causal: bool) -> tuple[str, bool, bool]:
    """(op whose backend the spec takes, use_tensor_cores, causal) in batch-invariant mode."""
    from ..spec import MLA_OPS, TENSOR_CORE_DTYPES

    if op in MLA_OPS:  # one kernel for its decode and prefill already
        return op, True, causal
    return PREFILL_OPS.get(op, op), dtype in TENSOR_CORE_DTYPES, causal or op in PREFILL_OPS


def prewarm_specs(specs, arches) -> list:
    """The kernels batch-invariant mode loads for a prewarm selection built for
    `arches` (flashjit prewarm --batch-invariant): each attention spec's cores
    and causal flag as kernel_choice gives them, on the backend `auto` picks for
    its prefill op on each arch."""
    from ..spec import MLA_OPS, UTILITY_OPS

    out = []
    for spec in specs:
        if spec.op in UTILITY_OPS or spec.op in MLA_OPS:  # loaded as they are
            out.append(spec)
            continue
        backend_op, tc, causal = kernel_choice(spec.op, spec.dtype_q, spec.causal)
        for target in arches:
            backend = arch.choose_backend(backend_op, spec.dtype_q, tc, "auto", targets=(target,),
                                          kv_dtype=spec.dtype_kv, head_dim=spec.head_dim_qk,
                                          head_dim_vo=spec.head_dim_vo, custom_mask=spec.custom_mask)[0]
            out.append(spec.replace(use_tensor_cores=tc, causal=causal, backend=backend).validate())
    return list(dict.fromkeys(out))


# What a chunk boundary costs a CTA that folds it, in keys of work: it drains
# the pipeline, reads and writes its running output, restarts: about three
# tiles of 128 keys, as measured on long d128 prefill (docs/numerics.md#batch-invariant-mode,
# "Cost").
_FOLD_OVERHEAD = 384

# Where a kernel folds chunks itself, whether a launch does: "auto" where
# splitting would not run estimably faster (_fold_plan; single requests: where
# the grid fills a wave, as normal mode splits), "always" or "never" (the GPU
# tests and benchmarks/dev/batch_invariant_cost.py compare the two).
fold_policy = "auto"


def folds(spec) -> bool:
    """Whether the spec's kernel folds a CTA's chunks itself (fa3 attention):
    then a request needs no split to be merged chunk by chunk. Not decode: a
    CTA of a few query rows reads and writes a whole tile of scratch at each
    boundary, where a split chunk writes and merges its few rows, which ran
    faster on decode rows (docs/numerics.md#batch-invariant-mode, "Cost")."""
    from ..spec import MLA_OPS

    return spec.backend == "fa3" and spec.op not in MLA_OPS and not spec.invariant_decode


def scratch_floats(resident_ctas: int, rows_per_cta: int, head_dim: int) -> int:
    """The fold scratch of a launch (fa2::ChunkMerge::kFloatsPerRow): per CTA of
    its persistent grid (at most one per SM, so at most resident_ctas), each
    row's accumulator and its running max and sum as the four lanes holding the
    row keep them."""
    return resident_ctas * rows_per_cta * (head_dim + 8)


def chunk_keys(fixed_chunk: int | None, allow_split: bool, split_align: int) -> int:
    """Keys per chunk (0: no split): the caller's fixed chunk, rounded up to the
    kernel's tile, else CHUNK_KEYS. Outputs agree across calls that use the same
    chunk; the default is the same for every op."""
    if not allow_split:
        return 0
    align = max(int(split_align), 1)
    chunk = int(fixed_chunk) if fixed_chunk is not None else CHUNK_KEYS
    return ceil_div(max(chunk, 1), align) * align


def single_split(kv_len: int, chunk: int) -> tuple[int, int]:
    """(num_splits, kv_chunk) of a single-request launch: every token merges
    ceil(kv_len / chunk) states (the rows that see fewer get empty ones)."""
    n = ceil_div(kv_len, chunk) if chunk else 1
    return (n, chunk) if n > 1 else (1, 0)


def _chunks_seen(q: int, qo_len: int, kv_len: int, chunk: int, causal: bool) -> int:
    """Chunks holding keys query q may see (at least 1); the window only drops
    leading chunks, whose states are then empty and weigh 0 in the merge."""
    end = min(kv_len, q + kv_len - qo_len + 1) if causal else kv_len
    return max(1, ceil_div(end, chunk)) if chunk and end > 0 else 1


def _fold_plan(qo_lens, kv_lens, *, group: int, rows_per_cta: int, num_kv_heads: int, resident_ctas: int,
               chunk: int, causal: bool) -> WorkPlan | None:
    """The plan of one item per query tile over all its keys, each CTA folding
    its chunks, where cutting the requests into their chunks would not run
    estimably faster (the estimate and margin of normal mode's split rule,
    ops._plan); else None."""
    base = tile_items(qo_lens, kv_lens, group=group, rows_per_cta=rows_per_cta, causal=causal)
    if not base:
        return None
    columns = ([b[0] for b in base], [b[3] for b in base], [b[4] for b in base])
    # Each boundary a CTA folds costs it about _FOLD_OVERHEAD keys of work.
    folding = ([c + (ceil_div(c - _ITEM_OVERHEAD, chunk) - 1) * _FOLD_OVERHEAD if c > _ITEM_OVERHEAD else c
                for c in columns[0]], *columns[1:])
    slots, heads = max(1, resident_ctas), max(num_kv_heads, 1)
    if fold_policy == "auto" and \
            _estimate(columns, chunk, slots, heads) < (1 - _MIN_GAIN) * _estimate(folding, 0, slots, heads):
        return None
    folds = any(kv > chunk for kv in kv_lens)
    return unsplit_plan(base, heads, slots, kv_chunk=chunk if folds else 0, folds=folds)


def plan(qo_lens, kv_lens, *, group: int, rows_per_cta: int, num_kv_heads: int, resident_ctas: int, chunk: int,
         causal: bool, max_items: int | None = None, fold: bool = False) -> WorkPlan:
    """The work plan of a batch in batch-invariant mode. fold (the kernel folds
    chunks itself: folds()): one item per query tile, its CTA folding its
    chunks, unless splitting them promises a shorter run (_fold_plan). Else
    each query tile is cut into as many chunk items as its last token's keys
    span; tiles that share a token (a group that does not divide rows_per_cta)
    take the larger count, so that every token's partial rows are written by
    every item that covers it. ValueError where the items do not fit max_items
    (chunks never grow here)."""
    if fold and chunk and fold_policy != "never":
        folded = _fold_plan(qo_lens, kv_lens, group=group, rows_per_cta=rows_per_cta, num_kv_heads=num_kv_heads,
                            resident_ctas=resident_ctas, chunk=chunk, causal=causal)
        if folded is not None and (max_items is None or len(folded.items) <= max_items):
            return folded
    items, tile_counts = [], []
    for request, (qo_len, kv_len) in enumerate(zip(qo_lens, kv_lens)):
        rows = qo_len * group
        tiles = ceil_div(rows, rows_per_cta)
        counts = [0] * tiles
        t = 0
        while t < tiles:  # runs of tiles linked by a token split between them
            first = t
            while (t + 1) * rows_per_cta < rows and ((t + 1) * rows_per_cta) % group:
                t += 1
            last_token = (min((t + 1) * rows_per_cta, rows) - 1) // group
            n = _chunks_seen(last_token, qo_len, kv_len, chunk, causal)
            counts[first:t + 1] = [n] * (t + 1 - first)
            t += 1
        for tile, n in enumerate(counts):
            cost = _item_cost(qo_len, kv_len, tile, rows_per_cta, group, causal)
            if n == 1:
                items.append((cost, request, tile, -1, 0))
            else:
                items += [(min(chunk, kv_len - s * chunk) + _ITEM_OVERHEAD, request, tile, s, chunk) for s in range(n)]
        tile_counts.append(counts)
    if max_items is not None and len(items) > max_items:
        raise ValueError(f"batch_invariant: the batch needs {len(items)} CTAs per KV head (requests cut in chunks of "
                         f"{chunk} keys), more than the {max_items} this wrapper's CUDA graph was sized for; create "
                         f"a new wrapper and plan it first with the longest contexts it will serve")
    items.sort(key=lambda e: -e[0])
    shared = any(e[2] > 0 for e in items)
    bands = choose_band_items([e[0] for e in items], max(num_kv_heads, 1), max(1, resident_ctas), shared)
    if all(e[3] < 0 for e in items):
        return WorkPlan([e[1:] for e in items], None, 0, 0, bands)
    merge_indptr = [0]  # a token's partial rows: its tile's chunk count where that tile is split
    for qo_len, counts in zip(qo_lens, tile_counts):
        for q in range(qo_len):
            n = counts[q * group // rows_per_cta]
            merge_indptr.append(merge_indptr[-1] + (n if n > 1 else 0))
    return WorkPlan([e[1:] for e in items], merge_indptr, merge_indptr[-1], chunk, bands)
