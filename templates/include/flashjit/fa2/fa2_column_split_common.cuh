// What the kernels whose warps share one m16 fragment of rows and split the
// two products between them share (fa2_column_split.cuh, fa2_mla.cuh): warp w
// multiplies its own k-steps of S = Q.K^T, the partial logits meet in shared
// memory, and w owns a band of O's columns in O += P.V.
#pragma once
#include <math_constants.h>
#include <stdint.h>
#include "flashjit/fa2/fa2_primitives.cuh"

namespace flashjit {
namespace fa2 {

// The CTA's rows before their first key (softmax: a WarpSoftmax of one m16
// fragment): running max -inf, row sums 0, this warp's O columns 0.
template <class Softmax, int NT_O>
__device__ __forceinline__ void start_rows(Softmax& softmax, float (&o)[NT_O][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    softmax.m[0][r] = -CUDART_INF_F;
    softmax.l[0][r] = 0.f;
  }
#pragma unroll
  for (int n = 0; n < NT_O; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
}

// One k-step of S = Q.K^T over every key of a tile: s[2 jn], s[2 jn + 1] +=
// q_frag . K^T of keys 16 jn .. 16 jn + 15, K's B fragments read by ldmatrix
// from k_tile + jn * 16 rows + k_lane (this lane's offset) + k_step (the step's
// 128-byte block), summed in that order.
template <class T, int kKeys, int kRowBytes>
__device__ __forceinline__ void mma_qk_step_over_tile(float (&s)[kKeys / 8][4], const uint32_t (&q_frag)[4],
                                                      uint32_t k_tile, uint32_t k_lane, uint32_t k_step) {
#pragma unroll
  for (int jn = 0; jn < kKeys / 16; ++jn) {
    uint32_t b[4];
    ldmatrix_x4(b, k_tile + jn * 16 * kRowBytes + k_lane + k_step);
    mma_16816<T>(s[2 * jn], q_frag, b[0], b[1]);
    mma_16816<T>(s[2 * jn + 1], q_frag, b[2], b[3]);
  }
}

// Every warp's partial logits into the exchange (xchg, laid out [warp][value]
// [lane], kFloatsPerWarp a warp), a barrier, then the full logits summed over
// the kWarps warps in one fixed order, so that every warp holds the same S, bit
// for bit (0 + x is exact). The caller's next barrier frees the exchange.
template <int kWarps, int kFloatsPerWarp, int NT>
__device__ __forceinline__ void sum_logits_across_warps(float (&s)[NT][4], float* xchg, int warp, int lane) {
  float* mine = xchg + warp * kFloatsPerWarp + lane;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(j * 4 + e) * 32] = s[j][e];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < kWarps; ++v) {
        const float part = xchg[v * kFloatsPerWarp + (j * 4 + e) * 32 + lane];
        sum += v == warp ? s[j][e] : part;
      }
      s[j][e] = sum;
    }
}

}  // namespace fa2
}  // namespace flashjit
