// Element types and the conversions and warp reductions every kernel shares.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math_constants.h>
#include <stdint.h>

namespace flashjit {

// The smallest power of two that is at least n (n >= 1): the lanes or threads
// a row of n chunks (or a key of n dim groups) takes where the shuffles and
// copy passes that serve it work in powers of two.
__host__ __device__ constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return static_cast<float>(x); }

// FP8 (KV caches only): codes are widened to fp16, which holds every e4m3 and
// e5m2 value exactly (fp16 has more exponent range and mantissa bits than
// either), then to fp32, also exactly.
template <class T>
struct Fp8Format;
template <>
struct Fp8Format<__nv_fp8_e4m3> {
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E4M3;
};
template <>
struct Fp8Format<__nv_fp8_e5m2> {
  static constexpr __nv_fp8_interpretation_t kKind = __NV_E5M2;
};
template <class T>
constexpr bool kIsFp8 = sizeof(T) == 1;

// Unpacks the 4 FP8 codes of one 32-bit word into floats (two fp8x2 -> half2 conversions).
template <class T>
__device__ __forceinline__ void unpack_fp8_word(uint32_t word, float* out) {
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> (16 * pair)),
                                                     Fp8Format<T>::kKind);
    const float2 f = __half22float2(__half2(h));
    out[2 * pair] = f.x;
    out[2 * pair + 1] = f.y;
  }
}

// Unpacks one 8-byte vector of FP8 codes into 8 floats.
template <class T>
__device__ __forceinline__ void unpack8_fp8(const uint2& raw, float* out) {
  static_assert(kIsFp8<T>, "8-byte vectors of FP8 codes");
  unpack_fp8_word<T>(raw.x, out);
  unpack_fp8_word<T>(raw.y, out + 4);
}

// Quantises two floats to FP8 codes, rounding to nearest even and saturating
// at the format's largest finite value (448 for e4m3, 57344 for e5m2); NaN
// gives the format's NaN code.
template <class T>
__device__ __forceinline__ uint16_t quantize_fp8x2(float lo, float hi) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, Fp8Format<T>::kKind));
}

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Elements of T in one 16-byte vector: the unit of every global<->shared copy.
template <class T>
struct Vec16 {
  static constexpr int kElems = 16 / sizeof(T);
};

// Unpacks one 16-byte vector of T into floats.
template <class T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* out) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::kElems; ++i) out[i] = to_float(e[i]);
}

// 16 FP8 codes: four words.
template <>
__device__ __forceinline__ void unpack16<__nv_fp8_e4m3>(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) unpack_fp8_word<__nv_fp8_e4m3>(words[i], out + 4 * i);
}
template <>
__device__ __forceinline__ void unpack16<__nv_fp8_e5m2>(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) unpack_fp8_word<__nv_fp8_e5m2>(words[i], out + 4 * i);
}

// bf16 is the top half of an fp32: one shift or one mask per element.
template <>
__device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// exp2 that maps -inf to exactly 0 and never produces NaN from (-inf) - (-inf):
// callers pass differences whose both sides may be -inf on fully masked rows.
__device__ __forceinline__ float exp2_diff(float a, float b) {
  return (b == -CUDART_INF_F) ? 0.f : exp2f(a - b);
}

// 2^x in one MUFU instruction (2 ulp, like exp2f); results below 2^-126 flush
// to 0 and -inf gives 0. Callers keep x finite or -inf (never NaN).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flashjit
