// The fa3 MLA loader kernel (fa3_mla.cuh) over an FP8 cache: its loader
// warpgroup's copies of codes and their widening into the 16-bit slot the
// wgmma descriptors read. The consumers read the slot as they do with a 16-bit
// cache, and apply the scales as fa2/fa2_mla_fp8.cuh says.
//
// Q and two 72 KB slots fill the SM's shared memory, so a tile's codes land in
// the upper half of the slot their widened values will fill: nine blocks of 64
// rows x 64 codes (4 KB each, unswizzled), block b at 36 KB + 4 KB b, each the
// codes of the slot's 64-column block b. The loader widens block after block
// in place: widened block b takes bytes 8 KB b .. 8 KB (b + 1), which hold
// codes of blocks 2b - 9 and 2b - 8 only: none for b < 4, earlier blocks' for
// b = 4 .. 7, blocks 7 and 8 for b = 8. Every thread reads its codes of block
// b before the loader's barrier of step b, and writes after it (b >= 4), so no
// widened store overwrites codes another thread has yet to read. A thread
// widens what it copied (gathered tiles: its own cp.async groups landed), or,
// for tiles by TMA, what the group's mbarrier says has landed.
//
// Each key group is published as its blocks are widened (a proxy fence, then
// the group's named barrier), so S starts on the first blocks as with a 16-bit
// cache; "full" after the last. The slot is refilled only once both consumers
// have released it, as with a 16-bit cache: one tile's codes in flight at a time.
#pragma once
#include <cuda.h>
#include <stdint.h>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_fp8.cuh"
#include "flashjit/fa2/fa2_mla_fp8.cuh"
#include "flashjit/fa2/fa2_mla_primitives.cuh"
#include "flashjit/fa3/fa3_mla_copy.cuh"
#include "flashjit/fa3/fa3_mla_traits.cuh"
#include "flashjit/fa3/fa3_primitives.cuh"

namespace flashjit {
namespace fa3 {

// One loader thread's share of a tile of codes: chunk q (16 codes) of each
// block of rows key0 and key0 + 32, copied (gathered tiles) and widened.
template <class Traits>
struct MlaCodeLoader : fa2::MlaCacheRows<typename Traits::KvType> {
  using Base = fa2::MlaCacheRows<typename Traits::KvType>;
  using Tile = typename Traits::Tile;
  static constexpr int kBlocks = Traits::kBlocks, kRowsPerPass = Traits::kLoaderThreads / 4;
  static constexpr int kPasses = Traits::kKeysPerTile / kRowsPerPass;
  static constexpr int kCodeOffset = Traits::kCodeOffset, kCodeBlockBytes = Traits::kCodeBlockBytes;
  int key0, q;

  __device__ __forceinline__ MlaCodeLoader(const FlashjitAttentionParams& p, const CtaWork& w, int tid)
      : Base(p, w, (tid % 4) * 16), key0(tid / 4), q(tid % 4) {}

  using Rows = typename Base::template PageRows<kPasses>;
  // This thread's rows of the tile at k0 (MlaCacheRows::lookup_rows).
  __device__ __forceinline__ void lookup(Rows& rows, int k0, int valid) const {
    Base::template lookup_rows<kPasses, kRowsPerPass>(rows, key0, k0, valid);
  }

  // Chunk `chunk` (16 codes) of row `row` of a code block (64 codes a row).
  __device__ __forceinline__ static uint32_t code_at(int row, int chunk) { return row * 64 + chunk * 16; }

  // Codes of blocks kFirst .. kEnd - 1 of this thread's rows into the slot's
  // code blocks; rows past the request zero-filled (zero codes widen to 0).
  template <int kFirst, int kEnd>
  __device__ __forceinline__ void issue(uint32_t slot, const Rows& rows) const {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool ok = rows.page[i] >= 0;
      const char *c_src, *k_src;
      Base::row(uint32_t(ok ? rows.page[i] : 0), uint32_t(rows.slot[i]), c_src, k_src);
      // Chunk q of the row, as the source (Base's offset): the four threads of
      // a row fill its four chunks, each the one widen() reads back.
      const uint32_t dst = slot + kCodeOffset + code_at(key0 + i * kRowsPerPass, q);
#pragma unroll
      for (int b = kFirst; b < kEnd; ++b)
        cp_async_16(dst + b * kCodeBlockBytes, b + 1 < kBlocks ? c_src + b * 64 : k_src, ok);
    }
  }
  // The tile as kKeyGroups commit groups of copies, in block order.
  template <int kGroup = 0>
  __device__ __forceinline__ void issue_groups(uint32_t slot, const Rows& rows) const {
    if constexpr (kGroup < Traits::kKeyGroups) {
      issue<kGroup * Traits::kBlocksPerGroup, (kGroup + 1) * Traits::kBlocksPerGroup>(slot, rows);
      cp_async_commit();
      issue_groups<kGroup + 1>(slot, rows);
    }
  }

  // Blocks kFirst .. kEnd - 1 widened in place (see the header comment): each
  // block's codes read, the loader's barrier where the block's widened bytes
  // hold codes, then its 16-bit chunks 2q and 2q + 1 of both rows stored.
  template <int kFirst, int kEnd>
  __device__ __forceinline__ void widen(uint32_t slot) const {
    using T = typename Traits::DType;
    using KvT = typename Traits::KvType;
#pragma unroll
    for (int b = kFirst; b < kEnd; ++b) {
      uint4 codes[kPasses];
#pragma unroll
      for (int i = 0; i < kPasses; ++i)
        codes[i] = ld_shared_16(slot + kCodeOffset + b * kCodeBlockBytes + code_at(key0 + i * kRowsPerPass, q));
      if (Tile::block(b + 1) > kCodeOffset) loader_barrier();
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        const int row = key0 + i * kRowsPerPass;
        uint4 lo, hi;
        fa2::widen_fp8x16<KvT, T>(codes[i], lo, hi);
        st_shared_16(slot + Tile::block(b) + Tile::at(row, 2 * q), lo);
        st_shared_16(slot + Tile::block(b) + Tile::at(row, 2 * q + 1), hi);
      }
    }
  }
};

// Tile of 64 keys of codes by TMA, issued by one thread: a 64-row box of each
// block's 64 codes from slot `slot` of page `page` (ckv blocks from the K map,
// kpe from the V map: encode_mla_code_maps), each key group's counted on its
// own mbarrier.
template <class Traits, class GroupBar>
__device__ __forceinline__ void load_mla_codes_tma(const KvTensorMaps& maps, uint32_t slot, int page, int row,
                                                   const GroupBar& group_bar) {
  constexpr int kGroupBytes = Traits::kBlocksPerGroup * Traits::kCodeBlockBytes;
#pragma unroll
  for (int g = 0; g < Traits::kKeyGroups; ++g) {
    tma::mbar_arrive_expect_tx(group_bar(g), kGroupBytes);
#pragma unroll
    for (int b = g * Traits::kBlocksPerGroup; b < (g + 1) * Traits::kBlocksPerGroup; ++b) {
      const bool kpe = b + 1 == Traits::kBlocks;
      tma::load_3d(slot + Traits::kCodeOffset + b * Traits::kCodeBlockBytes, kpe ? &maps.v : &maps.k,
                   kpe ? 0 : 64 * b, row, page, group_bar(g));
    }
  }
}

// Key group kGroup of tile t and the ones after it: landed (this thread's
// cp.async groups, or the group's mbarrier for a TMA tile; with TMA tiles in
// the launch, a gathered tile's group barrier phase too), widened, published.
template <class Traits, int kGroup = 0, class GroupBar>
__device__ __forceinline__ void land_and_widen(const MlaCodeLoader<Traits>& loader, uint32_t slot, int t,
                                               bool by_tma, uint32_t parity, bool tma_launch,
                                               const GroupBar& group_bar) {
  if constexpr (kGroup < Traits::kKeyGroups) {
    constexpr int kFirst = kGroup * Traits::kBlocksPerGroup;
    if (by_tma || tma_launch) tma::mbar_wait(group_bar(t, kGroup), parity);
    if (!by_tma) cp_async_wait<Traits::kKeyGroups - 1 - kGroup>();
    loader.template widen<kFirst, kFirst + Traits::kBlocksPerGroup>(slot);
    fence_async_shared();  // the widened blocks, for the consumers' wgmma (async proxy)
    if constexpr (Traits::kKeyGroups > 1) key_group_arrive<Traits>(t, kGroup);
    land_and_widen<Traits, kGroup + 1>(loader, slot, t, by_tma, parity, tma_launch, group_bar);
  }
}

// The loader warpgroup's loop over an FP8 cache (thread tid of 128): tile t's
// codes into slot_of(t) once empty(t) says both consumers are done with the
// slot, widened group by group (each published at its named barrier), then
// "full". TMA (page_box_rows > 0) for whole tiles within one page.
template <class Traits, class SlotOf, class FullBar, class EmptyBar, class GroupBar>
__device__ __forceinline__ void mla_fp8_loader(const FlashjitAttentionParams& p, const CtaWork& w,
                                               const typename Traits::TmaArg& tma_arg, int key_begin, int num_tiles,
                                               int tid, const SlotOf& slot_of, const FullBar& full,
                                               const EmptyBar& empty, const GroupBar& group_bar) {
  constexpr int KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages, GROUPS = Traits::kKeyGroups;
  using Loader = MlaCodeLoader<Traits>;
  const Loader loader(p, w, tid);
  typename Loader::Rows rows;
  auto lookup = [&](int t) {
    const int k0 = key_begin + t * KEYS;
    loader.lookup(rows, k0, min(KEYS, w.kv_len - k0));
  };
  if (num_tiles > 0) lookup(0);
  for (int t = 0; t < num_tiles; ++t) {
    if (t >= STAGES) {
      if (tid < 32) tma::mbar_wait(empty(t), ((t / STAGES) - 1) & 1);
      loader_barrier();
    }
    const uint32_t slot = slot_of(t);
    const uint32_t parity = (t / STAGES) & 1;
    bool by_tma = false, tma_launch = false;
    if constexpr (Traits::kTma) {
      tma_launch = tma_arg.page_box_rows > 0;
      const int k0 = key_begin + t * KEYS;
      by_tma = tma_launch && k0 % KEYS == 0 && k0 + KEYS <= w.kv_len;
      if (by_tma && tid == 0)
        load_mla_codes_tma<Traits>(tma_arg.maps, slot, rows.page[0], rows.slot[0],
                                   [&](int g) { return group_bar(t, g); });
      if (!by_tma && tma_launch && tid == 0) {
        // A gathered tile where others come by TMA: the group barriers' phases
        // stay in step with the slot's tiles.
        for (int g = 0; g < GROUPS; ++g) tma::mbar_arrive(group_bar(t, g));
      }
    }
    if (!by_tma) loader.issue_groups(slot, rows);
    if (t + 1 < num_tiles) lookup(t + 1);
    land_and_widen<Traits>(loader, slot, t, by_tma, parity, tma_launch, group_bar);
    tma::mbar_arrive(full(t));
  }
  cp_async_commit();
  cp_async_wait<0>();  // exits with no copy of this thread in flight
}

// ---- Host side ----

// TMA maps of an FP8 cache's codes: ckv (512 codes a row) as K, kpe (64) as V,
// each 3-D (codes, page slots, pages: p's byte strides) with boxes of 64 codes
// x box_rows slots x 1 page, unswizzled (the loader reads them back itself).
// The page count is left unbounded, as tma::encode_paged_kv_map leaves it.
// Returns a cudaError_t value.
inline int encode_mla_code_maps(KvTensorMaps* maps, const FlashjitAttentionParams& p, int ckv_dim, int kpe_dim,
                                int box_rows) {
  const tma::EncodeTiledFn encode = tma::encode_tiled_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  maps->heads_outer_k = maps->heads_outer_v = 0;
  CUtensorMap* targets[2] = {&maps->k, &maps->v};
  const void* data[2] = {p.k, p.v};
  const int dims_of[2] = {ckv_dim, kpe_dim};
  const int64_t row_strides[2] = {p.k_stride_n, p.v_stride_n}, page_strides[2] = {p.k_stride_page, p.v_stride_page};
  for (int m = 0; m < 2; ++m) {
    const cuuint64_t dims[3] = {cuuint64_t(dims_of[m]), cuuint64_t(p.page_size), 0x7fffffff};
    const cuuint64_t strides[2] = {cuuint64_t(row_strides[m]), cuuint64_t(page_strides[m])};
    const cuuint32_t box[3] = {64, cuuint32_t(box_rows), 1};
    const cuuint32_t element_strides[3] = {1, 1, 1};
    const CUresult res = encode(targets[m], CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(data[m]), dims,
                                strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (res != CUDA_SUCCESS) return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

}  // namespace fa3
}  // namespace flashjit
