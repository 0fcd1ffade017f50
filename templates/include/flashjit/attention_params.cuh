// The plain C ABI shared by every attention library flashjit generates.
// Python mirrors this struct with ctypes (flashjit/loader.py); any change here
// must bump FLASHJIT_ABI_VERSION and the mirror together.
#pragma once
#include <stdint.h>

#define FLASHJIT_ABI_VERSION 2

extern "C" {

struct FlashjitAttentionParams {
  // --- Per call: addresses and counts (the host packs these on every call). ---
  const void* q;        // [tokens, num_qo_heads, head_dim_qk], strides below
  const void* k;        // kv rows addressed by (token, kv head) strides
  const void* v;
  void* o;              // same indexing as q, head_dim_vo wide
  float* lse;           // [tokens, num_qo_heads] base-2 log-sum-exp, or null
  // Ragged batch description (device int32). When null the launch is a single
  // request of qo_len x kv_len starting at token 0.
  const int32_t* qo_indptr;   // [batch + 1]
  const int32_t* kv_indptr;   // [batch + 1]
  // Work list from plan(): CTA x handles rows [tile*rows_per_cta, ...) of
  // request work_request[x]. When null, request 0 and tile = blockIdx.x.
  const int32_t* work_request;
  const int32_t* work_tile;
  // Split-KV (flash-decoding): CTA z of num_splits covers keys
  // [z * kv_chunk, (z + 1) * kv_chunk) of its request and writes its normalised
  // fp32 output and LSE to the partial buffers; a merge pass then writes o/lse.
  float* partial_o;           // [num_splits, tokens, num_qo_heads, head_dim_vo]
  float* partial_lse;         // [num_splits, tokens, num_qo_heads]
  int32_t num_work;           // gridDim.x
  int32_t qo_len;             // single-request mode only
  int32_t kv_len;
  int32_t num_splits;         // gridDim.z; 1: no split, partial buffers unused
  int32_t kv_chunk;

  // --- Per call signature: fixed while shapes, strides and scalars are. ---
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  int64_t q_stride_n, q_stride_h;   // in elements
  int64_t k_stride_n, k_stride_h;
  int64_t v_stride_n, v_stride_h;
  int64_t o_stride_n, o_stride_h;
  int64_t lse_stride_n;             // lse[token * lse_stride_n + head]

  float sm_scale;
  float logits_soft_cap;      // used when the configuration has soft-cap
  int32_t window_left;        // used when the configuration has a sliding window
};

// Launches the configuration's kernel on `stream`; returns a cudaError_t value.
int flashjit_attention_run(const FlashjitAttentionParams* params, void* stream);
const char* flashjit_error_string(int code);
int flashjit_abi_version(void);
// Geometry the host needs for plan(): query rows (token x head pairs of one
// KV head) that one CTA covers.
int flashjit_rows_per_cta(void);
// sizeof(FlashjitAttentionParams), checked by the host against its mirror.
int flashjit_params_size(void);

}  // extern "C"
