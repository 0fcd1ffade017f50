// FP8 K/V caches in the fa2 kernel (fa2_attention.cuh): tiles of codes land in
// the ring as they are in global memory (head_dim bytes a row, fa2::PlainTile),
// and one pass per tile widens them into a K/V pair of 16-bit tiles in the
// layout the ldmatrix loads read. Widening e4m3 or e5m2 to fp16 or bf16 is
// exact (both 16-bit formats hold every code's value), so the MMAs see the
// cache's values; the dequantisation scales stay out of the tiles: k_scale
// folds into the softmax scale and v_scale into the output (docs/fp8.md).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/numeric.cuh"

namespace flashjit {
namespace fa2 {

// Two FP8 codes (the low and high byte of `pair`) as two T, packed.
template <class KvT, class T>
__device__ __forceinline__ uint32_t widen_fp8x2(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), Fp8Format<KvT>::kKind);
  if constexpr (std::is_same<T, __half>::value) {
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  } else {  // through fp32, exactly: bf16 holds every FP8 value
    const float2 f = __half22float2(__half2(h));
    __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<uint32_t*>(&b);
  }
}

// 16 codes -> 16 T: codes 0-7 in `lo`, 8-15 in `hi`.
template <class KvT, class T>
__device__ __forceinline__ void widen_fp8x16(const uint4& codes, uint4& lo, uint4& hi) {
  const uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = widen_fp8x2<KvT, T>(w[i] & 0xffffu);
    out[2 * i + 1] = widen_fp8x2<KvT, T>(w[i] >> 16);
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

// Widens rows 0 .. kRows - 1 of the code tile at `src` (kDim bytes a row) into
// the 16-bit tile of layout L at `dst`, kThreads threads (index `tid`) taking a
// 16-byte chunk of codes each per pass: a row's chunks go to the next power of
// two of threads (the threads past them idle at head dims 48, 80, 240, ...),
// rows to the rest. A chunk of codes is two chunks of the 16-bit row: a
// quarter warp (one code row at kDim = 128) stores the first of its pair into
// alternating halves of the row's 128-byte blocks, so that the eight 16-byte
// stores of a phase meet eight different bank groups.
template <class KvT, class T, class L, int kRows, int kDim, int kThreads>
__device__ __forceinline__ void widen_fp8_tile(uint32_t src, uint32_t dst, int tid) {
  constexpr int kChunks = kDim / 16;  // chunks of codes per row
  constexpr int kLanes = pow2_at_least(kChunks);
  constexpr int kRowsPerPass = kThreads / kLanes;
  static_assert(kThreads % kLanes == 0 && kRows % kRowsPerPass == 0, "whole passes over the tile");
  const int c = tid % kLanes, row0 = tid / kLanes;
  if (kLanes != kChunks && c >= kChunks) return;
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerPass; ++i) {
    const int row = row0 + i * kRowsPerPass;
    uint4 lo, hi;
    widen_fp8x16<KvT, T>(ld_shared_16(src + row * kDim + c * 16), lo, hi);
    const int first = (c / 4) % 2;
    st_shared_16(dst + L::at(row, 2 * c + first), first ? hi : lo);
    st_shared_16(dst + L::at(row, 2 * c + 1 - first), first ? lo : hi);
  }
}

}  // namespace fa2
}  // namespace flashjit
