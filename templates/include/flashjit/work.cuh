// What one CTA computes, decoded from the launch parameters, and the
// attention mask every backend applies. Rows are (query token, head) pairs of
// one KV head packed token-major: row r is token r / group, head r % group of
// the group, so all query heads that share a KV head share its tiles.
#pragma once
#include "attention_params.cuh"

namespace flashjit {

struct CtaWork {
  int qo_start, qo_len;  // token range of the request's queries
  int kv_start, kv_len;  // token range of the request's keys/values
  int row_begin;         // first packed row of this CTA
  int kv_head;
  int group;             // query heads per KV head
};

__device__ __forceinline__ CtaWork decode_work(const FlashjitAttentionParams& p, int rows_per_cta) {
  CtaWork w;
  int request = 0, tile = blockIdx.x;
  if (p.work_request != nullptr) {
    request = p.work_request[blockIdx.x];
    tile = p.work_tile[blockIdx.x];
  }
  if (p.qo_indptr != nullptr) {
    w.qo_start = p.qo_indptr[request];
    w.qo_len = p.qo_indptr[request + 1] - w.qo_start;
    w.kv_start = p.kv_indptr[request];
    w.kv_len = p.kv_indptr[request + 1] - w.kv_start;
  } else {
    w.qo_start = 0;
    w.qo_len = p.qo_len;
    w.kv_start = 0;
    w.kv_len = p.kv_len;
  }
  w.row_begin = tile * rows_per_cta;
  w.kv_head = blockIdx.y;
  w.group = p.num_qo_heads / p.num_kv_heads;
  return w;
}

// Bottom-right aligned masks: query i of a request sees keys j with
// j <= i + kv_len - qo_len (causal) and j >= that bound - window_left (window).
template <bool kCausal, bool kWindow>
struct Mask {
  int offset;       // kv_len - qo_len
  int window_left;

  __device__ __forceinline__ bool visible(int qpos, int key, int kv_len) const {
    bool ok = key < kv_len;
    if (kCausal) ok = ok && key <= qpos + offset;
    if (kWindow) ok = ok && key >= qpos + offset - window_left;
    return ok;
  }
  // Half-open key range that any of the queries [q_first, q_last] can see.
  __device__ __forceinline__ int key_end(int q_last, int kv_len) const {
    int end = kv_len;
    if (kCausal) end = min(end, q_last + offset + 1);
    return max(end, 0);
  }
  __device__ __forceinline__ int key_begin(int q_first) const {
    return kWindow ? max(q_first + offset - window_left, 0) : 0;
  }
};

}  // namespace flashjit
