// Host side of the fa3 attention kernel (fa3_attention.cuh): the K/V tensor
// maps encoded for the call, the launch, and the occupancy query the planner
// sizes its waves by.
#pragma once
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/fa3/fa3_attention.cuh"

namespace flashjit {

template <class Traits>
int launch_fa3_attention(const FlashjitAttentionParams& p, cudaStream_t stream) {
  KvMapsArg<true> tma_arg{};
  if (!Traits::kPaged && p.num_work > 0 && p.num_kv_heads > 0) {  // paged tiles are gathered by cp.async
    const int err =
        tma::encode_kv_maps<typename Traits::DType, Traits::kKeysPerTile>(&tma_arg.maps, p, Traits::kHeadDim);
    if (err != cudaSuccess) return err;
  }
  const int max_ctas = Traits::kPersistent ? multiprocessors() : 0;
  if (max_ctas < 0) return cudaErrorUnknown;
  return launch_attention_ctas<fa3_attention_kernel<Traits>, typename Traits::DType, Traits::kHeadDim, Traits::kLse>(
      p, Traits::kThreads, static_cast<int>(Traits::kSmemBytes), max_ctas, stream, tma_arg);
}

template <class Traits>
int fa3_ctas_per_sm() {
  return ctas_per_sm<fa3_attention_kernel<Traits>>(Traits::kThreads, static_cast<int>(Traits::kSmemBytes));
}

}  // namespace flashjit
