"""A persistent grid's walk (ops._plan.deal_positions, work.cuh CtaWalk): the
positions each CTA takes, dealt in launch order to the CTA that ends soonest in
the planner's costs. CPU only: the plan's arithmetic and the section's layout."""

import pytest

from flashjit.ops._plan import (deal_positions, launch_costs, plan_work, rounds_time, walk_section)

SMS = 132


def decode_position(x: int, items: int, heads: int, band_items: int) -> tuple[int, int]:
    """(work slot, KV head) of launch position x, as work.cuh decode_work_at has it."""
    per_band = band_items if 0 < band_items < items else items
    first = x // (per_band * heads) * per_band
    in_band = min(per_band, items - first)
    r = x - first * heads
    return first + r % in_band, r // in_band


def cta_lists(walk: list) -> list[list[int]]:
    ctas = walk[0]
    return [walk[2 + ctas + walk[1 + j]:2 + ctas + walk[2 + j]] for j in range(ctas)]


def plan(lens, group, kv_heads, causal=True, key_tile=128):
    """fa3's plan (128 rows, tiles of 128 keys) on an H100's SMS CTAs."""
    return plan_work(lens, lens, group=group, rows_per_cta=128, num_kv_heads=kv_heads, resident_ctas=SMS,
                     split_align=128, causal=causal, allow_split=False, key_tile=key_tile)


# (query/key lengths, query heads per KV head, KV heads): the prefill table's
# 1k and 4k rows and its skewed batch, with grouped heads and without.
CAUSAL_BATCHES = [([1024] * 16, 4, 8), ([4096] * 4, 4, 8), ([8192] + [512] * 16, 4, 8), ([1024] * 16, 8, 4),
                  ([16384] + [100] * 64, 1, 16), ([2048] * 8, 1, 16), ([512] * 128, 4, 8)]


@pytest.mark.parametrize("band_items", [0, 1, 3, 5])
def test_launch_costs_follow_the_kernels_launch_order(band_items):
    costs = [50, 40, 40, 30, 20, 10, 5]
    heads = 3
    by_position = launch_costs(costs, heads, band_items)
    assert len(by_position) == len(costs) * heads
    for x, cost in enumerate(by_position):
        slot, head = decode_position(x, len(costs), heads, band_items)
        assert 0 <= head < heads and cost == costs[slot]


@pytest.mark.parametrize("key_tile", [1, 128])
@pytest.mark.parametrize("lens, group, kv_heads", CAUSAL_BATCHES)
def test_walk_takes_every_position_once_and_balances(lens, group, kv_heads, key_tile):
    work = plan(lens, group, kv_heads, key_tile=key_tile)
    by_position = launch_costs(work.costs, kv_heads, work.band_items)
    ctas = min(len(by_position), SMS)
    walk = deal_positions(work.costs, kv_heads, work.band_items, ctas)
    bound = max(sum(by_position) / ctas, max(by_position))
    if walk is None:  # the kernel's rounds are close enough
        assert rounds_time(by_position, ctas) <= 1.01 * bound
        return
    assert walk[0] == ctas and walk[1] == 0 and walk[1 + ctas] == len(by_position)
    lists = cta_lists(walk)
    assert sorted(x for positions in lists for x in positions) == list(range(len(by_position)))
    # Launch order within each CTA (the bands' L2 grouping), and the balance.
    assert all(positions == sorted(positions) for positions in lists)
    ends = [sum(by_position[x] for x in positions) for positions in lists]
    assert max(ends) <= 1.02 * bound < rounds_time(by_position, ctas)


def test_grouped_heads_rounds_end_far_past_the_bound():
    """Why the walk exists: with four query heads per KV head the rounds of
    a 16 x 1k causal batch end 20% past the balanced bound in these costs."""
    work = plan([1024] * 16, 4, 8)
    by_position = launch_costs(work.costs, 8, work.band_items)
    bound = max(sum(by_position) / SMS, max(by_position))
    assert rounds_time(by_position, SMS) > 1.15 * bound
    assert deal_positions(work.costs, 8, work.band_items, SMS) is not None


def test_rounds_time_is_the_kernels_rounds():
    by_position = [9, 8, 8, 7, 5, 5, 3, 2, 2, 1, 1]
    ctas = 4
    ends = [0] * ctas
    for x, cost in enumerate(by_position):
        round_, j = divmod(x, ctas)
        ends[ctas - 1 - j if round_ % 2 else j] += cost
    assert rounds_time(by_position, ctas) == max(ends)


def test_no_walk_for_balanced_or_single_wave_grids():
    work = plan([1024] * 16, 4, 8, causal=False)  # equal costs: the rounds are the bound
    assert deal_positions(work.costs, 8, work.band_items, SMS) is None
    small = plan([256] * 4, 1, 8)  # 64 positions on 132 CTAs: one each
    assert deal_positions(small.costs, 8, small.band_items, SMS) is None


def test_graph_section_keeps_its_length_and_leaves_empty_slots_out():
    work = plan([1024] * 16, 4, 8)
    items = len(work.items) + 40  # a CUDA graph's grid: the plan's items, then empty ones
    section = walk_section(work, items, 8, SMS, fixed=True)
    assert len(section) == 2 + SMS + items * 8
    lists = cta_lists(section)
    taken = sorted(x for positions in lists for x in positions)
    assert len(taken) == len(work.items) * 8 and len(set(taken)) == len(taken)
    assert all(decode_position(x, items, 8, work.band_items)[0] < len(work.items) for x in taken)
    balanced = plan([1024] * 16, 4, 8, causal=False)
    rounds = walk_section(balanced, len(balanced.items) + 40, 8, SMS, fixed=True)
    assert rounds[0] == 0 and len(rounds) == 2 + SMS + (len(balanced.items) + 40) * 8  # no grid takes ctas = 0
    assert walk_section(balanced, len(balanced.items), 8, SMS, fixed=False) == []
