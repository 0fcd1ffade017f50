// FP8 K/V caches in the fa3 kernel (fa3_attention.cuh). The wgmma operands stay
// in q's dtype: an FP8 wgmma would need FP8 queries. So the loader warpgroup
// brings tiles of codes into a ring of code slots (a slot is K or V of one
// tile, head_dim bytes a row, unswizzled: fa2::PlainTile), by TMA where a tile
// is a plain box of the cache, else gathered by cp.async with rows past the
// request zero-filled; then the whole warpgroup widens each slot into the K or
// V tile of the 16-bit ring that the consumers' wgmma reads (the 128-byte
// swizzle TMA writes for a 16-bit cache), fences the generic-proxy stores for
// the async proxy and arrives on the tile's full barrier, one arrival a warp.
// Widening e4m3 or e5m2 to fp16 or bf16 is exact (fa2_fp8.cuh); k_scale folds
// into the softmax scale and v_scale multiplies the output, as in fa2.
// Nothing is dequantised into global memory. docs/fp8.md, "fa3".
#pragma once
#include <cuda.h>
#include <stdint.h>
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_fp8.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa3/fa3_primitives.cuh"

namespace flashjit {

// Base: the Fa3Traits of the 16-bit kernel at the same tiling (which keep
// their own kernel, unchanged). kCodeStages_: (K, V) pairs of code slots,
// placed after Q; their "full" mbarriers after the ring's.
template <class Base, class KvType_, int kCodeStages_>
struct Fa3Fp8Traits : Base {
  using KvType = KvType_;
  static constexpr bool kKvFp8 = true;
  static constexpr int kCodeSlots = 2 * kCodeStages_;
  static constexpr int kCodeTileBytes = Base::kKeysPerTile * Base::kHeadDim;
  using CodeLayout = fa2::PlainTile<Base::kHeadDim>;
  // The loader widens as well as copies: 56 registers (the paged loader's;
  // at 40 ragged d128 to d256 spilled 8-12 bytes), the consumers 224.
  static constexpr int kLoaderRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static constexpr int kCodeOffset = Base::kBarOffset;
  static constexpr int kBarOffset = kCodeOffset + kCodeSlots * kCodeTileBytes;
  static constexpr int kCodeBarOffset = kBarOffset + 32 * Base::kStages;
  static constexpr size_t kSmemBytes = 1024 + size_t(kCodeBarOffset) + 8 * kCodeSlots;
  using WithChunkFold = Fa3Fp8Traits<typename Base::WithChunkFold, KvType_, kCodeStages_>;

  static_assert(sizeof(KvType_) == 1, "FP8 codes");
  static_assert(Base::kHeadDimVo == Base::kHeadDim, "an FP8 cache with K and V of one width");
  static_assert(Base::kHeadDim % 64 == 0, "an FP8 cache at head dims of whole 64-column blocks");
  static_assert(kCodeStages_ >= 1, "at least one (K, V) pair of code slots");
  static_assert(Base::kLoaderThreads * (kLoaderRegs + Base::kConsumerWarpgroups * kConsumerRegs) <= 65536,
                "the SM's registers");
  static_assert(kCodeOffset % 1024 == 0 && kCodeTileBytes % 128 == 0, "code slots on TMA-aligned boundaries");
};

namespace fa3 {

// The loader warpgroup with an FP8 cache: the same contract as load_kv_tiles
// (fa3_loader.cuh). It walks half-tiles h = K of tile h / 2, then its V: it
// issues the copy of half-tile h into code slot h % kCodeSlots, then widens
// half-tile h - (kCodeSlots - 1), so that up to kCodeSlots - 1 copies are in
// flight behind the one being widened. Two loader barriers a half-tile: after
// the ring slot's empty barrier (which only the first warp polls), and after
// the widening, which frees the code slot for the next copy.
template <class Traits, class ForEachPosition, class FullK, class FullV, class EmptyK, class EmptyV, class KSlot>
__device__ __forceinline__ void load_fp8_kv_tiles(const FlashjitAttentionParams& p, const KvMapsPagedArg& tma_arg,
                                                  uint32_t base, int tid, const ForEachPosition& for_each_position,
                                                  const FullK& full_k, const FullV& full_v, const EmptyK& empty_k,
                                                  const EmptyV& empty_v, const KSlot& k_slot) {
  using T = typename Traits::DType;
  using KvLayout = typename Traits::KvLayout;
  using CodeLayout = typename Traits::CodeLayout;
  constexpr int D = Traits::kHeadDim, KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages;
  constexpr int SLOTS = Traits::kCodeSlots, LAG = SLOTS - 1, THREADS = Traits::kLoaderThreads;
  // Rows of codes are copied as pairs of codes (16-bit words): whole rows a span.
  using RaggedCopy = fa2::RaggedTileCopy<uint16_t, CodeLayout, KEYS, D / 2, THREADS, D>;
  using PagedCopy = fa2::PagedTileCopy<uint16_t, CodeLayout, KEYS, D / 2, THREADS, D>;
  const int lane = tid % 32;
  set_max_registers_dec<Traits::kLoaderRegs>();
  auto code_slot = [&](int h) { return base + Traits::kCodeOffset + (h % SLOTS) * Traits::kCodeTileBytes; };
  auto code_full = [&](int h) { return base + Traits::kCodeBarOffset + 8 * (h % SLOTS); };

  // Half-tile h from its code slot into the ring, once the consumers gave the
  // ring slot's previous tile back.
  auto widen = [&](int h) {
    const int gt = h >> 1;
    const bool v = h & 1;
    if (tid < 32 && gt >= STAGES) tma::mbar_wait(v ? empty_v(gt) : empty_k(gt), ((gt / STAGES) - 1) & 1);
    loader_barrier();
    tma::mbar_wait(code_full(h), (h / SLOTS) & 1);
    fa2::widen_fp8_tile<typename Traits::KvType, T, KvLayout, KEYS, D, THREADS>(
        code_slot(h), k_slot(gt) + (v ? Traits::kKTileBytes : 0), tid);
    fence_async_shared();  // the wgmma reads these stores through the async proxy
    __syncwarp();
    if (lane == 0) tma::mbar_arrive(v ? full_v(gt) : full_k(gt));
    loader_barrier();  // code slot h % SLOTS is free for half-tile h + SLOTS
  };
  // Arrivals on code_full(h) come from every loader thread: the TMA issuer's
  // with the bytes and the others' plain, or each thread's copies landing.
  auto arrive_tma = [&](uint32_t bar) {
    if (tid == 0) {
      tma::mbar_arrive_expect_tx(bar, KEYS * D);
    } else {
      tma::mbar_arrive(bar);
    }
  };

  // The next half-tile to copy: 2 (seq + t) for tile t of a position, counted
  // here (seq itself held across the widening spilled at d192).
  int h = 0;
  if constexpr (Traits::kPaged) {
    const int box_rows = tma_arg.page_box_rows;
    for_each_position([&](const auto& it, int seq) {
      const CtaWork& w = it.w;
      for (int t = 0; t < it.num_tiles; ++t, h += 2) {
        const int k0 = it.key_begin + t * KEYS, valid = min(KEYS, w.kv_len - k0);
        const bool boxes = box_rows > 0 && valid == KEYS;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t dst = code_slot(h + half), bar = code_full(h + half);
          if (boxes) {
            // One box per page (or a tile's worth of a larger one): the first
            // warp reads the boxes' page ids at once, lane j box j's.
            if (tid < 32) {
              const int n = KEYS / box_rows;
              int page = 0, slot = 0;
              if (lane < n) {
                const FastDivmod page_div(p.page_size);
                const int key = k0 + lane * box_rows, page_at = page_div.div(key);
                slot = page_div.mod(key, page_at);
                page = p.kv_page_indices[w.kv_start + page_at];
              }
              const CUtensorMap* map = half ? &tma_arg.maps.v : &tma_arg.maps.k;
              const int outer = half ? tma_arg.maps.heads_outer_v : tma_arg.maps.heads_outer_k;
              arrive_tma(bar);
              for (int j = 0; j < n; ++j) {
                const int box_page = __shfl_sync(0xffffffffu, page, j), box_slot = __shfl_sync(0xffffffffu, slot, j);
                if (lane == 0)
                  tma::load_4d(dst + j * box_rows * D, map, 0, outer ? box_slot : w.kv_head,
                               outer ? w.kv_head : box_slot, box_page, bar);
              }
            } else {
              tma::mbar_arrive(bar);
            }
          } else {
            // Formed per half-tile, and its rows' pages looked up again for V:
            // addresses or pages held across the widening would not fit the
            // loader's registers (d192 spilled).
            int pages[PagedCopy::R::kPerThread];
            const PagedCopy copy(half ? kv_rows<uint16_t, true>(p, w, p.v, p.v_stride_n / 2, p.v_stride_h / 2,
                                                                 p.v_stride_page / 2)
                                      : kv_rows<uint16_t, true>(p, w, p.k, p.k_stride_n / 2, p.k_stride_h / 2,
                                                                 p.k_stride_page / 2),
                                 tid);
            copy.lookup(pages, k0, valid);
            copy.issue(dst, pages, k0, valid);
            cp_async_arrive_noinc(bar);
          }
          if (h + half >= LAG) widen(h + half - LAG);
        }
      }
    });
  } else {
    for_each_position([&](const auto& it, int seq) {
      const CtaWork& w = it.w;
      for (int t = 0; t < it.num_tiles; ++t, h += 2) {
        const int k0 = it.key_begin + t * KEYS, valid = min(KEYS, w.kv_len - k0);
        // A batch's maps run on into the next request: its partial tile is copied.
        const bool whole = valid == KEYS || tma::single_request_maps(p);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t dst = code_slot(h + half), bar = code_full(h + half);
          if (whole) {
            arrive_tma(bar);
            if (tid == 0)
              tma::load_kv_block(dst, half ? &tma_arg.maps.v : &tma_arg.maps.k,
                                 half ? tma_arg.maps.heads_outer_v : tma_arg.maps.heads_outer_k, 0, w.kv_head,
                                 w.kv_start + k0, bar);
          } else {
            const auto rows = half ? kv_rows<uint16_t, false>(p, w, p.v, p.v_stride_n / 2, p.v_stride_h / 2, 0)
                                   : kv_rows<uint16_t, false>(p, w, p.k, p.k_stride_n / 2, p.k_stride_h / 2, 0);
            RaggedCopy(rows, tid).issue(dst, k0, valid, rows.base);
            cp_async_arrive_noinc(bar);
          }
          if (h + half >= LAG) widen(h + half - LAG);
        }
      }
    });
  }
  for (int hw = max(h - LAG, 0); hw < h; ++hw) widen(hw);
  // Exits with no copy of this thread in flight.
  cp_async_commit();
  cp_async_wait<0>();
}

// ---- Host side: tensor maps of an FP8 cache, whole rows of codes a box
// (head_dim bytes, at most 256: one box dimension), unswizzled (the widening
// pass reads the slot in row order). Strides are in elements, here bytes.

// A ragged K or V ([tokens, heads, head_dim]) with boxes of box_rows tokens;
// `tokens` bounds the map as tma::encode_kv_map's does. Returns a cudaError_t value.
inline int encode_fp8_kv_map(CUtensorMap* map, int32_t* heads_outer, const void* data, int head_dim, int heads,
                             int64_t stride_n, int64_t stride_h, cuuint64_t tokens, int box_rows) {
  const tma::EncodeTiledFn encode = tma::encode_tiled_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (heads == 1) stride_h = stride_n;  // never stepped (tma::encode_kv_map)
  *heads_outer = stride_h > stride_n;
  const cuuint64_t dims[3] = {cuuint64_t(head_dim), *heads_outer ? tokens : cuuint64_t(heads),
                              *heads_outer ? cuuint64_t(heads) : tokens};
  const cuuint64_t strides[2] = {cuuint64_t(*heads_outer ? stride_n : stride_h),
                                 cuuint64_t(*heads_outer ? stride_h : stride_n)};
  const cuuint32_t box[3] = {cuuint32_t(head_dim), *heads_outer ? cuuint32_t(box_rows) : 1u,
                             *heads_outer ? 1u : cuuint32_t(box_rows)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(data), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// A paged K or V cache as 4-D (head dims, slots and heads in stride order,
// pages), boxes of box_rows slots (tma::encode_paged_kv_map). Returns a cudaError_t value.
inline int encode_fp8_paged_kv_map(CUtensorMap* map, int32_t* heads_outer, const void* data, int head_dim, int heads,
                                   int page_size, int64_t stride_n, int64_t stride_h, int64_t stride_page,
                                   int box_rows) {
  const tma::EncodeTiledFn encode = tma::encode_tiled_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (heads == 1) stride_h = stride_n;
  *heads_outer = stride_h > stride_n;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(*heads_outer ? page_size : heads),
                              cuuint64_t(*heads_outer ? heads : page_size), 0x7fffffff};
  const cuuint64_t strides[3] = {cuuint64_t(*heads_outer ? stride_n : stride_h),
                                 cuuint64_t(*heads_outer ? stride_h : stride_n), cuuint64_t(stride_page)};
  const cuuint32_t box[4] = {cuuint32_t(head_dim), *heads_outer ? cuuint32_t(box_rows) : 1u,
                             *heads_outer ? 1u : cuuint32_t(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult res = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(data), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Both maps of a launch's FP8 K and V: ragged (boxes of kKeysPerTile tokens),
// or paged with boxes of box_rows slots. Returns a cudaError_t value.
template <class Traits>
int encode_fp8_kv_maps(KvTensorMaps* maps, const FlashjitAttentionParams& p, int box_rows) {
  constexpr int D = Traits::kHeadDim;
  if constexpr (Traits::kPaged) {
    const int err = encode_fp8_paged_kv_map(&maps->k, &maps->heads_outer_k, p.k, D, p.num_kv_heads, p.page_size,
                                            p.k_stride_n, p.k_stride_h, p.k_stride_page, box_rows);
    if (err != cudaSuccess) return err;
    return encode_fp8_paged_kv_map(&maps->v, &maps->heads_outer_v, p.v, D, p.num_kv_heads, p.page_size,
                                   p.v_stride_n, p.v_stride_h, p.v_stride_page, box_rows);
  } else {
    const cuuint64_t tokens = tma::single_request_maps(p) ? cuuint64_t(p.kv_len > 0 ? p.kv_len : 1) : 0x7fffffff;
    const int err = encode_fp8_kv_map(&maps->k, &maps->heads_outer_k, p.k, D, p.num_kv_heads, p.k_stride_n,
                                      p.k_stride_h, tokens, Traits::kKeysPerTile);
    if (err != cudaSuccess) return err;
    return encode_fp8_kv_map(&maps->v, &maps->heads_outer_v, p.v, D, p.num_kv_heads, p.v_stride_n, p.v_stride_h,
                             tokens, Traits::kKeysPerTile);
  }
}

}  // namespace fa3
}  // namespace flashjit
