// Host side of the fa3 attention kernel (fa3_attention.cuh): the K/V tensor
// maps encoded for the call, the launch, and the occupancy query the planner
// sizes its waves by.
#pragma once
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/fa3/fa3_attention.cuh"

namespace flashjit {

// The slots of one TMA box of a paged cache, or 0 where whole tiles are
// gathered instead: a tile must be whole pages or lie within one, and a box of
// at least 64 rows: smaller boxes ran slower than the gather (docs/fa3.md,
// "One CTA", paged K/V).
template <int kKeysPerTile>
int fa3_page_box_rows(int page_size) {
  constexpr int kMinBoxRows = 64;
  if (page_size < kMinBoxRows || (kKeysPerTile % page_size != 0 && page_size % kKeysPerTile != 0)) return 0;
  return page_size < kKeysPerTile ? page_size : kKeysPerTile;
}

template <class Traits>
int launch_fa3_attention(const FlashjitAttentionParams& p, cudaStream_t stream) {
  using DType = typename Traits::DType;
  KvMapsPagedArg tma_arg{};
  if (p.num_work > 0 && p.num_kv_heads > 0) {
    if constexpr (Traits::kPaged) {
      // Pages by TMA where the page size allows and the driver encodes the maps; else every tile is gathered.
      // An FP8 cache's maps have rows of codes (fa3_fp8.cuh).
      const int rows = fa3_page_box_rows<Traits::kKeysPerTile>(p.page_size);
      if (rows > 0 && (Traits::kKvFp8 ? fa3::encode_fp8_kv_maps<Traits>(&tma_arg.maps, p, rows)
                                      : tma::encode_paged_kv_maps<DType>(&tma_arg.maps, p, Traits::kHeadDim,
                                                                         Traits::kHeadDim, rows)) == cudaSuccess)
        tma_arg.page_box_rows = rows;
    } else {
      const int err = Traits::kKvFp8 ? fa3::encode_fp8_kv_maps<Traits>(&tma_arg.maps, p, 0)
                                     : tma::encode_kv_maps<DType, Traits::kKeysPerTile>(&tma_arg.maps, p,
                                                                                        Traits::kHeadDim,
                                                                                        Traits::kHeadDimVo);
      if (err != cudaSuccess) return err;
    }
  }
  // Batch-invariant mode runs its own kernel (Fa3Traits::kChunkFold) on a
  // persistent grid whatever the tiling: a CTA that folds chunks keeps its
  // running output in partial_o slot blockIdx.x, and the host sizes the
  // scratch for one slot per SM (or per resident CTA).
  const bool fold = p.invariant_chunk > 0;
  const int max_ctas = Traits::kPersistent || fold ? multiprocessors() : 0;
  if (max_ctas < 0) return cudaErrorUnknown;
  using Fold = typename Traits::WithChunkFold;
  if (fold) {
    return launch_attention_ctas<fa3_attention_kernel<Fold>, typename Traits::DType, Traits::kHeadDimVo, Traits::kLse>(
        p, Traits::kThreads, static_cast<int>(Traits::kSmemBytes), max_ctas, stream, tma_arg);
  }
  return launch_attention_ctas<fa3_attention_kernel<Traits>, typename Traits::DType, Traits::kHeadDimVo, Traits::kLse>(
      p, Traits::kThreads, static_cast<int>(Traits::kSmemBytes), max_ctas, stream, tma_arg);
}

template <class Traits>
int fa3_ctas_per_sm() {
  return ctas_per_sm<fa3_attention_kernel<Traits>>(Traits::kThreads, static_cast<int>(Traits::kSmemBytes));
}

}  // namespace flashjit
