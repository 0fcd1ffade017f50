// Host side of the fa3 attention kernel (fa3_attention.cuh): the K/V tensor
// maps encoded for the call, the launch, and the occupancy query the planner
// sizes its waves by.
#pragma once
#include <type_traits>
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/fa3/fa3_attention.cuh"

namespace flashjit {

template <class Traits>
int launch_fa3_attention(const FlashjitAttentionParams& p, cudaStream_t stream) {
  KvMapsArg<true> tma_arg;
  if (p.num_work > 0 && p.num_kv_heads > 0) {
    constexpr CUtensorMapDataType kType = std::is_same<typename Traits::DType, __half>::value
                                              ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                              : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    KvTensorMaps& maps = tma_arg.maps;
    int err = tma::encode_kv_map<Traits::kKeysPerTile>(&maps.k, &maps.heads_outer_k, p.k, kType, Traits::kHeadDim,
                                                       p.num_kv_heads, p.k_stride_n, p.k_stride_h);
    if (err == cudaSuccess)
      err = tma::encode_kv_map<Traits::kKeysPerTile>(&maps.v, &maps.heads_outer_v, p.v, kType, Traits::kHeadDim,
                                                     p.num_kv_heads, p.v_stride_n, p.v_stride_h);
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
