// Appending new keys/values to a paged KV cache: one CTA per new token looks
// up its page once and copies all its heads in 16-byte vectors, K and V.
// Token i goes to page kv_indices[kv_indptr[batch_indices[i]] + positions[i] /
// page_size], slot positions[i] % page_size.
// Into an FP8 cache from fp16/bf16 rows, each element is quantised on the way:
// x / scale in fp32 (one correctly rounded division), then to the nearest FP8
// code (ties to even), saturating at the format's largest finite value (448
// for e4m3, 57344 for e5m2; infinities too); NaN stays NaN. 16 bytes in, 8 out.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <type_traits>
#include "flashjit/common/attention_params.cuh"  // FLASHJIT_ABI_VERSION
#include "flashjit/common/numeric.cuh"

extern "C" {

// Mirrored by flashjit/loader.py (AppendParams); versioned with FLASHJIT_ABI_VERSION.
struct FlashjitAppendParams {
  const void* key;                 // [nnz, num_heads, head_dim], strides below
  const void* value;
  void* k_cache;                   // page p, slot s, head h at p * stride_page + s * stride_slot + h * stride_h
  void* v_cache;
  const int32_t* batch_indices;    // [nnz]
  const int32_t* positions;        // [nnz]
  const int32_t* kv_indices;       // page ids of every request, concatenated
  const int32_t* kv_indptr;        // [batch + 1]
  int32_t nnz;
  int32_t num_heads;
  int32_t page_size;
  int32_t reserved;
  int64_t key_stride_n, key_stride_h, value_stride_n, value_stride_h;  // in elements
  int64_t k_stride_page, k_stride_slot, k_stride_h;
  int64_t v_stride_page, v_stride_slot, v_stride_h;
  // FP8 caches only: appended K is quantised as key / k_scale, V as value /
  // v_scale; a non-null pointer (one float on the device) takes precedence.
  float k_scale;
  float v_scale;
  const float* k_scale_ptr;
  const float* v_scale_ptr;
};

// As flashjit_attention_run: the stream, then the params, in one block.
struct FlashjitAppendLaunch {
  void* stream;  // cudaStream_t
  FlashjitAppendParams params;
};

int flashjit_append_run(const FlashjitAppendLaunch* launch);

}  // extern "C"

namespace flashjit {

// 8 fp16/bf16 elements (16 bytes) -> 8 FP8 codes (8 bytes), divided by `scale`.
template <class TIn, class TCache>
__device__ __forceinline__ uint2 quantize8(const uint4& raw, float scale) {
  const TIn* e = reinterpret_cast<const TIn*>(&raw);
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const uint32_t lo = quantize_fp8x2<TCache>(__fdiv_rn(to_float(e[4 * w]), scale),
                                               __fdiv_rn(to_float(e[4 * w + 1]), scale));
    const uint32_t hi = quantize_fp8x2<TCache>(__fdiv_rn(to_float(e[4 * w + 2]), scale),
                                               __fdiv_rn(to_float(e[4 * w + 3]), scale));
    words[w] = lo | (hi << 16);
  }
  return make_uint2(words[0], words[1]);
}

template <class TIn, class TCache, int kHeadDim>
__global__ void __launch_bounds__(128) append_quantize_kernel(const __grid_constant__ FlashjitAppendParams p) {
  constexpr int kVec = 16 / sizeof(TIn);  // elements per 16-byte load, and per 8-byte store
  constexpr int kVecsPerHead = kHeadDim / kVec;
  static_assert(sizeof(TIn) == 2 && kIsFp8<TCache>, "fp16/bf16 rows into an FP8 cache");
  static_assert(kHeadDim % kVec == 0, "whole 16-byte vectors per head");
  const int i = blockIdx.x;
  const int request = p.batch_indices[i], pos = p.positions[i];
  const int64_t page = p.kv_indices[p.kv_indptr[request] + pos / p.page_size];
  const int64_t slot = pos % p.page_size;
  const float k_scale = p.k_scale_ptr != nullptr ? *p.k_scale_ptr : p.k_scale;
  const float v_scale = p.v_scale_ptr != nullptr ? *p.v_scale_ptr : p.v_scale;
  const TIn* key = static_cast<const TIn*>(p.key) + int64_t(i) * p.key_stride_n;
  const TIn* value = static_cast<const TIn*>(p.value) + int64_t(i) * p.value_stride_n;
  TCache* k_dst = static_cast<TCache*>(p.k_cache) + page * p.k_stride_page + slot * p.k_stride_slot;
  TCache* v_dst = static_cast<TCache*>(p.v_cache) + page * p.v_stride_page + slot * p.v_stride_slot;
  for (int idx = threadIdx.x; idx < p.num_heads * kVecsPerHead; idx += blockDim.x) {
    const int h = idx / kVecsPerHead, c = (idx % kVecsPerHead) * kVec;
    const uint4 k = *reinterpret_cast<const uint4*>(key + h * p.key_stride_h + c);
    const uint4 v = *reinterpret_cast<const uint4*>(value + h * p.value_stride_h + c);
    *reinterpret_cast<uint2*>(k_dst + h * p.k_stride_h + c) = quantize8<TIn, TCache>(k, k_scale);
    *reinterpret_cast<uint2*>(v_dst + h * p.v_stride_h + c) = quantize8<TIn, TCache>(v, v_scale);
  }
}

template <class T, int kHeadDim>
__global__ void __launch_bounds__(128) append_paged_kernel(const __grid_constant__ FlashjitAppendParams p) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecsPerHead = kHeadDim / kVec;
  static_assert(kHeadDim % kVec == 0, "whole 16-byte vectors per head");
  const int i = blockIdx.x;
  const int request = p.batch_indices[i], pos = p.positions[i];
  const int64_t page = p.kv_indices[p.kv_indptr[request] + pos / p.page_size];
  const int64_t slot = pos % p.page_size;
  const T* key = static_cast<const T*>(p.key) + int64_t(i) * p.key_stride_n;
  const T* value = static_cast<const T*>(p.value) + int64_t(i) * p.value_stride_n;
  T* k_dst = static_cast<T*>(p.k_cache) + page * p.k_stride_page + slot * p.k_stride_slot;
  T* v_dst = static_cast<T*>(p.v_cache) + page * p.v_stride_page + slot * p.v_stride_slot;
  for (int idx = threadIdx.x; idx < p.num_heads * kVecsPerHead; idx += blockDim.x) {
    const int h = idx / kVecsPerHead, c = (idx % kVecsPerHead) * kVec;
    const uint4 k = *reinterpret_cast<const uint4*>(key + h * p.key_stride_h + c);
    const uint4 v = *reinterpret_cast<const uint4*>(value + h * p.value_stride_h + c);
    *reinterpret_cast<uint4*>(k_dst + h * p.k_stride_h + c) = k;
    *reinterpret_cast<uint4*>(v_dst + h * p.v_stride_h + c) = v;
  }
}

// TIn: the appended rows' type; TCache: the cache's (TIn, or FP8 to quantise into).
template <class TIn, class TCache, int kHeadDim>
int launch_append_paged(const FlashjitAppendParams& p, cudaStream_t stream) {
  if (p.nnz == 0 || p.num_heads == 0) return cudaSuccess;
  if constexpr (std::is_same<TIn, TCache>::value) {
    append_paged_kernel<TIn, kHeadDim><<<p.nnz, 128, 0, stream>>>(p);
  } else {
    append_quantize_kernel<TIn, TCache, kHeadDim><<<p.nnz, 128, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace flashjit
