// Combines partial attention states (normalised output, base-2 LSE) computed
// over disjoint key ranges into the final output and LSE:
//   M = max_s lse_s,  w_s = 2^(lse_s - M),  o = sum_s w_s o_s / sum_s w_s,
//   lse = M + log2(sum_s w_s).
// A row whose every state is empty (lse -inf) gets output 0 and LSE -inf.
#pragma once
#include "attention_params.cuh"
#include "numeric.cuh"

namespace flashjit {

// One warp per (token, head): token `row / num_qo_heads` has partial rows
// [first, first + count) (see partial_row in work.cuh); a token with none was
// written by its attention CTA directly.
template <class DTypeO, int kHeadDim>
__global__ void __launch_bounds__(128) merge_split_states_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  static_assert(kHeadDim % 32 == 0, "one lane per 32 dims");
  constexpr int kDimsPerLane = kHeadDim / 32;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // token * heads + head
  if (row >= p.qo_len * p.num_qo_heads) return;
  const int token = row / p.num_qo_heads, head = row % p.num_qo_heads;
  int64_t first;
  int count;
  if (p.merge_indptr != nullptr) {
    first = p.merge_indptr[token];
    count = p.merge_indptr[token + 1] - p.merge_indptr[token];
  } else {
    first = int64_t(token) * p.num_splits;
    count = p.num_splits;
  }
  if (count == 0) return;

  float m = -CUDART_INF_F;
  for (int s = 0; s < count; ++s) m = fmaxf(m, p.partial_lse[(first + s) * p.num_qo_heads + head]);
  float acc[kDimsPerLane] = {};
  float sum = 0.f;
  for (int s = 0; s < count; ++s) {
    const int64_t idx = (first + s) * p.num_qo_heads + head;
    const float w = exp2_diff(p.partial_lse[idx], m);
    sum += w;
    const float* src = p.partial_o + idx * kHeadDim;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] = fmaf(w, src[lane + 32 * i], acc[i]);
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  DTypeO* out = static_cast<DTypeO*>(p.o) + token * p.o_stride_n + head * p.o_stride_h;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) out[lane + 32 * i] = from_float<DTypeO>(acc[i] * inv);
  if (p.lse != nullptr && lane == 0) p.lse[token * p.lse_stride_n + head] = sum > 0.f ? m + log2f(sum) : -CUDART_INF_F;
}

// Runs after the attention kernel when any CTA wrote partial state.
template <class DTypeO, int kHeadDim>
int launch_merge_split_states(const FlashjitAttentionParams& p, bool write_lse, cudaStream_t stream) {
  const int rows = p.qo_len * p.num_qo_heads;
  if (rows == 0) return cudaSuccess;
  FlashjitAttentionParams merged = p;
  if (!write_lse) merged.lse = nullptr;
  constexpr int kWarps = 4;
  merge_split_states_kernel<DTypeO, kHeadDim><<<(rows + kWarps - 1) / kWarps, 32 * kWarps, 0, stream>>>(merged);
  return cudaGetLastError();
}

// True when the attention launch leaves partial states for the merge pass.
__host__ __forceinline__ bool has_partial_states(const FlashjitAttentionParams& p) {
  return p.merge_indptr != nullptr || (p.qo_indptr == nullptr && p.num_splits > 1);
}

}  // namespace flashjit
