"""The fa2 backend (templates/include/flashjit/fa2/): mma.sync tensor cores,
ldmatrix and cp.async on SM80+, K/V by TMA where every target is sm_90a. The
tilings below and the measurements behind each choice: docs/fa2.md, "Tilings
and why" and "Measured and not kept"."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..spec import DECODE_OPS, PAGED_OPS, KernelSpec
from . import common

TEMPLATE = "attention_fa2.cu.jinja"
MLA_TEMPLATE = "attention_mla_fa2.cu.jinja"


@dataclass(frozen=True)
class Fa2Tiling:
    warps: int
    keys_per_tile: int
    stages: int
    q_in_regs: bool
    min_blocks_per_sm: int
    # m16 row fragments per warp (1 or 2): rows per warp = 16 * frags_m, and
    # each K / V fragment read from shared memory feeds frags_m mma's.
    frags_m: int = 1
    # Warps split each tile's keys (and merge their states at the end) instead
    # of the rows: for decode, whose rows are one KV head's query heads.
    split_keys: bool = False
    # The math walks each tile in this many steps of keys_per_tile / sub_tiles
    # keys (S registers for one step), with copies and barriers per tile.
    sub_tiles: int = 1
    # One cp.async wait and CTA barrier per tile for K and V together (at the top
    # of the tile) instead of one for K there and one for V before P.V. Rows-split
    # mode only; ignored with split_keys.
    one_wait: bool = False
    # A warp fence between the softmax and P.V (fa2_traits.cuh kFencePv): keeps
    # the exponentials out of the P.V mma stream where the tiling has no
    # registers to spare for that interleave.
    fence_pv: bool = False
    # sm_90a only: K/V tiles loaded by the TMA unit (one thread issues a tile, an
    # mbarrier per stage) instead of every thread's cp.async; ragged K/V in
    # rows-split mode only (fa2_traits.cuh kTmaKv).
    tma_kv: bool = False
    # With tma_kv: warps hand each ring slot back through a per-stage mbarrier,
    # which the slot's next load waits on, instead of a CTA barrier per tile
    # (fa2_traits.cuh kSlotRelease).
    slot_release: bool = False
    # Decode only (0: off): with one query head per KV head (MHA), a second
    # instantiation of the kernel under this register cap runs instead.
    mha_min_blocks_per_sm: int = 0
    # The kernel (attention_fa2.cu.jinja): fa2_attention.cuh's; Fa2ColumnSplitTiling's is the other.
    column_split: ClassVar[bool] = False

    @property
    def rows_per_cta(self) -> int:
        return 16 * self.frags_m * (1 if self.split_keys else self.warps)

    def rescales(self, spec: KernelSpec) -> tuple[int, int]:
        """(keys per rescale, merge rescales): one rescale per step of keys (a warp
        that splits keys rescales once per tile too), and in split-keys mode the
        merge of the warps' states."""
        return self.keys_per_tile // self.sub_tiles, (1 if self.split_keys else 0)

    def smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of Fa2Traits::kSmemBytes (fa2_traits.cuh): Q tile + K/V stages,
        and with an FP8 cache stages of codes and the widened K/V pair; 16-bit
        rows take whole 128-byte blocks (kPitchBytes), FP8 code rows head_dim bytes."""
        d, dv = spec.head_dim_qk, spec.head_dim_vo
        pitch, v_pitch = common.row_pitch(d), common.row_pitch(dv)
        kv_bytes = common.DTYPE_BYTES[spec.dtype_kv]
        stage_rows = d + dv if kv_bytes == 1 else pitch + v_pitch
        size = self.rows_per_cta * pitch + self.stages * self.keys_per_tile * stage_rows
        if kv_bytes == 1:
            return size + self.keys_per_tile * (pitch + v_pitch)
        if self.tma_kv and spec.op not in PAGED_OPS and not self.split_keys:
            # The stages' 1024-byte alignment, and their mbarriers (two each with slot_release).
            size += 1024 - 128 + 8 * (2 if self.slot_release else 1) * self.stages
        return size


@dataclass(frozen=True)
class Fa2ColumnSplitTiling:
    """The fa2 kernel for head dims whose O one warp cannot hold (512: 16 rows
    x 512 fp32 columns are 256 registers a lane; fa2/fa2_column_split.cuh): one
    m16 fragment of rows per CTA shared by `warps` warps, which split Q.K^T by
    head dims (their partial logits summed in shared memory) and O by columns;
    K/V tiles of keys_per_tile keys in `stages`. Decode and prefill alike."""
    warps: int
    keys_per_tile: int
    stages: int
    min_blocks_per_sm: int
    column_split: ClassVar[bool] = True

    @property
    def rows_per_cta(self) -> int:
        return 16

    def rescales(self, spec: KernelSpec) -> tuple[int, int]:
        """(keys per rescale, merge rescales): the lazy max moves at most once a
        tile; every warp runs the same softmax, so there is no merge."""
        return self.keys_per_tile, 0

    def smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of Fa2ColumnSplitTraits::kSmemBytes: Q (later the logit
        exchange), the stages (FP8: code rows, head_dim bytes), the widened K/V pair (FP8)."""
        d, fp8 = spec.head_dim_qk, common.DTYPE_BYTES[spec.dtype_kv] == 1
        head = max(16 * 2 * d, self.warps * 16 * self.keys_per_tile * 4)
        stages = self.stages * 2 * self.keys_per_tile * (d if fp8 else 2 * d)
        return head + stages + (2 * self.keys_per_tile * 2 * d if fp8 else 0)


# 512: four warps of 128 O columns (64 registers a lane) and eight Q.K^T
# k-steps (Q in 32 registers); 16-key tiles in two stages, 80 KB with Q (FP8:
# code stages and the widened pair, 80 KB too), two CTAs per SM on sm_80 and
# sm_90a, one on sm_89. Decode, batch-invariant decode and paged prefill take it.
# Not yet tuned on a GPU.
FA2_COLUMN_SPLIT_512 = Fa2ColumnSplitTiling(warps=4, keys_per_tile=16, stages=2, min_blocks_per_sm=2)


# Per head_dim: tiles that build without spills on sm_80/89/90a and fit
# SMEM_BUDGET. d64 runs two m16 fragments per warp (32 rows, 128 per CTA), so
# each K / V fragment read by ldmatrix feeds two mma's. d128 keeps one fragment
# over 64-key tiles: two fragments need 96 KB, which leaves one CTA per SM on an
# A100. d256 has one fragment (its 128 O registers leave no room). d128 and d256
# wait for K and V together at the top of each tile (one_wait: one CTA barrier
# per tile instead of two); d64 keeps two waits: one gains it little and spills with soft-cap.
# Ragged d64/d128/d256 prefill may take FA2_WIDE_TILINGS (below). Measurements:
# docs/fa2.md, "Tilings and why".
FA2_TILINGS = {
    64: Fa2Tiling(warps=4, keys_per_tile=64, stages=2, q_in_regs=True, min_blocks_per_sm=2, frags_m=2),
    128: Fa2Tiling(warps=4, keys_per_tile=64, stages=2, q_in_regs=True, min_blocks_per_sm=2, frags_m=1, one_wait=True),
    256: Fa2Tiling(warps=4, keys_per_tile=32, stages=2, q_in_regs=False, min_blocks_per_sm=2, frags_m=1, one_wait=True),
    512: FA2_COLUMN_SPLIT_512,
}


# Decode (one query token per request): the rows are only the query heads of
# one KV head, so the four warps split each tile's keys (16 each), copy their
# own rows (no CTA barrier in the loop) and merge their softmax states at the
# end; with rows split, one warp would do all the math while three waited at
# its barriers. d128 runs two CTAs per SM, which lets a 64 x 4k GQA batch run
# unsplit in under two waves; MHA (one query head per KV head) runs a second
# instantiation at three per SM (168 registers), which reads faster there. Its
# Q stays in shared memory. d64 and d256 follow the same scheme, sized to fit;
# not tuned on a GPU. Measurements: docs/fa2.md, "Decode: split-keys mode" and
# "Tilings and why".
FA2_DECODE_TILINGS = {
    64: Fa2Tiling(warps=4, keys_per_tile=64, stages=4, q_in_regs=True, min_blocks_per_sm=2, split_keys=True),
    128: Fa2Tiling(warps=4, keys_per_tile=64, stages=2, q_in_regs=False, min_blocks_per_sm=2, split_keys=True,
                   mha_min_blocks_per_sm=3),
    256: Fa2Tiling(warps=2, keys_per_tile=32, stages=2, q_in_regs=False, min_blocks_per_sm=2, split_keys=True),
    512: FA2_COLUMN_SPLIT_512,
}

# An FP8 cache's decode at d128 (and the head dims that take its tiling): three
# CTAs per SM for every group size. A tile's time is its widening pass
# (fa2_fp8.cuh), a warp's instructions rather than the bytes in flight, so
# more warps per SM ran 7-10% faster on the large rows while a third stage did
# not help (docs/fp8.md, "Speed").
FA2_FP8_DECODE_TILINGS = {
    128: Fa2Tiling(warps=4, keys_per_tile=64, stages=2, q_in_regs=False, min_blocks_per_sm=3, split_keys=True),
}


# The tiling a head dim takes: that of the smallest of 64, 128 and 256 that
# holds it. Its registers (Q, O and S fragments scale with the head dim) and
# shared memory (rows padded to whole 128-byte blocks) are at most those of
# that head dim, which builds without spills (docs/fa2.md, "Head dims"). 512
# (spec.WIDE_HEAD_DIMS) takes its own.
def tiling_head_dim(head_dim: int) -> int:
    return next(d for d in sorted(FA2_TILINGS) if d >= head_dim)


# Prefill tilings for libraries whose every target is an sm_90a part (the arch
# on which they were built without spills and measured) holding
# min_blocks_per_sm of their CTAs per SM.
#
# d64: FA2_TILINGS[64] with one K/V wait per tile, over 128-key tiles loaded by
# TMA in two stages (80 KB), each walked in two 64-key steps: one wait, barrier
# and load per 128 keys. With Q in registers it has room to run the
# exponentials, row sums and P rounding inside the P.V mma stream (no
# fence_pv). On sm_80 / sm_89 the source spills with causal or window masks;
# paged K/V spills too. On sm_90a it builds without spills with every flag set.
#
# d128: two CTAs of a wider tiling per SM, with two fragments per warp (128-row
# CTAs, half the ldmatrix traffic per mma). Its loop sits at the 255-register
# cap, which the lean-loop forms (fa2_attention.cuh kLeanLoop) relieve. Its
# 96 KB leave one CTA per SM on an A100 or an SM89 part, so a library built for
# those keeps FA2_TILINGS. Not for paged K/V (the page ids of two tiles push it
# past 255 registers: spills on sm_90a) nor with soft-cap and window together.
#
# d256: eight warps of one fragment (128-row CTAs) over 64-key tiles in 2 stages,
# 192 KB, one CTA per SM: each K/V tile in shared memory feeds eight warps, and
# the softmax runs once per 64 keys. It rescales half as often as
# FA2_TILINGS[256], whose count the tolerance profile takes: an upper bound.
# Its warps hand ring slots back through mbarriers instead of meeting at a CTA
# barrier per tile (slot_release): with one CTA per SM no second CTA fills the
# stalls of a barrier that makes eight warps wait for the slowest.
#
# All three load their K/V tiles by TMA (tma_kv): one thread issues a tile where
# every thread had issued 16-32 cp.async with their address arithmetic.
# Measurements of each choice, and of those not kept: docs/fa2.md, "Tilings and
# why" (FA2_WIDE_TILINGS) and "Measured and not kept".
FA2_WIDE_TILINGS = {
    64: Fa2Tiling(warps=4, keys_per_tile=128, stages=2, q_in_regs=True, min_blocks_per_sm=2, frags_m=2,
                  sub_tiles=2, one_wait=True, tma_kv=True),
    128: Fa2Tiling(warps=4, keys_per_tile=64, stages=2, q_in_regs=False, min_blocks_per_sm=2, frags_m=2,
                   one_wait=True, fence_pv=True, tma_kv=True),
    256: Fa2Tiling(warps=8, keys_per_tile=64, stages=2, q_in_regs=False, min_blocks_per_sm=1, frags_m=1,
                   one_wait=True, tma_kv=True, slot_release=True),
}


# The arches on which every FA2_WIDE_TILINGS kernel was built without spills.
WIDE_TILING_ARCHES = frozenset({"sm_90a"})


def _wide_spills(spec: KernelSpec) -> bool:
    """Flag sets with which a FA2_WIDE_TILINGS kernel spills at the 255-register
    cap on sm_90a (4-16 bytes); they keep FA2_TILINGS. d64 has none."""
    if spec.head_dim_qk == 64:
        return False
    return bool((spec.soft_cap and spec.sliding_window) or (spec.head_dim_qk == 256 and spec.soft_cap and spec.causal))


def tiling(spec: KernelSpec, arches=None) -> Fa2Tiling | Fa2ColumnSplitTiling:
    """The fa2 tiling of a spec; `arches` (the build's targets, None when
    unknown) admits FA2_WIDE_TILINGS where all of them are WIDE_TILING_ARCHES
    and fit min_blocks_per_sm of its CTAs per SM."""
    # Batch-invariant decode splits rows, on the key tiles of paged prefill.
    decode = spec.op in DECODE_OPS and not spec.invariant_decode
    head_dim = tiling_head_dim(spec.head_dim_qk)
    if decode and spec.dtype_kv != spec.dtype_q and head_dim in FA2_FP8_DECODE_TILINGS:
        chosen = FA2_FP8_DECODE_TILINGS[head_dim]
    else:
        chosen = (FA2_DECODE_TILINGS if decode else FA2_TILINGS)[head_dim]
    assert chosen.smem_bytes(spec) <= common.SMEM_BUDGET, spec.name
    # The wide tilings load K/V by TMA in 128-byte blocks: head dims 64, 128 and 256.
    wide = FA2_WIDE_TILINGS.get(spec.head_dim_qk)
    # An FP8 cache keeps FA2_TILINGS: the wide tilings load K/V by TMA into the
    # tiles the MMAs read, and FP8 tiles need the widening pass (fa2_fp8.cuh).
    # So does a custom mask: the wide tilings sit at the register cap, and a
    # mask's bit reads on every step are not what they were tuned for.
    if (wide is not None and arches and spec.op not in DECODE_OPS and spec.op not in PAGED_OPS
            and not _wide_spills(spec) and spec.dtype_kv == spec.dtype_q and not spec.custom_mask
            and all(wide.min_blocks_per_sm * (wide.smem_bytes(spec) + common.SMEM_RESERVED_PER_CTA) <= common.SMEM_PER_SM.get(a, 0)
                    and a in WIDE_TILING_ARCHES for a in arches)):
        chosen = wide
    return chosen


@dataclass(frozen=True)
class MlaTiling:
    """The fa2 MLA kernels (fa2/fa2_mla.cuh): 16 packed rows per CTA shared by
    `warps` warps, which split Q.K^T by head dims and O by columns; tiles of
    keys_per_tile [ckv | kpe] rows (one copy serves as K and V) in `stages`.
    From wide_min_heads query heads (0: never) the library runs its second
    kernel instead (fa2/fa2_mla_wide.cuh: 64 rows, eight warps, tiles of
    wide_keys_per_tile keys in wide_stages), planned with that kernel's shape
    (loader.KernelModule.for_group)."""
    warps: int
    keys_per_tile: int
    stages: int
    min_blocks_per_sm: int
    rows_per_cta: int = 16
    wide_min_heads: int = 0
    wide_keys_per_tile: int = 64
    wide_stages: int = 2

    def rescales(self, spec: KernelSpec) -> tuple[int, int]:
        """(keys per rescale, merge rescales): one rescale per tile; no warp merge
        (every warp computes the same softmax state). The wide kernel rescales
        once per wide_keys_per_tile keys, less often: the narrow count bounds both."""
        return self.keys_per_tile, 0

    def smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of MlaTraits::kSmemBytes: Q (later the logit exchange), stages
        (of codes for an FP8 cache) and an FP8 cache's widened 16-bit tile."""
        row = 2 * spec.head_dim_qk
        head = max(self.rows_per_cta * row, self.warps * self.rows_per_cta * self.keys_per_tile * 4)
        return head + self.stages * self.keys_per_tile * _kv_row(spec) + _widened(spec, self.keys_per_tile)

    def wide_smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of MlaWideTraits::kSmemBytes: Q, stages, an FP8 cache's widened
        tile, P, row maxima, factors, flags."""
        rows, row = 64, 2 * spec.head_dim_qk
        return rows * row + self.wide_stages * self.wide_keys_per_tile * _kv_row(spec) \
            + _widened(spec, self.wide_keys_per_tile) + rows * self.wide_keys_per_tile * 2 + 2 * rows * 4 + rows * 4 \
            + 16 * 4


def _kv_row(spec: KernelSpec) -> int:
    """Bytes of a [ckv | kpe] row as the cache holds it (and the ring's stages)."""
    return common.DTYPE_BYTES[spec.dtype_kv] * spec.head_dim_qk


def _widened(spec: KernelSpec, keys: int) -> int:
    """An FP8 cache's widened 16-bit tile beside the ring (0 for a 16-bit cache)."""
    return keys * 2 * spec.head_dim_qk if common.DTYPE_BYTES[spec.dtype_kv] == 1 else 0


# 32-key tiles in two stages: 18 KB of Q and 2 x 36 KB of [ckv | kpe] rows fit
# SMEM_BUDGET (64-key tiles or 32 rows would not), two CTAs per SM on sm_90a,
# one on sm_80 / sm_89. Correctness first; not yet tuned on a GPU. An FP8
# cache keeps the tiling: its stages of codes take half the bytes, and the
# widened tile beside them the other half (90 KB either way; docs/mla.md).
MLA_TILING = MlaTiling(warps=4, keys_per_tile=32, stages=2, min_blocks_per_sm=2)

# Large head counts (MLA_WIDE_MIN_HEADS and up) run the wide kernel where every
# target arch holds one of its CTAs (225 KB: 64 rows of Q, two 64-key stages,
# P): 16-row CTAs read each key tile once per 16 rows and trade fp32 partial
# logits between warps (about 0.12 bytes of shared-memory traffic per FLOP);
# 64-row CTAs need about 0.074 (measured: docs/mla.md, "The fa2 kernels").
MLA_WIDE_MIN_HEADS = 64
MLA_WIDE_TILING = dataclasses.replace(MLA_TILING, wide_min_heads=MLA_WIDE_MIN_HEADS)


def mla_tiling(spec: KernelSpec, arches=None) -> MlaTiling:
    assert MLA_TILING.smem_bytes(spec) <= common.SMEM_BUDGET, spec.name
    wide = MLA_WIDE_TILING
    if arches and all(wide.wide_smem_bytes(spec) + common.SMEM_RESERVED_PER_CTA <= common.SMEM_PER_SM.get(a, 0)
                      for a in arches):
        return wide
    return MLA_TILING
