// The loader warpgroup of fa3_attention_kernel (fa3_attention.cuh): K/V tiles
// into the ring of kStages slots, each with a "full" mbarrier (bytes landed)
// and an "empty" one (every consumer warp done with the slot), by TMA where
// whole tiles allow, else gathered (a paged cache without TMA boxes, a partial
// last tile).
#pragma once
#include <stdint.h>
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa3/fa3_primitives.cuh"

namespace flashjit {
namespace fa3 {

// The loader's whole work: for_each_position(load) walks the CTA's launch
// positions, calling load(item, seq) with each active one and the tiles the
// CTA loaded before it; full_k / full_v / empty_k / empty_v(tile) are a ring
// slot's barriers, k_slot(tile) its K tile's address (V follows).
template <class Traits, class ForEachPosition, class FullK, class FullV, class EmptyK, class EmptyV, class KSlot>
__device__ __forceinline__ void load_kv_tiles(const FlashjitAttentionParams& p, const KvMapsPagedArg& tma_arg,
                                              unsigned char* smem, int tid, const ForEachPosition& for_each_position,
                                              const FullK& full_k, const FullV& full_v, const EmptyK& empty_k,
                                              const EmptyV& empty_v, const KSlot& k_slot) {
  using T = typename Traits::DType;
  using KvLayout = typename Traits::KvLayout;
  constexpr int D = Traits::kHeadDim, KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages;
  // TMA tiles: whole 64-column blocks of K and of V (fa3_traits.cuh).
  using KCols = std::integral_constant<int, Traits::kTileCols>;
  using VCols = std::integral_constant<int, Traits::kVoTileCols>;
  const int lane = tid % 32;
  fa3::set_max_registers_dec<Traits::kLoaderRegs>();
  // Before tile gt reuses its slot: the slot's previous tile (gt - STAGES)
  // completed phase gt / STAGES - 1 of the slot's empty barriers.
  auto wait_empty = [&](uint32_t empty, int gt) {
    if (gt >= STAGES) tma::mbar_wait(empty, ((gt / STAGES) - 1) & 1);
  };
  if constexpr (Traits::kPaged) {
    // Only the first warp polls a slot's empty barrier; the other three wait
    // at a hardware barrier that it joins once the slot is free (polling warps
    // throttled the consumers' wgmma issue; docs/fa3.md, "One CTA", paged K/V).
    // Every warp takes each barrier generation once, so none can run a
    // generation ahead.
    auto wait_empty_all = [&](uint32_t empty, int gt) {
      if (gt < STAGES) return;
      if (tid < 32) wait_empty(empty, gt);
      fa3::loader_barrier();
    };
    using Copy = fa2::PagedTileCopy<T, KvLayout, KEYS, D, Traits::kLoaderThreads, Traits::kGatherSpan>;
    const int box_rows = tma_arg.page_box_rows;
    // A whole tile by TMA (the first warp reads the boxes' page ids at once,
    // lane j box j's, and lane 0 issues the boxes, counted on `full`; every
    // other loader thread arrives to complete the count), or gathered by every
    // thread's cp.async, rows past the request zero-filled.
    auto load = [&](const Copy& copy, const int (&pages)[Copy::R::kPerThread], const CUtensorMap* map,
                    int heads_outer, uint32_t dst, uint32_t full, const CtaWork& w, int k0, int valid) {
      if (box_rows > 0 && valid == KEYS) {
        if (tid < 32) {
          const int boxes = KEYS / box_rows;  // at most KEYS / 8: one per lane
          int page = 0, slot = 0;
          if (lane < boxes) {
            const int key = k0 + lane * box_rows, page_at = copy.page_div.div(key);
            slot = copy.page_div.mod(key, page_at);
            page = p.kv_page_indices[w.kv_start + page_at];
          }
          if (lane == 0) tma::mbar_arrive_expect_tx(full, Traits::kKTileBytes);  // K's and V's: of one width
          for (int j = 0; j < boxes; ++j) {
            const int box_page = __shfl_sync(0xffffffffu, page, j), box_slot = __shfl_sync(0xffffffffu, slot, j);
            if (lane == 0) {
#pragma unroll
              for (int b = 0; b < Traits::kTileCols / 64; ++b)
                tma::load_4d(dst + KvLayout::block(b) + j * box_rows * 128, map, 64 * b,
                             heads_outer ? box_slot : w.kv_head, heads_outer ? w.kv_head : box_slot, box_page, full);
            }
          }
          if (lane != 0) tma::mbar_arrive(full);
        } else {
          tma::mbar_arrive(full);
        }
      } else {
        copy.issue(dst, pages, k0, valid);
        cp_async_arrive_noinc(full);
      }
    };
    for_each_position([&](const auto& it, int seq) {
      const CtaWork& w = it.w;
      int pages[Copy::R::kPerThread];  // this thread's rows' pages, the same for K and V
      for (int t = 0; t < it.num_tiles; ++t) {
        // Formed per tile: two copies' addresses held across the loop would not fit the loader's registers.
        const Copy k_copy(kv_rows<T, true>(p, w, p.k, p.k_stride_n, p.k_stride_h, p.k_stride_page), tid);
        const Copy v_copy(kv_rows<T, true>(p, w, p.v, p.v_stride_n, p.v_stride_h, p.v_stride_page), tid);
        const int gt = seq + t, k0 = it.key_begin + t * KEYS, valid = min(KEYS, w.kv_len - k0);
        if (box_rows == 0 || valid < KEYS) k_copy.lookup(pages, k0, valid);
        wait_empty_all(empty_k(gt), gt);
        load(k_copy, pages, &tma_arg.maps.k, tma_arg.maps.heads_outer_k, k_slot(gt), full_k(gt), w, k0, valid);
        wait_empty_all(empty_v(gt), gt);
        load(v_copy, pages, &tma_arg.maps.v, tma_arg.maps.heads_outer_v, k_slot(gt) + Traits::kKTileBytes,
             full_v(gt), w, k0, valid);
      }
    });
    // Exits with no copy of this thread in flight.
    cp_async_commit();
    cp_async_wait<0>();
    return;
  }
  if (tid >= 32) return;
  // One whole K or V tile by TMA into `dst`, its bytes counted on `bar`: W
  // columns, whole 64-column blocks (a block past the data's last column
  // lands as zeros and counts in full).
  auto load = [&](auto width, uint32_t dst, const CUtensorMap* map, int heads_outer, uint32_t bar, int head,
                  int token) {
    constexpr int W = decltype(width)::value;
    tma::mbar_arrive_expect_tx(bar, KEYS * W * 2);
#pragma unroll
    for (int i = 0; i < W / 64; ++i)
      tma::load_kv_block(dst + KvLayout::block(i), map, heads_outer, i, head, token, bar);
  };
  for_each_position([&](const auto& it, int seq) {
    const CtaWork& w = it.w;
    for (int t = 0; t < it.num_tiles; ++t) {
      const int gt = seq + t, k0 = it.key_begin + t * KEYS, token = w.kv_start + k0;
      const bool whole = w.kv_len - k0 >= KEYS || tma::single_request_maps(p);  // else a partial tile, copied
      wait_empty(empty_k(gt), gt);
      if (whole && lane == 0)
        load(KCols{}, k_slot(gt), &tma_arg.maps.k, tma_arg.maps.heads_outer_k, full_k(gt), w.kv_head, token);
      wait_empty(empty_v(gt), gt);
      if (whole) {
        if (lane == 0)
          load(VCols{}, k_slot(gt) + Traits::kKTileBytes, &tma_arg.maps.v, tma_arg.maps.heads_outer_v, full_v(gt),
               w.kv_head, token);
      } else {
        fa3::copy_partial_tile<Traits>(p, w, smem + (gt % STAGES) * Traits::kStageBytes, k0, lane);
        if (lane == 0) {
          tma::mbar_arrive(full_k(gt));
          tma::mbar_arrive(full_v(gt));
        }
      }
    }
  });
}

}  // namespace fa3
}  // namespace flashjit
