// Batch-invariant mode's merge of a row's per-chunk attention states: the keys
// of a request are cut into chunks of a fixed size from key 0, each chunk's
// state (normalised output o_c, base-2 LSE lse_c) is computed alone, and the
// states are folded in chunk order:
//   m' = max(m, lse_c),  a = 2^(m - m'),  b = 2^(lse_c - m'),
//   sum' = sum * a + b,  acc' = acc * a + o_c * b,
// with o = acc / sum and LSE m + log2(sum) at the end. Two places run it and
// must agree bit for bit: the merge pass over split chunks
// (merge_fold_states_kernel in merge_states.cuh) and a prefill CTA that walks a
// row's chunks itself (fa3_attention.cuh), which then writes no partial state.
// Every rounding is spelled out (__fmul_rn, __fmaf_rn, __fadd_rn are never
// contracted), so neither the compiler's fusing nor the calling code changes a
// bit. An empty chunk (lse -inf) folds as the identity: a = 1 (exp2f(0) is exact),
// b = 0; so do leading empty chunks (m stays -inf, acc and sum 0), and a row
// that sees one chunk ends with acc = o_c, sum = 1: the bits of its direct write.
#pragma once
#include <math_constants.h>
#include "flashjit/common/numeric.cuh"

namespace flashjit {

struct ChunkFold {
  float m;    // running maximum of the folded chunks' LSEs (-inf: none seen a key)
  float sum;  // running weight, relative to 2^m

  __device__ __forceinline__ void reset() {
    m = -CUDART_INF_F;
    sum = 0.f;
  }
  // The weights of the running accumulator (a) and of a chunk of LSE lse (b)
  // when the running maximum goes from m_before to m_after = max(m_before, lse).
  // The maxima are exact, so a caller may form them in any order (a prefix
  // maximum across lanes) and get the weights add() gets.
  static __device__ __forceinline__ void weights(float m_before, float m_after, float lse, float& a, float& b) {
    a = m_before == -CUDART_INF_F ? 0.f : exp2f(__fsub_rn(m_before, m_after));
    b = lse == -CUDART_INF_F ? 0.f : exp2f(__fsub_rn(lse, m_after));
  }
  // Folds in a chunk of LSE lse: returns the weights of the running
  // accumulator (a) and of the chunk's output (b).
  __device__ __forceinline__ void add(float lse, float& a, float& b) {
    const float m_new = fmaxf(m, lse);
    weights(m, m_new, lse, a, b);
    add_weights(a, b);
    m = m_new;
  }
  __device__ __forceinline__ void add_weights(float a, float b) { sum = __fmaf_rn(sum, a, b); }
  // One element of the accumulator after add(): acc * a + o * b.
  static __device__ __forceinline__ float fold(float acc, float a, float b, float o) {
    return __fmaf_rn(b, o, __fmul_rn(acc, a));
  }
  // The factor of the final output (acc times it) and the row's LSE; a row
  // that has seen no key gets 0 and -inf.
  __device__ __forceinline__ float inv_sum() const { return sum > 0.f ? __frcp_rn(sum) : 0.f; }
  __device__ __forceinline__ float lse() const { return sum > 0.f ? __fadd_rn(m, log2f(sum)) : -CUDART_INF_F; }
};

}  // namespace flashjit
