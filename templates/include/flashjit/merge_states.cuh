// Combines partial attention states (normalised output, base-2 LSE) computed
// over disjoint key ranges into the final output and LSE:
//   M = max_s lse_s,  w_s = 2^(lse_s - M),  o = sum_s w_s o_s / sum_s w_s,
//   lse = M + log2(sum_s w_s).
// A row whose every state is empty (lse -inf) gets output 0 and LSE -inf.
#pragma once
#include "attention_params.cuh"
#include "numeric.cuh"

namespace flashjit {

// One CTA per (token, head): token `row / num_qo_heads` has partial rows
// [first, first + count) (see partial_row in work.cuh); a token with none was
// written by its attention CTA directly. A long context leaves dozens of
// partial rows per head and only a few heads to merge, so the warps split the
// partial rows (loads of several in flight each) and combine through shared
// memory; one warp walking all of them serially costs microseconds of latency.
template <class DTypeO, int kHeadDim>
__global__ void __launch_bounds__(128) merge_split_states_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  static_assert(kHeadDim % 32 == 0, "one lane per 32 dims");
  constexpr int kWarps = 4, kDimsPerLane = kHeadDim / 32;
  __shared__ float s_max[kWarps], s_sum[kWarps], s_acc[kWarps][kHeadDim];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = blockIdx.x;  // token * heads + head
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
  if (count == 0) return;  // uniform across the CTA
  auto lse_of = [&](int s) { return p.partial_lse[(first + s) * p.num_qo_heads + head]; };

  float m = -CUDART_INF_F;
  for (int s = threadIdx.x; s < count; s += 32 * kWarps) m = fmaxf(m, lse_of(s));
  m = warp_max(m);
  if (lane == 0) s_max[warp] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, s_max[w]);

  float acc[kDimsPerLane] = {};
  float sum = 0.f;
#pragma unroll 4
  for (int s = warp; s < count; s += kWarps) {
    const float w = exp2_diff(lse_of(s), m);
    sum += w;
    const float* src = p.partial_o + ((first + s) * p.num_qo_heads + head) * kHeadDim;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] = fmaf(w, src[lane + 32 * i], acc[i]);
  }
  if (lane == 0) s_sum[warp] = sum;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) s_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;

  sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += s_sum[w];
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  DTypeO* out = static_cast<DTypeO*>(p.o) + token * p.o_stride_n + head * p.o_stride_h;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s_acc[w][lane + 32 * i];
    out[lane + 32 * i] = from_float<DTypeO>(o * inv);
  }
  if (p.lse != nullptr && lane == 0) p.lse[token * p.lse_stride_n + head] = sum > 0.f ? m + log2f(sum) : -CUDART_INF_F;
}

// Runs after the attention kernel when any CTA wrote partial state.
template <class DTypeO, int kHeadDim>
int launch_merge_split_states(const FlashjitAttentionParams& p, bool write_lse, cudaStream_t stream) {
  const int rows = p.qo_len * p.num_qo_heads;
  if (rows == 0) return cudaSuccess;
  FlashjitAttentionParams merged = p;
  if (!write_lse) merged.lse = nullptr;
  merge_split_states_kernel<DTypeO, kHeadDim><<<rows, 128, 0, stream>>>(merged);
  return cudaGetLastError();
}

// True when the attention launch leaves partial states for the merge pass.
__host__ __forceinline__ bool has_partial_states(const FlashjitAttentionParams& p) {
  return p.merge_indptr != nullptr || (p.qo_indptr == nullptr && p.num_splits > 1);
}

}  // namespace flashjit
