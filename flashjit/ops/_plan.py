"""Work plans for batched launches: which CTA computes which query rows of
which request against which keys (FlashjitWorkItem in attention_params.cuh).

Pure host-side arithmetic, kept apart from tensors so that it can be tested
without a GPU. The split-KV rule: when the longest work item costs more than
the GPU's share of the whole batch (total cost over one full wave of CTAs),
long items are cut into chunks of about that share, so that one long request
(decode at 128k keys, or a few long requests in a small batch) does not leave
the GPU idle while it finishes. A merge pass then combines the chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

# A chunk covers at least this many keys: below it, writing and merging fp32
# partial states costs more than the parallelism gains.
MIN_CHUNK_KEYS = 512
# Default chunks are multiples of this many keys (and of the kernel's tile).
CHUNK_ALIGN = 128


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WorkPlan:
    items: list            # (request, tile, split, chunk); split -1: all keys, output written directly
    merge_indptr: list | None  # [tokens + 1] partial rows per query token, None when nothing is split
    partial_rows: int      # rows of partial state (each num_qo_heads x head_dim fp32 plus an LSE)
    kv_chunk: int          # keys per chunk of the split requests, 0 when none is split


def _item_cost(qo_len: int, kv_len: int, tile: int, rows_per_cta: int, group: int, causal: bool) -> int:
    """Keys the tile's last row can see (plus a constant for the tile's own work)."""
    if causal:
        last_query = min((tile + 1) * rows_per_cta, qo_len * group) // group
        kv_len = max(0, min(kv_len, kv_len - qo_len + last_query))
    return kv_len + 64


def plan_work(qo_lens, kv_lens, *, group: int, rows_per_cta: int, num_kv_heads: int, num_sms: int,
              split_align: int, ctas_per_sm: int = 1, causal: bool = False, fixed_chunk: int | None = None, allow_split: bool = True,
              max_items: int | None = None, max_partial_rows: int | None = None) -> WorkPlan:
    """Items sorted longest first (the tail of the grid is then short).

    fixed_chunk: split every request with more keys than this into chunks of
    this many keys (rounded up to split_align). max_items: the grid the plan
    must fit (CUDA-graph capacity); max_partial_rows: the partial states the
    workspace holds. Chunks grow until both hold (the unsplit plan needs no
    partial state); ValueError if even the unsplit plan has too many items."""
    align = max(split_align, 1)
    base = []  # (cost, request, tile, kv_len)
    for request, (qo_len, kv_len) in enumerate(zip(qo_lens, kv_lens)):
        for tile in range(ceil_div(qo_len * group, rows_per_cta)):
            base.append((_item_cost(qo_len, kv_len, tile, rows_per_cta, group, causal), request, tile, kv_len))
    if max_items is not None and len(base) > max_items:
        raise ValueError(f"the batch needs {len(base)} CTAs per KV head, more than the {max_items} this wrapper's "
                         f"CUDA graph was sized for; create a new wrapper for the larger batch")

    chunk = 0
    if allow_split and base:
        if fixed_chunk is not None:
            chunk = ceil_div(max(int(fixed_chunk), 1), align) * align
        else:
            # CTAs per KV head in one full wave of the GPU: on an H200, two waves
            # (chunks half as long) read 1x128k decode at 2574 GB/s against 3078.
            slots = max(1, num_sms * ctas_per_sm // max(num_kv_heads, 1))
            share = ceil_div(sum(cost for cost, *_ in base), slots)
            if max(cost for cost, *_ in base) > share:
                chunk = ceil_div(max(share, MIN_CHUNK_KEYS), max(align, CHUNK_ALIGN)) * max(align, CHUNK_ALIGN)
    while True:
        splits = {r: ceil_div(kv, chunk) if chunk else 1 for _, r, _, kv in base}
        splits = {r: n if n > 1 else 1 for r, n in splits.items()}
        count = sum(splits[r] for _, r, _, _ in base)
        partial_rows = sum(qo_lens[r] * n for r, n in splits.items() if n > 1)
        if (max_items is None or count <= max_items) and (max_partial_rows is None or partial_rows <= max_partial_rows):
            break
        chunk *= 2  # fewer, longer chunks until the grid and the workspace hold them
    if all(n == 1 for n in splits.values()):
        items = [(r, t, -1, 0) for _, r, t, _ in sorted(base, key=lambda b: -b[0])]
        return WorkPlan(items, None, 0, 0)

    expanded = []  # (cost, request, tile, split)
    for cost, r, t, kv in base:
        n = splits[r]
        if n == 1:
            expanded.append((cost, r, t, -1))
        else:
            for s in range(n):
                expanded.append((min(chunk, kv - s * chunk) + 64, r, t, s))
    expanded.sort(key=lambda e: -e[0])
    items = [(r, t, s, chunk if s >= 0 else 0) for _, r, t, s in expanded]
    merge_indptr = [0]
    for request, qo_len in enumerate(qo_lens):
        n = splits.get(request, 1)
        per_token = n if n > 1 else 0
        for _ in range(qo_len):
            merge_indptr.append(merge_indptr[-1] + per_token)
    return WorkPlan(items, merge_indptr, merge_indptr[-1], chunk)
