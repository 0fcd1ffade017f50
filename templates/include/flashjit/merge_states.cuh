// Combines partial attention states (normalised output, base-2 LSE) computed
// over disjoint key ranges into the final output and LSE:
//   M = max_s lse_s,  w_s = 2^(lse_s - M),  o = sum_s w_s o_s / sum_s w_s,
//   lse = M + log2(sum_s w_s).
// A row whose every state is empty (lse -inf) gets output 0 and LSE -inf.
#pragma once
#include "attention_params.cuh"
#include "numeric.cuh"

namespace flashjit {

// Partial states of split-KV launches are laid out [token][head][split][dim]
// (LSE: [token][head][split]) so that the merge needs no total token count.
__host__ __device__ __forceinline__ int64_t partial_index(int token, int head, int split, int num_heads,
                                                          int num_splits) {
  return (static_cast<int64_t>(token) * num_heads + head) * num_splits + split;
}

template <class DTypeO, int kHeadDim>
__global__ void __launch_bounds__(128) merge_split_states_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  static_assert(kHeadDim % 32 == 0, "one lane per 32 dims");
  constexpr int kDimsPerLane = kHeadDim / 32;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // token * heads + head
  if (row >= p.qo_len * p.num_qo_heads) return;
  const int token = row / p.num_qo_heads, head = row % p.num_qo_heads;
  const int64_t base = partial_index(token, head, 0, p.num_qo_heads, p.num_splits);

  float m = -CUDART_INF_F;
  for (int s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.partial_lse[base + s]);
  float acc[kDimsPerLane] = {};
  float sum = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = exp2_diff(p.partial_lse[base + s], m);
    sum += w;
    const float* src = p.partial_o + (base + s) * kHeadDim;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] = fmaf(w, src[lane + 32 * i], acc[i]);
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  DTypeO* out = static_cast<DTypeO*>(p.o) + token * p.o_stride_n + head * p.o_stride_h;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) out[lane + 32 * i] = from_float<DTypeO>(acc[i] * inv);
  if (p.lse != nullptr && lane == 0) p.lse[token * p.lse_stride_n + head] = sum > 0.f ? m + log2f(sum) : -CUDART_INF_F;
}

template <class DTypeO, int kHeadDim>
int launch_merge_split_states(const FlashjitAttentionParams& p, cudaStream_t stream) {
  const int rows = p.qo_len * p.num_qo_heads;
  if (rows == 0) return cudaSuccess;
  constexpr int kWarps = 4;
  merge_split_states_kernel<DTypeO, kHeadDim><<<(rows + kWarps - 1) / kWarps, 32 * kWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashjit
