// The online softmax of one warp of fa2_attention_kernel: for each of its
// kFragsM m16 fragments a lane holds two rows (g and g + 8) of S, of O and of
// the running max m and row sum l. Logits are in the units of s (before
// `scale`); exponentials are base 2 (scale holds log2(e)).
//
// Rows-split prefill keeps a lazy max: a row's m moves only on a step where the
// row has grown past it by more than kLazyLog2 (log2 units), and its
// exponentials are taken against the stale m otherwise. P then stays below
// 2^kLazyLog2, O and l carry the same factor (the result is the same function;
// rounding P to T is relative, so its error does not change), and O's
// 4 * FM * NT_O rescale multiplies run only on steps where some row of the warp
// moves: for random logits about the first step of each row. Split keys
// (decode) keep the exact running max: a warp vote skips the multiplies when no
// row's max moved.
#pragma once
#include <math_constants.h>
#include "flashjit/fa2/fa2_primitives.cuh"

namespace flashjit {
namespace fa2 {

template <class Traits>
struct WarpSoftmax {
  using T = typename Traits::DType;
  static constexpr int FM = Traits::kFragsM;
  static constexpr int NT_S = Traits::kKeysPerStep / 8;       // n8 tiles of S
  static constexpr int NT_O = Traits::kHeadDimVo / 8;           // n8 tiles of O
  static constexpr int KSTEPS_PV = Traits::kKeysPerStep / 16;  // k-steps of O += P.V
  static constexpr bool kLazyMax = !Traits::kSplitKeys;
  static constexpr float kLazyLog2 = 8.f;

  // Without soft-cap, s_log2 = s * scale is folded into the exponent (FFMA);
  // with it, s is replaced by cap_out * tanh(s * cap_in) (already log2 units)
  // and scale is 1.
  float scale, cap_in, cap_out;
  float l[FM][2];  // this lane's partial row sums; quad-reduced at the end
  float m[FM][2];  // running max, in the units of s (before `scale`)
  // m_ref: the exponent reference m * scale, 0 while m = -inf, so that
  // exp2(-inf - (-inf)) never makes a NaN (a row that has seen no key gets 0
  // everywhere). The exact path leaves l's factor in l_scale, for one FFMA
  // with the sum.
  float m_ref[FM][2], l_scale[FM][2];

  // Soft-cap, mask (need_mask: mask(s[f], f, k0) for keys from k0) and the
  // rows' new max; m_ref set, O and l rescaled. o_zero: this warp's O and l
  // are still 0 (its first step), so the rescale can leave them alone. O may
  // hold more n8 tiles than the output's (fa3 at head dim 96: whole blocks).
  template <class Mask, int kNtO>
  __device__ __forceinline__ void update_max(float (&s)[FM][NT_S][4], float (&o)[FM][kNtO][4], int k0,
                                             bool need_mask, bool o_zero, const Mask& mask) {
    const float kNegInf = -CUDART_INF_F;
    float mx[FM][2];  // the step's new running max per row
#pragma unroll
    for (int f = 0; f < FM; ++f) {
      if constexpr (Traits::kSoftCap) {
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[f][j][e] = cap_out * tanhf(s[f][j][e] * cap_in);
      }
      if (need_mask) mask(s[f], f, k0);
      // Row maxima across the 4 lanes of the quad; the two rows' chains are
      // interleaved so that their latencies overlap.
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[f][r] = fmaxf(m[f][r], row_max<NT_S>(s[f], r));
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[f][r] = fmaxf(mx[f][r], __shfl_xor_sync(0xffffffffu, mx[f][r], 1));
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[f][r] = fmaxf(mx[f][r], __shfl_xor_sync(0xffffffffu, mx[f][r], 2));
    }

    // Row r of fragment f takes mx[f][r] as its max where moves[r], with O and
    // l rescaled to it, and keeps m (a factor of exactly 1) elsewhere.
    // The roundings of l, m * scale and the rescale are spelled out (__fmul_rn,
    // __fadd_rn are never fused into an FMA): left to the compiler, a product
    // shared with m_ref or an add next to the multiply was fused for some of a
    // lane's rows and not others, so a row's bits depended on its place in the
    // fragment (r, f) and two tilings, or a decode row against its prefill row,
    // differed in the last bit of l and the LSE (batch-invariant mode needs them equal).
    auto move_max = [&](int f, const bool (&moves)[2]) {
      float rescale[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float ref = mx[f][r] == kNegInf ? 0.f : __fmul_rn(mx[f][r], scale);
        rescale[r] = moves[r] ? exp2_fast(__fsub_rn(__fmul_rn(m[f][r], scale), ref)) : 1.f;
        if (moves[r]) m[f][r] = mx[f][r];
        if constexpr (kLazyMax) {
          l[f][r] = __fmul_rn(l[f][r], rescale[r]);
        } else {
          l_scale[f][r] = rescale[r];
        }
      }
      if (!o_zero && (kLazyMax || __any_sync(0xffffffffu, rescale[0] != 1.f || rescale[1] != 1.f))) {
#pragma unroll
        for (int n = 0; n < kNtO; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[f][n][e] *= rescale[e >> 1];
      }
    };
    if constexpr (kLazyMax) {
      // Each row decides from its own logits alone, so that its result does
      // not depend on which rows share its warp (paged and ragged prefill,
      // with other tilings, stay identical bit for bit); the warp only skips
      // the multiplies when no row moves. (-inf) - (-inf) is NaN, which
      // compares false: a row that still sees no key never moves; a first
      // visible key always does.
      bool moves[FM][2], any = false;
#pragma unroll
      for (int f = 0; f < FM; ++f)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          moves[f][r] = (mx[f][r] - m[f][r]) * scale > kLazyLog2;
          any |= moves[f][r];
        }
      if (__any_sync(0xffffffffu, any)) {
#pragma unroll
        for (int f = 0; f < FM; ++f) move_max(f, moves[f]);
      }
    } else {
      constexpr bool kAlways[2] = {true, true};
#pragma unroll
      for (int f = 0; f < FM; ++f) move_max(f, kAlways);
    }
#pragma unroll
    for (int f = 0; f < FM; ++f)
#pragma unroll
      for (int r = 0; r < 2; ++r) m_ref[f][r] = m[f][r] == kNegInf ? 0.f : __fmul_rn(m[f][r], scale);
  }

  // Exponentials of fragment f's S against m_ref, their sums into l, and P
  // rounded to T in pa[f].
  __device__ __forceinline__ void exp_to_p(float (&s)[FM][NT_S][4], uint32_t (&pa)[FM][KSTEPS_PV][4], int f) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < NT_S; ++j) {
        s[f][j][2 * r] = exp2_fast(fmaf(s[f][j][2 * r], scale, -m_ref[f][r]));
        s[f][j][2 * r + 1] = exp2_fast(fmaf(s[f][j][2 * r + 1], scale, -m_ref[f][r]));
      }
      const float sum = row_sum<NT_S>(s[f], r);  // unrounded fp32 P
      l[f][r] = kLazyMax ? __fadd_rn(l[f][r], sum) : fmaf(l[f][r], l_scale[f][r], sum);
    }
    // P rounded to T, as the A operand of k-step kk (keys 16kk .. 16kk+15).
#pragma unroll
    for (int kk = 0; kk < KSTEPS_PV; ++kk) {
      pa[f][kk][0] = pack2<T>(s[f][2 * kk][0], s[f][2 * kk][1]);
      pa[f][kk][1] = pack2<T>(s[f][2 * kk][2], s[f][2 * kk][3]);
      pa[f][kk][2] = pack2<T>(s[f][2 * kk + 1][0], s[f][2 * kk + 1][1]);
      pa[f][kk][3] = pack2<T>(s[f][2 * kk + 1][2], s[f][2 * kk + 1][3]);
    }
  }
};

}  // namespace fa2
}  // namespace flashjit
