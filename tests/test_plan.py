"""The work planner (ops._plan): pure host arithmetic, no GPU."""

from __future__ import annotations

import heapq
import itertools

import pytest

from flashjit.ops._plan import MIN_CHUNK_KEYS, _item_cost, plan_work

H200 = dict(resident_ctas=132, split_align=64)  # 132 SMs, one CTA each


def covered(plan, qo_lens, kv_lens, group, rows):
    """Every (request, tile) appears with splits 0..n-1 (or -1 alone), and
    merge_indptr gives each token of a split request n partial rows."""
    seen = {}
    for request, tile, split, chunk in plan.items:
        seen.setdefault((request, tile), []).append((split, chunk))
    for r, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        for t in range(-(-qo * group // rows)):
            splits = sorted(seen.pop((r, t)))
            if splits == [(-1, 0)]:
                n = 0
            else:
                n = len(splits)
                assert splits == [(s, plan.kv_chunk) for s in range(n)] and (n - 1) * plan.kv_chunk < kv
            if plan.merge_indptr is not None:
                start = sum(qo_lens[:r])
                assert all(plan.merge_indptr[i + 1] - plan.merge_indptr[i] == n for i in range(start, start + qo))
    assert not seen, f"items for requests/tiles that do not exist: {seen}"


@pytest.mark.parametrize("qo_lens,kv_lens,group,rows,heads,expect_split", [
    ([1] * 64, [4096] * 64, 4, 4, 8, False),           # decode batch that fills the GPU
    ([1], [131072], 4, 4, 8, True),                     # one long decode
    ([1] * 8, [32768] * 8, 8, 16, 8, True),             # small batch, long contexts
    ([2000] + [100] * 6, [2000] + [100] * 6, 1, 64, 16, False),  # prefill: many tiles already
    ([3, 1, 20], [30000, 100, 9000], 4, 64, 2, True),
    ([0, 5], [100, 0], 1, 64, 4, False),
])
def test_plans_cover_every_tile_once(qo_lens, kv_lens, group, rows, heads, expect_split):
    plan = plan_work(qo_lens, kv_lens, group=group, rows_per_cta=rows, num_kv_heads=heads, **H200)
    covered(plan, qo_lens, kv_lens, group, rows)
    assert (plan.kv_chunk > 0) == expect_split
    if plan.kv_chunk:
        assert plan.kv_chunk % 128 == 0 and plan.kv_chunk >= MIN_CHUNK_KEYS
        assert plan.partial_rows == plan.merge_indptr[-1]


def test_items_run_longest_first():
    plan = plan_work([1, 1, 1], [10, 5000, 300], group=1, rows_per_cta=16, num_kv_heads=32, allow_split=False,
                     **H200)
    assert [item[0] for item in plan.items] == [1, 2, 0]


def test_fixed_chunk_and_disabled_split():
    fixed = plan_work([1], [1000], group=1, rows_per_cta=16, num_kv_heads=1, fixed_chunk=100, **H200)
    assert fixed.kv_chunk == 128 and len(fixed.items) == 8  # rounded up to the 64-key tile
    off = plan_work([1], [100000], group=1, rows_per_cta=16, num_kv_heads=1, allow_split=False, **H200)
    assert off.kv_chunk == 0 and off.merge_indptr is None and off.items == [(0, 0, -1, 0)]


@pytest.mark.parametrize("max_items", [1, 3, 10, 40])
def test_capacity_grows_chunks_until_the_plan_fits(max_items):
    plan = plan_work([1], [100000], group=1, rows_per_cta=16, num_kv_heads=1, max_items=max_items, **H200)
    assert len(plan.items) <= max_items
    covered(plan, [1], [100000], 1, 16)


def test_capacity_smaller_than_the_batch_is_an_error():
    with pytest.raises(ValueError, match="CUDA graph was sized for"):
        plan_work([1] * 5, [10] * 5, group=1, rows_per_cta=16, num_kv_heads=1, max_items=4, **H200)


@pytest.mark.parametrize("causal", [False, True])
def test_causal_costs_shrink_with_the_tile(causal):
    plan = plan_work([256], [256], group=1, rows_per_cta=64, num_kv_heads=64, causal=causal, **H200)
    tiles = [item[1] for item in plan.items]
    assert sorted(tiles) == [0, 1, 2, 3]
    if causal:
        assert tiles == [3, 2, 1, 0]


def test_random_batches_are_covered():
    import random

    rng = random.Random(7)
    for _ in range(200):
        b = rng.randint(1, 12)
        qo = [rng.choice([0, 1, 1, 7, 64, 300]) for _ in range(b)]
        kv = [rng.choice([0, 1, 100, 5000, 40000]) for _ in range(b)]
        group, rows, heads = rng.choice([1, 4, 8]), rng.choice([4, 16, 64, 128]), rng.choice([1, 2, 8, 32])
        plan = plan_work(qo, kv, group=group, rows_per_cta=rows, num_kv_heads=heads, **H200)
        covered(plan, qo, kv, group, rows)


def test_a_small_workspace_means_longer_chunks():
    roomy = plan_work([1] * 4, [50000] * 4, group=1, rows_per_cta=16, num_kv_heads=8, **H200)
    tight = plan_work([1] * 4, [50000] * 4, group=1, rows_per_cta=16, num_kv_heads=8, max_partial_rows=8, **H200)
    assert roomy.partial_rows > 8 >= tight.partial_rows and tight.kv_chunk > roomy.kv_chunk
    none = plan_work([1] * 4, [50000] * 4, group=1, rows_per_cta=16, num_kv_heads=8, max_partial_rows=0, **H200)
    assert none.merge_indptr is None


def test_more_resident_ctas_mean_more_chunks():
    """A full wave of the GPU is the target: an SM that holds more CTAs wants more of them."""
    one = plan_work([1], [131072], group=4, rows_per_cta=16, num_kv_heads=8, resident_ctas=132, split_align=64)
    three = plan_work([1], [131072], group=4, rows_per_cta=16, num_kv_heads=8, resident_ctas=3 * 132,
                      split_align=64)
    assert len(three.items) > len(one.items) > 1


def launch_order(costs, heads, per_band):
    """Per-CTA costs in launch order for bands of per_band slots (work.cuh)."""
    per_band = per_band or len(costs)
    return [c for first in range(0, len(costs), per_band) for _ in range(heads) for c in costs[first:first + per_band]]


def greedy_makespan(order, slots):
    """Each CTA starts on the first slot to free up, as the hardware launches them."""
    free = [0.0] * slots
    for cost in order:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def test_decode_runs_the_kv_heads_of_a_request_together():
    """One query tile per request: no CTAs share keys, so the heads of a request
    run together (bands of one slot), split or not."""
    for kv_len in (4096, 200):
        plan = plan_work([1] * 64, [kv_len] * 64, group=4, rows_per_cta=16, num_kv_heads=8, resident_ctas=396,
                         split_align=64)
        assert plan.band_items == 1
    assert plan_work([1] * 64, [4096] * 64, group=4, rows_per_cta=16, num_kv_heads=1, resident_ctas=396,
                     split_align=64).band_items == 0


def test_non_causal_prefill_keeps_each_kv_head_together():
    """Equal costs: one band, the CTAs that read one KV head's keys run at once."""
    plan = plan_work([4096] * 4, [4096] * 4, group=1, rows_per_cta=128, num_kv_heads=16, resident_ctas=264,
                     split_align=64)
    assert plan.band_items == 0


@pytest.mark.parametrize("batch,seqlen", [(16, 1024), (4, 4096), (1, 16384)])
@pytest.mark.parametrize("rows", [64, 128])
def test_causal_bands_keep_the_tail_short(batch, seqlen, rows):
    """Causal tiles cost more the later they sit: the chosen bands finish within
    a few percent of a balanced grid under greedy launch, where one band of
    128-row tiles leaves the last head's longest tiles to the end."""
    heads, slots = 16, 264
    plan = plan_work([seqlen] * batch, [seqlen] * batch, group=1, rows_per_cta=rows, num_kv_heads=heads,
                     resident_ctas=slots, split_align=64, causal=True)
    costs = [_item_cost(seqlen, seqlen, t, rows, 1, True) for _, t, _, _ in plan.items]
    balanced = sum(costs) * heads / slots
    assert greedy_makespan(launch_order(costs, heads, plan.band_items), slots) <= 1.03 * balanced
    if rows == 128:
        assert plan.band_items > 0
        assert greedy_makespan(launch_order(costs, heads, 0), slots) > 1.08 * balanced
