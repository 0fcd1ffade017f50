// The plain C ABI shared by every attention library flashjit generates.
// Python mirrors this struct with ctypes (flashjit/loader.py); any change here
// must bump FLASHJIT_ABI_VERSION and the mirror together.
#pragma once
#include <stdint.h>

#define FLASHJIT_ABI_VERSION 12

extern "C" {

// One CTA's assignment in a batched launch, written by plan(): rows
// [tile * rows_per_cta, ...) of `request` against its keys [split * chunk,
// (split + 1) * chunk), or all its keys when split < 0. request < 0 marks an
// empty slot (a CUDA graph's grid is sized for the largest plan it replays).
struct FlashjitWorkItem {
  int32_t request;
  int32_t tile;
  int32_t split;
  int32_t chunk;
};

struct FlashjitAttentionParams {
  // --- Per call: addresses and counts (the host packs these on every call). ---
  const void* q;        // [tokens, num_qo_heads, head_dim_qk], strides below
  const void* k;        // ragged: rows by (token, head) strides; paged: page 0 of the K cache
  const void* v;
  void* o;              // same indexing as q, head_dim_vo wide
  float* lse;           // [tokens, num_qo_heads] base-2 log-sum-exp, or null
  // Batch description (device int32). When qo_indptr is null the launch is a
  // single request of qo_len x kv_len starting at token 0.
  const int32_t* qo_indptr;         // [batch + 1]
  const int32_t* kv_indptr;         // [batch + 1] ragged: token offsets; paged: offsets into kv_page_indices
  const int32_t* kv_page_indices;   // paged only: page ids of every request, concatenated
  const int32_t* kv_last_page_len;  // paged only: [batch] valid slots of each request's last page
  const FlashjitWorkItem* work;     // [num_work]; null: request 0, tile = item slot (work.cuh)
  // Split-KV (flash-decoding): a CTA with split >= 0 writes its normalised fp32
  // output and LSE as partial state row merge_indptr[token] + split (single
  // requests: token * num_splits + split); a merge pass then writes o and lse
  // for every token that has partial rows.
  const int32_t* merge_indptr;      // [qo_len + 1] when batched work splits, else null
  float* partial_o;                 // [partial rows, num_qo_heads, head_dim_vo]
  float* partial_lse;               // [partial rows, num_qo_heads]
  int32_t num_work;   // work slots; the grid's x is num_work * num_kv_heads (see work.cuh)
  int32_t qo_len;     // single request: its queries; batched with merge_indptr: tokens the merge visits
  int32_t kv_len;     // single request only
  int32_t num_splits; // single request: gridDim.z; 1 means no split
  int32_t kv_chunk;   // single request: keys per split
  int32_t band_items; // launch order: work slots per band (work.cuh); 0: one band

  // --- Per call signature: fixed while shapes, strides and scalars are. ---
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  int32_t page_size;                // paged only
  int64_t q_stride_n, q_stride_h;   // in elements
  int64_t k_stride_n, k_stride_h, k_stride_page;  // stride_n: between tokens (within a page)
  int64_t v_stride_n, v_stride_h, v_stride_page;
  int64_t o_stride_n, o_stride_h;
  int64_t lse_stride_n;             // lse[token * lse_stride_n + head]

  float sm_scale;
  float logits_soft_cap;      // used when the configuration has soft-cap
  int32_t window_left;        // used when the configuration has a sliding window
  // Batch-invariant mode: keys per fixed chunk from key 0 (0: normal mode), and
  // the merge pass folds a row's chunk states in chunk order (chunk_fold.cuh).
  // Positive: CTAs of the launch may span several chunks and fold them
  // themselves (fa3's kChunkFold kernel, on a persistent grid), keeping their
  // running outputs in partial_o (one slot of kRowsPerCta x (head_dim + 8)
  // floats per CTA); such a launch has no split items, so partial_o holds
  // nothing else. Negative (-chunk): no CTA spans two chunks (a plan that
  // splits them), and the launch runs the kernel normal mode runs.
  int32_t invariant_chunk;

  // FP8 KV caches only: the dequantisation scales (a key is code * k_scale, a
  // value code * v_scale). A non-null pointer (one float on the device, read
  // after the grid dependency wait, so that a CUDA graph replays with the
  // value it holds then) takes precedence over the float beside it.
  float k_scale;
  float v_scale;
  const float* k_scale_ptr;
  const float* v_scale_ptr;
  // Attention sinks (gpt-oss): one float32 logit per query head, in natural
  // units beside the scaled (and soft-capped) logits, or null. Each row's
  // softmax runs over [its logits, the sink]; the sink's probability is
  // dropped from the output and the LSE counts it. Only the writes of final
  // rows apply it (sink_fold.cuh): partial split-KV states leave it to the
  // merge, so it is counted once.
  const float* sinks;
  // Custom masks (configurations with one): bits packed per request, little-
  // endian, bit q * kv_len + key of a request's segment set where query q sees
  // the key; its segment starts at byte mask_indptr[request] (work.cuh CustomMask).
  const void* custom_mask;
  const int32_t* mask_indptr;       // [batch + 1] byte offsets, or null: one request at byte 0
  // [batch]: keys [0, n) of a request are visible to each of its queries, so
  // that key tiles below n skip the mask's test (plan() counts them); null: 0.
  const int32_t* mask_full_keys;
  // fa3's persistent grids: the positions each CTA takes, dealt out by the
  // plan (work.cuh CtaWalk), or null: rounds of the grid.
  const int32_t* cta_walk;

  // MLA only (mla_paged): the rotary part of the query, [tokens, num_qo_heads,
  // 64]; q then holds the 512-wide latent part, k the ckv cache and v the kpe
  // cache. Last, so that the host splices the per-call pointer onto the end of
  // the packed struct.
  int64_t q_pe_stride_n, q_pe_stride_h;
  const void* q_pe;
};

// What the host passes per launch: the stream, then the params, in one block,
// so that ctypes calls the entry point with a single bytes argument and no
// argtypes converters (about half the call's cost on the host).
struct FlashjitAttentionLaunch {
  void* stream;  // cudaStream_t
  FlashjitAttentionParams params;
};

// Launches the configuration's kernel on launch->stream; returns a cudaError_t value.
int flashjit_attention_run(const FlashjitAttentionLaunch* launch);
const char* flashjit_error_string(int code);
int flashjit_abi_version(void);
// Geometry the host needs for plan(): query rows (token x head pairs of one
// KV head) that one CTA covers, and the key granularity every split boundary
// must be a multiple of.
int flashjit_rows_per_cta(void);
int flashjit_split_align(void);
// CTAs that fit on one SM of the current device (the planner's wave size); 0 on error.
int flashjit_ctas_per_sm(void);
// sizeof(FlashjitAttentionParams), checked by the host against its mirror.
int flashjit_params_size(void);

}  // extern "C"
