// Appending new keys/values to a paged KV cache: one CTA per new token looks
// up its page once and copies all its heads in 16-byte vectors, K and V.
// Token i goes to page kv_indices[kv_indptr[batch_indices[i]] + positions[i] /
// page_size], slot positions[i] % page_size.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include "flashjit/common/attention_params.cuh"  // FLASHJIT_ABI_VERSION

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
};

// As flashjit_attention_run: the stream, then the params, in one block.
struct FlashjitAppendLaunch {
  void* stream;  // cudaStream_t
  FlashjitAppendParams params;
};

int flashjit_append_run(const FlashjitAppendLaunch* launch);

}  // extern "C"

namespace flashjit {

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

template <class T, int kHeadDim>
int launch_append_paged(const FlashjitAppendParams& p, cudaStream_t stream) {
  if (p.nnz == 0 || p.num_heads == 0) return cudaSuccess;
  append_paged_kernel<T, kHeadDim><<<p.nnz, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashjit
