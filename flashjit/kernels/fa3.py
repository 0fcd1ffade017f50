"""The fa3 backend (templates/include/flashjit/fa3/): Hopper prefill on
warpgroup MMA (wgmma) with K/V by TMA and warp specialization, built for
sm_90a alone. Design and measurements: docs/fa3.md."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import DECODE_OPS, KernelSpec
from . import common

TEMPLATE = "attention_fa3.cu.jinja"
MLA_TEMPLATE = "attention_mla_fa3.cu.jinja"
# wgmma and setmaxnreg exist only in the arch-specific sm_90a target.
ARCHES = frozenset({"sm_90a"})


@dataclass(frozen=True)
class Fa3Tiling:
    """A CTA of one loader and `consumers` consumer warpgroups of 64 query rows
    each (fa3_traits.cuh), K/V tiles of keys_per_tile keys in a ring of `stages` slots."""
    keys_per_tile: int
    stages: int
    # Tile t's Q.K^T in flight with tile t - 1's P.V, the softmax between them
    # (fa3_traits.cuh kOverlap).
    overlap: bool = False
    # One CTA per SM walking the launch positions (fa3_traits.cuh kPersistent).
    persistent: bool = False
    consumers: int = 2
    # An FP8 cache: (K, V) pairs of code slots the loader copies into and
    # widens from (fa3_fp8.cuh Fa3Fp8Traits); 0 for K/V of q's dtype.
    code_stages: int = 0
    # Q buffers per consumer warpgroup: 2 copies a persistent CTA's next
    # position's Q while the current one runs (fa3_traits.cuh Fa3QPrefetchTraits).
    q_buffers: int = 1
    # The two consumer warpgroups take turns issuing their products
    # (fa3_traits.cuh Fa3PingPongTraits): overlapped tilings of 16-bit K/V.
    pingpong: bool = False

    def __post_init__(self):
        if self.q_buffers not in (1, 2) or (self.q_buffers == 2 and (not self.persistent or self.code_stages)):
            raise ValueError(f"Fa3Tiling.q_buffers: 1, or 2 on a persistent grid of 16-bit K/V; got {self}")
        if self.pingpong and (not self.overlap or self.consumers != 2 or self.code_stages):
            raise ValueError(f"Fa3Tiling.pingpong: two overlapped consumer warpgroups over 16-bit K/V; got {self}")

    @property
    def rows_per_cta(self) -> int:
        return 64 * self.consumers

    def rescales(self, spec: KernelSpec) -> tuple[int, int]:
        """(keys per online-softmax rescale, merge rescales): one step per tile."""
        return self.keys_per_tile, 0

    def smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of Fa3Traits::kSmemBytes (and Fa3Fp8Traits', Fa3QPrefetchTraits'):
        alignment slack, K/V ring, Q (q_buffers of it), FP8 code slots, mbarriers."""
        row, v_row = common.row_pitch(spec.head_dim_qk), common.row_pitch(spec.head_dim_vo)
        codes = 2 * self.code_stages * (self.keys_per_tile * spec.head_dim_qk + 8)
        return 1024 + self.stages * self.keys_per_tile * (row + v_row) + self.q_buffers * self.rows_per_cta * row \
            + 32 * self.stages + codes


# Per head_dim: every head_dim overlaps tile t's Q.K^T with tile t - 1's P.V
# (the softmax of one tile runs while the other's product is on the tensor
# cores). S takes keys_per_tile / 2 fp32 registers per consumer thread and O
# head_dim / 2: d256 keeps 64-key tiles within the 232 registers a consumer
# gets. d64 takes a third stage; d128's third would leave no gain for 230 KB.
# d64 and d128 run a persistent grid; d256, one CTA per position, lets the
# hardware assign its longer positions. d192 (and 192/128) takes d256's tiling
# with the third stage its smaller rows leave room for. d96 runs on d128's
# tiles (its last 64-column block half data: fa3_traits.cuh), so it takes d128's
# tiling. Measurements: docs/fa3.md, "Tilings and why".
FA3_TILINGS = {
    64: Fa3Tiling(keys_per_tile=128, stages=3, overlap=True, persistent=True),
    96: Fa3Tiling(keys_per_tile=128, stages=2, overlap=True, persistent=True),
    128: Fa3Tiling(keys_per_tile=128, stages=2, overlap=True, persistent=True),
    192: Fa3Tiling(keys_per_tile=64, stages=3, overlap=True),
    256: Fa3Tiling(keys_per_tile=64, stages=2, overlap=True),
}


# Decode (batch-invariant mode's, ops/_invariant.py): the prefill tilings' key
# tiles, on which a row's arithmetic depends, with one consumer warpgroup, whose
# 64 rows hold a KV head's query heads (a second would multiply rows of padding,
# which ran slower than fa2's split-keys decode), and a deeper ring in the shared
# memory it frees (docs/fa3.md, "What it generates").
FA3_DECODE_TILINGS = {
    64: Fa3Tiling(keys_per_tile=128, stages=4, overlap=True, persistent=True, consumers=1),
    96: Fa3Tiling(keys_per_tile=128, stages=3, overlap=True, persistent=True, consumers=1),
    128: Fa3Tiling(keys_per_tile=128, stages=3, overlap=True, persistent=True, consumers=1),
    192: Fa3Tiling(keys_per_tile=64, stages=3, overlap=True, persistent=True, consumers=1),
    256: Fa3Tiling(keys_per_tile=64, stages=3, overlap=True, persistent=True, consumers=1),
}


# An FP8 cache (prefill): the 16-bit tilings' key tiles, consumers and grids.
# The ring of widened tiles keeps its stages (d192 gives its third up to code
# slots), and (K, V) pairs of code slots take the shared memory left (d64: four
# of the nine that would fit), so that copies stay in flight while the loader
# widens a tile. Not timed yet (docs/fp8.md, "fa3").
FA3_FP8_TILINGS = {
    64: Fa3Tiling(keys_per_tile=128, stages=3, overlap=True, persistent=True, code_stages=4),
    128: Fa3Tiling(keys_per_tile=128, stages=2, overlap=True, persistent=True, code_stages=2),
    192: Fa3Tiling(keys_per_tile=64, stages=2, overlap=True, code_stages=3),
    256: Fa3Tiling(keys_per_tile=64, stages=2, overlap=True, code_stages=1),
}


def tiling(spec: KernelSpec, arches=None) -> Fa3Tiling:
    if common.DTYPE_BYTES[spec.dtype_kv] == 1:
        tilings = FA3_FP8_TILINGS
    else:
        tilings = FA3_DECODE_TILINGS if spec.op in DECODE_OPS else FA3_TILINGS
    chosen = tilings[spec.head_dim_qk]
    assert chosen.smem_bytes(spec) + common.SMEM_RESERVED_PER_CTA <= common.SMEM_PER_SM["sm_90a"], spec.name
    return chosen


@dataclass(frozen=True)
class Fa3MlaTiling:
    """The fa3 MLA kernel (fa3/fa3_mla.cuh): one loader and two consumer
    warpgroups over 64 packed rows; one consumer computes each 64-key tile's
    Q.K^T and softmax, both multiply P by their half of O's 512 columns. Keys
    per tile and rows per CTA are fixed by the wgmma shapes (the template
    checks them). key_groups: what the softmax consumer's S waits for, the
    whole tile (1) or each of that many groups of its nine 64-column blocks as
    it lands (3: named barriers the loader arrives at, Fa3MlaTraits).
    early_release: the softmax consumer gives a tile's slot back as its P.V of
    the tile lands, not once the next tile's S has landed too. tma: whole
    tiles in pages of 64 keys or more come by TMA boxes, not cp.async.
    pairs: where every tile comes by TMA (pages of a multiple of 64 keys) and
    a launch has more than 64 heads, run fa3/fa3_mla_pairs.cuh instead: two
    computing warpgroups, each the S and softmax of every other tile and half of
    O, and a producer warpgroup that issues their refills."""
    stages: int
    keys_per_tile: int = 64
    rows_per_cta: int = 64
    key_groups: int = 1
    early_release: bool = False
    tma: bool = False
    pairs: bool = False

    def rescales(self, spec: KernelSpec) -> tuple[int, int]:
        """(keys per online-softmax rescale, merge rescales): one step per tile;
        both halves of O take the softmax consumer's factors: no merge."""
        return self.keys_per_tile, 0

    def smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of Fa3MlaTraits::kSmemBytes: alignment slack, Q, the K/V ring
        (P lives in a slot's kpe block), the rescale factors and row sums,
        mbarriers (with TMA, one more per stage and key group)."""
        tile = self.keys_per_tile * 2 * spec.head_dim_qk
        group_bars = 8 * self.stages * self.key_groups if self.tma else 0
        return 1024 + (1 + self.stages) * tile + 3 * self.rows_per_cta * 4 + 16 * self.stages + group_bars

    def pairs_smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of Fa3MlaTraits::kPairSmemBytes (the pairs kernel): alignment
        slack, Q and two tiles, each warpgroup's row maxima, factors and sums,
        an mbarrier per tile slot and 64-column block, one per hand-off and one
        per refill."""
        tile = self.keys_per_tile * 2 * spec.head_dim_qk
        return 1024 + 3 * tile + 3 * 2 * self.rows_per_cta * 4 + 8 * (2 * (spec.head_dim_qk // 64) + 5 + 4)


# Two stages: Q and two 72 KB tiles of [ckv | kpe] rows fill the SM's shared memory.
# Key groups of three blocks: S starts on the blocks that landed instead of
# waiting for whole tiles. Slots given back as their P.V lands. TMA boxes for
# whole tiles in pages of 64 keys or more (the launch decides). Pairs
# (fa3/fa3_mla_pairs.cuh) for launches of more than 64 heads whose tiles all
# come by TMA, with a producer warpgroup issuing their refills. Each choice and
# its measurement: docs/mla.md, "Tilings and why".
MLA_TILING = Fa3MlaTiling(stages=2, key_groups=3, early_release=True, tma=True, pairs=True)
# An FP8 cache: the loader kernel at every head count. Its codes land in the
# upper half of the slot they are widened into, so the shared memory stays the
# 16-bit tiling's; the pairs kernel, whose slots are refilled block by block
# and whose producer warpgroup holds 24 registers, has no room or hands for the
# widening (docs/mla.md, "FP8 caches").
MLA_FP8_TILING = Fa3MlaTiling(stages=2, key_groups=3, early_release=True, tma=True, pairs=False)


def mla_tiling(spec: KernelSpec) -> Fa3MlaTiling:
    chosen = MLA_FP8_TILING if common.DTYPE_BYTES[spec.dtype_kv] == 1 else MLA_TILING
    assert chosen.smem_bytes(spec) + common.SMEM_RESERVED_PER_CTA <= common.SMEM_PER_SM["sm_90a"], spec.name
    return chosen
