"""Work plans for batched launches: which CTA computes which query rows of
which request against which keys (FlashjitWorkItem in attention_params.cuh).

Pure host-side arithmetic, kept apart from tensors so that it can be tested
without a GPU. The split-KV rule: among chunk sizes that cut the longest request
into 1..64 pieces, take the one with the shortest estimated run time, where
the estimate is the longest item or whole waves of the GPU's resident CTAs
times the mean item, whichever is larger (a batch of 512 equal CTAs on 396
slots runs two waves, and cutting each in three runs four shorter ones). So
one long request (decode at 128k keys, or a few long requests in a small
batch) does not leave the GPU idle while it finishes, and a uniform batch does
not run a nearly empty last wave. A merge pass then combines the chunks.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

# A chunk covers at least this many keys: below it, writing and merging fp32
# partial states costs more than the parallelism gains.
MIN_CHUNK_KEYS = 512
# Default chunks are multiples of this many keys (and of the kernel's tile).
CHUNK_ALIGN = 128
# Estimated cost, in keys, of a CTA beyond its keys (loading Q, the epilogue),
# and of splitting at all (one more launch). A split item also writes its
# rows' fp32 partial state and the merge reads it back: about two keys' worth
# of K/V traffic per query row (4-byte values against two 2-byte K/V rows).
_ITEM_OVERHEAD = 64
_SPLIT_OVERHEAD = 256
_PARTIAL_PER_ROW = 2
_MAX_PIECES = 64
# A split must promise at least this much shorter a run to be worth its merge.
_MIN_GAIN = 0.05


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WorkPlan:
    items: list            # (request, tile, split, chunk); split -1: all keys, output written directly
    merge_indptr: list | None  # [tokens + 1] partial rows per query token, None when nothing is split
    partial_rows: int      # rows of partial state (each num_qo_heads x head_dim fp32 plus an LSE)
    kv_chunk: int          # keys per chunk of the split (or folded) requests, 0 when none is cut
    band_items: int = 0    # launch order (work.cuh): work slots per band, 0: one band
    # Batch-invariant mode: some item's keys span several chunks, which its CTA
    # folds itself (ops._invariant.plan); the launch needs scratch at partial_o.
    folds: bool = False
    costs: tuple = ()      # per item, in the planner's units (_item_cost); () where unknown


def _item_cost(qo_len: int, kv_len: int, tile: int, rows_per_cta: int, group: int, causal: bool,
               key_tile: int = 1) -> int:
    """Keys the tile's last row can see, in whole tiles of key_tile keys (plus a
    constant for the tile's own work)."""
    if causal:
        last_query = min((tile + 1) * rows_per_cta, qo_len * group) // group
        kv_len = max(0, min(kv_len, kv_len - qo_len + last_query))
    return ceil_div(kv_len, key_tile) * key_tile + _ITEM_OVERHEAD


def _estimate(columns, chunk: int, slots: int, heads: int) -> float:
    """Run time, in keys, of the plan that cuts requests into `chunk`-key
    pieces (0: none): the longest item, or whole waves times the mean item.
    columns: (costs, kv lengths, query rows) of the unsplit items."""
    costs, kvs, rows = columns
    total = sum(costs)
    if not chunk:
        count, longest = len(costs), max(costs)
    else:
        count, whole_longest, split_rows = 0, 0, -1
        for cost, kv, r in zip(costs, kvs, rows):  # one pass: this runs for every candidate chunk
            if kv > chunk:  # n pieces, each with the item overhead and its rows' partial state
                n = -(-kv // chunk)
                count += n
                total += (n - 1) * _ITEM_OVERHEAD + n * (_ITEM_OVERHEAD + _PARTIAL_PER_ROW * r)
                split_rows = max(split_rows, r)
            else:
                count += 1
                whole_longest = max(whole_longest, cost)
        split_longest = chunk + _ITEM_OVERHEAD + _PARTIAL_PER_ROW * split_rows if split_rows >= 0 else 0
        longest = max(whole_longest, split_longest)
    waves = ceil_div(count * heads, slots)
    return max(longest, waves * total / count) + (_SPLIT_OVERHEAD if chunk else 0)


def _best_chunk(base, slots: int, heads: int, align: int) -> int:
    step = max(align, CHUNK_ALIGN)
    columns = ([b[0] for b in base], [b[3] for b in base], [b[4] for b in base])
    longest_kv = max(columns[1])
    unsplit = _estimate(columns, 0, slots, heads)
    best, best_time, tried = 0, unsplit, set()
    for pieces in range(2, _MAX_PIECES + 1):
        chunk = ceil_div(ceil_div(longest_kv, pieces), step) * step
        if chunk < MIN_CHUNK_KEYS:
            break
        if chunk in tried:  # several piece counts round to one chunk
            continue
        tried.add(chunk)
        t = _estimate(columns, chunk, slots, heads)
        if t < best_time:
            best, best_time = chunk, t
    return best if best_time < (1 - _MIN_GAIN) * unsplit else 0


# Launch-order bands (work.cuh): the widest bands whose estimated run time is
# within this fraction of a perfectly balanced grid.
_BAND_SLACK = 0.03


def _banded_time(costs, heads: int, slots: int, per_band: int) -> float:
    """Fluid estimate of a grid launched in bands: a CTA starts once the work
    launched before it, spread over `slots`, is done; the run ends with the
    latest start plus cost. costs: per work slot, in launch order."""
    done, latest = 0.0, 0.0
    for first in range(0, len(costs), per_band):
        band = costs[first:first + per_band]
        width = sum(band)
        start = done + (heads - 1) * width  # the band's last head starts after the others
        for cost in band:
            latest = max(latest, start / slots + cost)
            start += cost
        done += heads * width
    return max(latest, done / slots)


def choose_band_items(costs, heads: int, slots: int, shared_keys: bool) -> int:
    """Work slots per launch band (0: one band). costs: per work slot, in
    launch order; shared_keys: some request has several query tiles, whose
    CTAs read the same keys. Without shared keys (decode), bands of one slot:
    the KV heads of one request run together and read the same pages. With
    them, one band keeps the CTAs that read a KV head's keys together in L2
    (non-causal prefill); narrower bands keep long-first order across heads
    when the costs differ (causal), halving until the estimate is within
    _BAND_SLACK of a balanced grid. Measured: docs/fa2.md, "One CTA, step by
    step" (work and launch order)."""
    if heads <= 1 or not costs:
        return 0
    if not shared_keys:
        return 1
    if len(costs) * heads <= slots or min(costs) == max(costs):
        return 0  # one wave, or nothing to balance
    balanced = max(sum(costs) * heads / slots, max(costs))
    per_band = len(costs)
    while per_band > 1 and _banded_time(costs, heads, slots, per_band) > (1 + _BAND_SLACK) * balanced:
        per_band = ceil_div(per_band, 2)
    return 0 if per_band >= len(costs) else per_band


def single_request_costs(qo_len: int, kv_len: int, *, group: int, rows_per_cta: int, causal: bool,
                         key_tile: int = 1) -> list:
    """The costs of a launch without a plan (one request) by work slot: its last
    query tiles first (work.cuh decode_work_at)."""
    tiles = ceil_div(qo_len * group, rows_per_cta)
    return [_item_cost(qo_len, kv_len, t, rows_per_cta, group, causal, key_tile) for t in reversed(range(tiles))]


@functools.lru_cache(maxsize=1024)
def single_request_band_items(qo_len: int, kv_len: int, *, group: int, rows_per_cta: int, num_kv_heads: int,
                              resident_ctas: int, causal: bool) -> int:
    """choose_band_items for a launch without a plan (one request)."""
    costs = single_request_costs(qo_len, kv_len, group=group, rows_per_cta=rows_per_cta, causal=causal)
    return choose_band_items(costs, max(num_kv_heads, 1), max(1, resident_ctas), len(costs) > 1)


def tile_items(qo_lens, kv_lens, *, group: int, rows_per_cta: int, causal: bool, key_tile: int = 1) -> list:
    """(cost, request, tile, kv_len, query rows) of every query tile, each over all its keys."""
    base = []
    for request, (qo_len, kv_len) in enumerate(zip(qo_lens, kv_lens)):
        for tile in range(ceil_div(qo_len * group, rows_per_cta)):
            rows = min(rows_per_cta, qo_len * group - tile * rows_per_cta)
            cost = _item_cost(qo_len, kv_len, tile, rows_per_cta, group, causal, key_tile)
            base.append((cost, request, tile, kv_len, rows))
    return base


def unsplit_plan(base, heads: int, slots: int, kv_chunk: int = 0, folds: bool = False) -> WorkPlan:
    """The plan of tile_items `base` unsplit: one item per tile, longest first
    (kv_chunk, folds: a batch-invariant plan whose CTAs fold their chunks)."""
    ordered = sorted(base, key=lambda b: -b[0])
    shared = any(b[2] > 0 for b in base)  # a request with several query tiles
    costs = tuple(b[0] for b in ordered)
    return WorkPlan([(r, t, -1, 0) for _, r, t, _, _ in ordered], None, 0, kv_chunk,
                    choose_band_items(costs, heads, slots, shared), folds, costs)


def plan_work(qo_lens, kv_lens, *, group: int, rows_per_cta: int, num_kv_heads: int, resident_ctas: int,
              split_align: int, causal: bool = False, fixed_chunk: int | None = None,
              allow_split: bool = True, max_items: int | None = None,
              max_partial_rows: int | None = None, key_tile: int = 1) -> WorkPlan:
    """Items sorted longest first (the tail of the grid is then short).

    fixed_chunk: split every request with more keys than this into chunks of
    this many keys (rounded up to split_align). max_items: the grid the plan
    must fit (CUDA-graph capacity); max_partial_rows: the partial states the
    workspace holds. Chunks grow until both hold (the unsplit plan needs no
    partial state); ValueError if even the unsplit plan has too many items.
    key_tile: a tile's keys cost alike, seen or not (fa3's persistent grids,
    whose walk deal_positions balances in these costs); 1: by the key."""
    align = max(split_align, 1)
    base = tile_items(qo_lens, kv_lens, group=group, rows_per_cta=rows_per_cta, causal=causal, key_tile=key_tile)
    if max_items is not None and len(base) > max_items:
        raise ValueError(f"the batch needs {len(base)} CTAs per KV head, more than the {max_items} this wrapper's "
                         f"CUDA graph was sized for; create a new wrapper for the larger batch")

    chunk = 0
    if allow_split and base:
        if fixed_chunk is not None:
            chunk = ceil_div(max(int(fixed_chunk), 1), align) * align
        else:
            chunk = _best_chunk(base, max(1, resident_ctas), max(num_kv_heads, 1), align)
    while True:
        splits = {r: ceil_div(kv, chunk) if chunk else 1 for _, r, _, kv, _ in base}
        splits = {r: n if n > 1 else 1 for r, n in splits.items()}
        count = sum(splits[r] for _, r, _, _, _ in base)
        partial_rows = sum(qo_lens[r] * n for r, n in splits.items() if n > 1)
        if (max_items is None or count <= max_items) and (max_partial_rows is None or partial_rows <= max_partial_rows):
            break
        chunk *= 2  # fewer, longer chunks until the grid and the workspace hold them
    slots, heads = max(1, resident_ctas), max(num_kv_heads, 1)
    if all(n == 1 for n in splits.values()):
        return unsplit_plan(base, heads, slots)
    shared = any(t > 0 for _, _, t, _, _ in base)  # a request with several query tiles

    expanded = []  # (cost, request, tile, split)
    for cost, r, t, kv, _ in base:
        n = splits[r]
        if n == 1:
            expanded.append((cost, r, t, -1))
        else:
            for s in range(n):
                expanded.append((min(chunk, kv - s * chunk) + _ITEM_OVERHEAD, r, t, s))
    expanded.sort(key=lambda e: -e[0])
    items = [(r, t, s, chunk if s >= 0 else 0) for _, r, t, s in expanded]
    merge_indptr = [0]
    for request, qo_len in enumerate(qo_lens):
        n = splits.get(request, 1)
        per_token = n if n > 1 else 0
        for _ in range(qo_len):
            merge_indptr.append(merge_indptr[-1] + per_token)
    costs = tuple(e[0] for e in expanded)
    return WorkPlan(items, merge_indptr, merge_indptr[-1], chunk, choose_band_items(costs, heads, slots, shared),
                    costs=costs)


def launch_costs(costs, heads: int, band_items: int) -> list:
    """The cost of each launch position x: work slots in bands of band_items
    (0: one band), each band's slots for KV head 0, then head 1, ... (work.cuh
    decode_work_at). costs: per work slot."""
    per_band = band_items if 0 < band_items < len(costs) else max(len(costs), 1)
    by_position = []
    for first in range(0, len(costs), per_band):
        by_position.extend(list(costs[first:first + per_band]) * heads)
    return by_position


# A persistent grid takes the plan's walk (deal_positions) only where its own
# rounds would end more than this fraction past the balanced bound.
_DEAL_SLACK = 0.01


def rounds_time(by_position, ctas: int) -> int:
    """When the kernel's own rounds end (work.cuh CtaWalk without a walk): CTA j
    takes position j of even rounds and ctas - 1 - j of odd ones."""
    step = 2 * ctas
    return max(sum(by_position[j::step]) + sum(by_position[step - 1 - j::step]) for j in range(ctas))


def deal_positions(costs, heads: int, band_items: int, ctas: int) -> list | None:
    """A persistent grid's walk (work.cuh CtaWalk), or None where the kernel's
    own rounds are within _DEAL_SLACK of the balanced bound: the launch
    positions in launch order, each to the CTA whose positions so far cost
    least (ties: the lower CTA), as a work counter would hand them out, so
    that the CTAs that read one KV head's keys together (the bands) still run
    together. In the planner's costs the rounds end 3-45% past the bound on
    causal batches (most with grouped query heads), this within 2%
    (tests/test_plan_walk.py). Positions of zero cost (a CUDA graph's empty
    slots) are left out: no CTA visits them. Returns [ctas, ctas + 1 offsets,
    CTA 0's positions, CTA 1's, ...]."""
    by_position = launch_costs(costs, heads, band_items)
    if ctas <= 0 or len(by_position) <= ctas or min(costs) == max(costs):
        return None  # one position each, or equal ones: the rounds are as short as any walk
    rounds = rounds_time(by_position, ctas)
    if rounds <= (1 + _DEAL_SLACK) * max(sum(by_position) / ctas, max(by_position)):
        return None
    # A CTA's load and index as one int, load * ctas + cta, which orders as the
    # pair (load, cta) does: the heap then compares ints, not tuples (docs/fa3.md).
    loads = list(range(ctas))  # every load 0: sorted, so already a heap
    dealt = [[] for _ in range(ctas)]
    replace = heapq.heapreplace
    for x, cost in enumerate(by_position):
        if cost > 0:
            top = loads[0]
            dealt[top % ctas].append(x)
            replace(loads, top + cost * ctas)
    if max(loads) // ctas * (1 + _DEAL_SLACK) >= rounds:
        return None
    walk, first = [ctas], 0
    for positions in dealt:
        walk.append(first)
        first += len(positions)
    walk.append(first)
    for positions in dealt:
        walk.extend(positions)
    return walk


def walk_section(work: WorkPlan, items: int, heads: int, ctas: int, fixed: bool) -> list:
    """The plan's p.cta_walk ints for a persistent grid of `ctas` CTAs over
    `items` work slots (the plan's, then a CUDA graph's empty ones): [] where
    the kernel's rounds do (deal_positions). fixed (a CUDA graph, whose launch
    keeps the address): always the section's full length, [0, ...] when the
    rounds do, which no grid takes for a walk."""
    costs = list(work.costs) + [0] * (items - len(work.costs))
    walk = deal_positions(costs, heads, work.band_items, ctas) if len(work.costs) == len(work.items) else None
    if not fixed:
        return walk or []
    size = 2 + ctas + items * heads
    return (walk or [0]) + [0] * (size - len(walk or [0]))
