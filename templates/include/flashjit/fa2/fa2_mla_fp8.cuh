// MLA over an FP8 cache (fa2_mla.cuh, fa2_mla_wide.cuh, fa3/fa3_mla_fp8.cuh):
// the widening of a thread's chunks of codes into the 16-bit tile the MMAs
// read (exact: fa2_fp8.cuh), and the cache's two dequantisation scales.
//
// ckv values are codes x ckv_scale (params k_scale, as k is the ckv cache),
// kpe values codes x kpe_scale (v_scale: v is the kpe cache). The two parts of
// a logit carry different scales, so no single factor of the softmax scale
// takes both:
//   logit = sm_scale (ckv_scale q_nope.c_ckv + kpe_scale q_pe.c_kpe)
//         = (sm_scale kpe_scale) (ratio q_nope.c_ckv + q_pe.c_kpe),
//   ratio = ckv_scale / kpe_scale.
// Every kernel accumulates the ckv k-steps first, multiplies that fp32 partial
// S by ratio, then accumulates the kpe k-steps on top; sm_scale kpe_scale
// joins the softmax scale as k_scale does in the other kernels. The query stays
// as given: folding a scale into it would round q_nope x ckv_scale to 16 bits,
// an error of q's unit roundoff on every logit. ckv_scale multiplies the
// normalised output in fp32 (ckv is V), before it is rounded. docs/mla.md,
// "FP8 caches", and docs/numerics.md derive the error terms.
#pragma once
#include <stdint.h>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_fp8.cuh"

namespace flashjit {
namespace fa2 {

// The chunks sub, sub + kStride, ... (kChunks of them) of one row of codes at
// `codes` (16 codes a chunk, unswizzled), widened into row `row` of the
// 16-bit tile at `dst` (Traits::Layout, two chunks each). With four threads a
// row and rows in thread order, the 8 threads of a quarter warp read 128
// contiguous bytes, and store into 8 distinct 16-byte bank groups: their two
// rows' swizzles differ in the lowest bit, the chunk pairs of one row in the
// others.
template <class Traits, int kChunks, int kStride>
__device__ __forceinline__ void widen_mla_chunks(uint32_t codes, uint32_t dst, int row, int sub) {
  using L = typename Traits::Layout;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = sub + kStride * i;
    uint4 lo, hi;
    widen_fp8x16<typename Traits::KvType, typename Traits::DType>(ld_shared_16(codes + c * 16), lo, hi);
    st_shared_16(dst + L::at(row, 2 * c), lo);
    st_shared_16(dst + L::at(row, 2 * c + 1), hi);
  }
}

// An FP8 MLA cache's scales as the kernels apply them (read after the grid
// dependency wait: a CUDA graph replays with the values the tensors hold).
struct MlaKvScales {
  float ckv;    // on the normalised output
  float ratio;  // ckv_scale / kpe_scale, on the ckv part of S
  float kpe;    // joins sm_scale

  __device__ __forceinline__ explicit MlaKvScales(const FlashjitAttentionParams& p) {
    ckv = kv_scale_value(p.k_scale_ptr, p.k_scale);
    kpe = kv_scale_value(p.v_scale_ptr, p.v_scale);
    ratio = __fdiv_rn(ckv, kpe);
  }
  // sm_scale x kpe_scale x log2(e): the softmax's scale of S (base-2 exponents).
  __device__ __forceinline__ float softmax_scale(float sm_scale, float log2e) const {
    return __fmul_rn(__fmul_rn(sm_scale, kpe), log2e);
  }
};

// The scales an MLA kernel applies: the softmax's (sm_scale x log2 e; with an
// FP8 cache, MlaKvScales::softmax_scale), the ratio on S's ckv part and the
// normalised output's (both 1 with a cache of q's dtype).
template <bool kKvFp8>
struct MlaScales {
  float softmax, ckv_ratio = 1.f, out = 1.f;
  __device__ __forceinline__ MlaScales(const FlashjitAttentionParams& p, float log2e) {
    if constexpr (kKvFp8) {
      const MlaKvScales scales(p);
      softmax = scales.softmax_scale(p.sm_scale, log2e);
      ckv_ratio = scales.ratio;
      out = scales.ckv;
    } else {
      softmax = p.sm_scale * log2e;
    }
  }
};

// S's ckv part x ratio, once its k-steps have landed and before the kpe ones.
template <int NT>
__device__ __forceinline__ void scale_ckv_part(float (&s)[NT][4], float ratio) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = __fmul_rn(s[j][e], ratio);
}

}  // namespace fa2
}  // namespace flashjit
