// Attention sinks (FlashjitAttentionParams::sinks): a finished row of base-2
// LSE `lse` gains one more logit, its head's sink s (natural units, s log2 e
// in base 2), whose probability joins the denominator but not the output:
//   lse' = log2(2^lse + 2^(s log2 e)),   o' = o * 2^(lse - lse'),
// formed as max + log2(1 + 2^(min - max)), so that neither side overflows
// however far the sink is from the row's logits. Only final rows fold it (a
// CTA's direct write, the merge of split-KV states, batch-invariant mode's
// fold); partial states leave it out, so it counts once. Every rounding is
// spelled out and the factor multiplies the normalised output as a separate
// product, so that every path to a row gives the same bits. A sink of -inf
// changes nothing, bit for bit (the factor is exactly 1, lse' is lse); a row
// that saw no key (lse -inf) keeps output 0 and takes the sink's LSE.
#pragma once
#include <math_constants.h>

namespace flashjit {

// The factor of row `head`'s normalised output; folds the sink into `lse`.
// No sinks (null): 1, and lse unchanged.
__device__ __forceinline__ float fold_sink(const float* sinks, int head, float& lse) {
  if (sinks == nullptr) return 1.f;
  const float s = __fmul_rn(sinks[head], 1.4426950408889634f);
  const float hi = fmaxf(lse, s), lo = fminf(lse, s);
  if (hi == -CUDART_INF_F) return 1.f;  // no key and no sink: the row stays 0 with LSE -inf
  const float merged = __fadd_rn(hi, log2f(__fadd_rn(1.f, exp2f(__fsub_rn(lo, hi)))));
  const float factor = exp2f(__fsub_rn(lse, merged));
  lse = merged;
  return factor;
}

}  // namespace flashjit
