"""CUDA-core kernels (templates/include/flashjit/cuda_core/): fp32 softmax and
P.V for every dtype. Prefill and decode have their own tilings."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import KernelSpec
from . import common


@dataclass(frozen=True)
class CudaCoreTiling:
    """Prefill on CUDA cores (cuda_core_attention.cuh): row warps share 32-key tiles."""
    rows_per_warp: int
    row_warps: int

    @property
    def rows_per_cta(self) -> int:
        return self.rows_per_warp * self.row_warps

    def rescales(self, spec: KernelSpec) -> tuple[int, int]:
        """(keys per online-softmax rescale, merge rescales): one per 32-key tile."""
        return 32, 0

    def chains(self, spec: KernelSpec) -> dict:
        """How the fp32 sums run (for the worst-case bound, error_model): Q.K one
        fma chain over head_dim; P.V one chain over all keys (divisor 1); the row
        sum one chain per lane (key j on lane j mod 32), then 5 butterfly adds."""
        return {"dot_chain": spec.head_dim_qk, "pv_chains": 1, "l_chains": 32, "l_tail": 5, "merge_levels": 0}

    def smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of CudaCoreTraits::kSmemBytes: fp32 Q, P per warp, one K and one V tile."""
        elt = common.DTYPE_BYTES[spec.dtype_kv]
        keys = 32
        q = 4 * self.rows_per_cta * spec.head_dim_qk
        p = 4 * self.row_warps * self.rows_per_warp * keys
        k_tile = elt * keys * (spec.head_dim_qk + 16 // elt)
        v_tile = elt * keys * spec.head_dim_vo
        return q + p + k_tile + v_tile


def cuda_core_tiling(spec: KernelSpec) -> CudaCoreTiling:
    """Prefill on CUDA cores: four row warps of four rows each."""
    tiling = CudaCoreTiling(rows_per_warp=4, row_warps=4)
    if tiling.smem_bytes(spec) <= common.SMEM_BUDGET:
        return tiling
    raise ValueError(f"{spec.name}: no CUDA-core tiling fits {common.SMEM_BUDGET} bytes of shared memory")


@dataclass(frozen=True)
class CudaDecodeTiling:
    """Decode on CUDA cores (cuda_core_decode.cuh): warps stream their own
    chunks of keys, keys_per_group keys per lane group and stage."""
    warps: int
    keys_per_group: int
    stages: int
    min_blocks_per_sm: int = 4
    # The query heads of one KV head that a CTA holds (fewer for smaller groups).
    rows_per_cta: int = 4
    # Head dims of a key per lane: 8; 16 past head dim 256 (512: 8 a lane would
    # take 64 lanes), and for FP8 caches below it (16 bytes of codes a key, as a
    # 16-bit lane copies 16 bytes of 8 dims), a variant that
    # benchmarks/dev/decode_tilings.py times and no shipped tiling uses there
    # (its four rows need 255 registers: docs/fp8.md, "Speed").
    dims_per_lane: int = 8

    def lanes_per_key(self, spec: KernelSpec) -> int:
        """Mirror of CudaCoreDecodeTraits::kLanesPerKey: head_dim / dims_per_lane
        lanes hold a key's dims, and the group is the next power of two wide (its
        last lanes hold zeros where that count is not one: head dims 48, 80, ...)."""
        active = spec.head_dim_qk // self.dims_per_lane
        return 1 << (active - 1).bit_length()

    def key_groups(self, spec: KernelSpec) -> int:
        """Keys a warp works on side by side (CudaCoreDecodeTraits::kKeyGroups)."""
        return 32 // self.lanes_per_key(spec)

    def rescales(self, spec: KernelSpec) -> tuple[int, int]:
        """(keys per rescale, merge rescales): one rescale per chunk of the key's
        lane group, which takes every (groups * warps)-th chunk; then the merges,
        lane groups by halves and the warps."""
        groups = self.key_groups(spec)
        return self.keys_per_group * groups * self.warps, groups.bit_length() - 1 + 1

    def chains(self, spec: KernelSpec) -> dict:
        """How the fp32 sums run (for the worst-case bound, error_model): Q.K an
        fma chain over a lane's dims, then the lanes halved (a group's idle lanes
        add exact zeros, but count as levels); P.V and the row sum one chain per
        (warp, key group), merged in log2(groups) halvings and then a sum over the
        warps (each merge two roundings)."""
        lanes = self.lanes_per_key(spec)
        groups = 32 // lanes
        levels = groups.bit_length() - 1
        return {"dot_chain": self.dims_per_lane + lanes.bit_length() - 1, "pv_chains": groups * self.warps,
                "l_chains": groups * self.warps, "l_tail": 2 * levels + 2 * self.warps, "merge_levels": levels + 1}

    def smem_bytes(self, spec: KernelSpec) -> int:
        """Mirror of CudaCoreDecodeTraits::kSmemBytes: a lane's dims of a key take
        8 or 16 (FP8), 16 or 32 bytes."""
        lane_bytes = self.dims_per_lane * common.DTYPE_BYTES[spec.dtype_kv]
        ring = self.warps * self.stages * 2 * self.keys_per_group * lane_bytes * 32
        merge = 4 * self.warps * self.rows_per_cta * (spec.head_dim_vo + 2)
        return max(ring, merge)


def cuda_decode_tiling(spec: KernelSpec) -> CudaDecodeTiling:
    # Three stages of 4 KB per warp (16-bit types) leave room for four CTAs,
    # 16 warps, per SM; fp32 rows are twice as wide, so two stages. FP8 rows
    # take the 512 tiling's lanes of 16 dims (16-byte copies of codes, twice
    # the keys per warp instruction): a lane of 8 codes moved a key with the
    # instructions of 8 16-bit elements, and 16 dims a lane ran 14-34% faster
    # on every row of the decode table (docs/fp8.md, "Speed").
    elt = common.DTYPE_BYTES[spec.dtype_kv]
    if spec.head_dim_qk > 256 or elt == 1:
        return _wide_decode_tiling(spec, elt)
    stages = 2 if elt == 4 else 3
    tiling = CudaDecodeTiling(warps=4, keys_per_group=4, stages=stages)
    assert tiling.smem_bytes(spec) <= common.SMEM_BUDGET, spec.name
    return tiling


def _wide_decode_tiling(spec: KernelSpec, elt: int) -> CudaDecodeTiling:
    """Head dim 512, and FP8 caches at every head dim: 16 dims a lane (at 512
    one key per warp instruction, 32 lanes; at 128 two keys of 8 lanes).
    Four rows' queries and accumulators are 128 fp32 registers a lane: 210-254
    in all on sm_80 / sm_89 / sm_90a, so two CTAs per SM (the register cap of
    three spilled 52-212 bytes). A warp's chunk is 4 keys of 2 KB (16-bit) in
    two stages, 64 KB a CTA; fp32 rows are twice as wide, so 2 keys a chunk;
    FP8 rows half as wide, so three stages in 48 KB. Not yet tuned on a GPU."""
    tiling = CudaDecodeTiling(warps=4, keys_per_group=2 if elt == 4 else 4, stages=3 if elt == 1 else 2,
                              min_blocks_per_sm=2, dims_per_lane=16)
    assert tiling.smem_bytes(spec) <= common.SMEM_BUDGET and tiling.lanes_per_key(spec) <= 32, spec.name
    return tiling
