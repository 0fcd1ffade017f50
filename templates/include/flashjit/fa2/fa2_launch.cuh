// Host side of the fa2 tensor-core attention kernel (fa2_attention.cuh): the
// launch (with TMA, the K/V tensor maps encoded for the call) and the
// occupancy query the planner sizes its waves by.
#pragma once
#include "flashjit/fa2/fa2_attention.cuh"
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/tma.cuh"

namespace flashjit {

template <class Traits>
int launch_fa2_attention(const FlashjitAttentionParams& p, cudaStream_t stream) {
  KvMapsArg<Traits::kTmaKv> tma_arg;
  if constexpr (Traits::kTmaKv) {
    if (p.num_work > 0 && p.num_kv_heads > 0) {
      const int err =
          tma::encode_kv_maps<typename Traits::DType, Traits::kKeysPerTile>(&tma_arg.maps, p, Traits::kHeadDim,
                                                                           Traits::kHeadDim);
      if (err != cudaSuccess) return err;
    }
  }
  return launch_attention<fa2_attention_kernel<Traits>, typename Traits::DType, Traits::kHeadDimVo, Traits::kLse>(
      p, Traits::kThreads, static_cast<int>(Traits::kSmemBytes), stream, tma_arg);
}

// Decode with one query head per KV head (MHA) launches MhaTraits instead: the
// same kernel under a tighter register cap, so that more of its CTAs share an SM
// (Fa2Tiling.mha_min_blocks_per_sm). The planner sizes waves by Traits.
template <class Traits, class MhaTraits>
int launch_fa2_attention_or_mha(const FlashjitAttentionParams& p, cudaStream_t stream) {
  if (p.num_qo_heads == p.num_kv_heads) return launch_fa2_attention<MhaTraits>(p, stream);
  return launch_fa2_attention<Traits>(p, stream);
}

template <class Traits>
int fa2_ctas_per_sm() {
  return ctas_per_sm<fa2_attention_kernel<Traits>>(Traits::kThreads, static_cast<int>(Traits::kSmemBytes));
}

}  // namespace flashjit
