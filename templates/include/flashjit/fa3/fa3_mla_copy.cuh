// What the fa3 MLA kernel (fa3_mla.cuh) copies into shared memory: the loader
// warpgroup's gather of [ckv | kpe] key rows from the pages or its TMA boxes of
// whole tiles, and the consumers' barrier (their Q rows come by fa2::copy_mla_q).
#pragma once
#include <stdint.h>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa2/fa2_mla_primitives.cuh"
#include "flashjit/fa3/fa3_mla_traits.cuh"

namespace flashjit {
namespace fa3 {

// The two consumer warpgroups' barrier (id 1; the loader's is 3, the softmax
// consumer's own 2), once their Q copies have landed.
__device__ __forceinline__ void consumers_barrier() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
// Tile t's P and factors, from the softmax consumer (arrive) to the other
// (sync): ids 4 and 5 by the tile's parity, so that the softmax consumer may
// arrive for tile t + 1 before the other has passed tile t; it cannot reach
// tile t + 2, whose keys need the slot the other frees after tile t.
__device__ __forceinline__ void handoff_arrive(int t) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(4 + (t & 1)) : "memory");
}
__device__ __forceinline__ void handoff_sync(int t) { asm volatile("bar.sync %0, 256;\n" ::"r"(4 + (t & 1)) : "memory"); }
// Key group g of tile t, from the loader warpgroup (arrive, once its copies of
// the group have landed) to the softmax consumer (sync, before S's k-steps over
// it): an id per slot and group, so that the loader's arrivals for the next
// tile never meet this one's (the loader refills a slot only after both
// consumers have released it, after S passed every group of it).
template <class Traits>
__device__ __forceinline__ int key_group_barrier(int t, int g) {
  return Traits::kGroupBarrier0 + (t % Traits::kStages) * Traits::kKeyGroups + g;
}
template <class Traits>
__device__ __forceinline__ void key_group_arrive(int t, int g) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(key_group_barrier<Traits>(t, g)) : "memory");
}
template <class Traits>
__device__ __forceinline__ void key_group_sync(int t, int g) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(key_group_barrier<Traits>(t, g)) : "memory");
}

// One loader thread's share of a tile: chunk `sub` of each 128-byte block of
// keys key0, key0 + 16, ... (kLoaderPasses rows), into the blocked layout.
template <class Traits>
struct MlaGather : fa2::MlaCacheRows<typename Traits::DType> {
  using Base = fa2::MlaCacheRows<typename Traits::DType>;
  static constexpr int kPasses = Traits::kLoaderPasses, kRowsPerPass = Traits::kLoaderRowsPerPass;
  int key0, sub;

  __device__ __forceinline__ MlaGather(const FlashjitAttentionParams& p, const CtaWork& w, int tid)
      : Base(p, w, (tid % 8) * 16), key0(tid / 8), sub(tid % 8) {}

  using Rows = typename Base::template PageRows<kPasses>;
  // This thread's rows of the tile of keys k0 .. k0 + 63 (MlaCacheRows::lookup_rows).
  __device__ __forceinline__ void lookup(Rows& rows, int k0, int valid) const {
    Base::template lookup_rows<kPasses, kRowsPerPass>(rows, key0, k0, valid);
  }

  // Copies this thread's chunks of blocks kFirst .. kEnd - 1 of the looked-up
  // rows into `dst`; rows past the request are zero-filled, reading nothing
  // (their logits are masked, and a zero V row keeps 0 * V finite).
  template <int kFirst = 0, int kEnd = Traits::kBlocks>
  __device__ __forceinline__ void issue(uint32_t dst, const Rows& rows) const {
    using Tile = typename Traits::Tile;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool ok = rows.page[i] >= 0;
      const char *c_src, *k_src;
      Base::row(uint32_t(ok ? rows.page[i] : 0), uint32_t(rows.slot[i]), c_src, k_src);
      const uint32_t row = dst + Tile::at(key0 + i * kRowsPerPass, sub);
#pragma unroll
      for (int b = kFirst; b < kEnd; ++b)
        cp_async_16(row + Tile::block(b), b + 1 < Traits::kBlocks ? c_src + b * 128 : k_src, ok);
    }
  }

  // The tile as kKeyGroups commit groups of copies, in block order.
  template <int kGroup = 0>
  __device__ __forceinline__ void issue_groups(uint32_t dst, const Rows& rows) const {
    if constexpr (kGroup < Traits::kKeyGroups) {
      issue<kGroup * Traits::kBlocksPerGroup, (kGroup + 1) * Traits::kBlocksPerGroup>(dst, rows);
      cp_async_commit();
      issue_groups<kGroup + 1>(dst, rows);
    }
  }
  // Tile t's groups, each once this thread's copies of it have landed, in
  // order, to the softmax consumer (after issue_groups, every copy in flight).
  template <int kGroup = 0>
  __device__ __forceinline__ void arrive_groups(int t) const {
    if constexpr (kGroup < Traits::kKeyGroups) {
      cp_async_wait<Traits::kKeyGroups - 1 - kGroup>();
      key_group_arrive<Traits>(t, kGroup);
      arrive_groups<kGroup + 1>(t);
    }
  }
};

// Tile of 64 keys by TMA, issued by one thread: a 64-row box of each
// 64-column block from slot `slot` of page `page` (ckv blocks 0-7 from the K
// map, the kpe block from the V map), each key group's boxes counted on its
// own mbarrier (group_bar(g)), so that S can start on a group as it lands.
template <class Traits, class GroupBar>
__device__ __forceinline__ void load_mla_tile_tma(const KvTensorMaps& maps, uint32_t dst, int page, int slot,
                                                  const GroupBar& group_bar) {
  using Tile = typename Traits::Tile;
  constexpr int kGroupBytes = Traits::kBlocksPerGroup * Traits::kKeysPerTile * 128;
#pragma unroll
  for (int g = 0; g < Traits::kKeyGroups; ++g) {
    tma::mbar_arrive_expect_tx(group_bar(g), kGroupBytes);
#pragma unroll
    for (int b = g * Traits::kBlocksPerGroup; b < (g + 1) * Traits::kBlocksPerGroup; ++b) {
      const bool kpe = b + 1 == Traits::kBlocks;
      tma::load_4d(dst + Tile::block(b), kpe ? &maps.v : &maps.k, kpe ? 0 : 64 * b, 0, slot, page, group_bar(g));
    }
  }
}

}  // namespace fa3

}  // namespace flashjit
