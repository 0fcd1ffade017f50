// Pieces the MLA kernels share (fa2_mla.cuh, fa2_mla_wide.cuh, fa3/fa3_mla.cuh,
// fa3/fa3_mla_copy.cuh) on top of the fa2 building blocks: where their key rows
// live, their Q rows' copy, the keys a CTA sees, and the mask of an S fragment.
#pragma once
#include <math_constants.h>
#include <stdint.h>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"

namespace flashjit {
namespace fa2 {

// The MLA kernels' mask of one lane's S fragment (rows g and g + 8 of an m16
// block, s[j][e] at key k0 + 8 j + 2 tq + e % 2 of row e / 2): -inf at keys
// past kv_len and, causal, past the row's query position q_pos (offset by the
// cached prefix), where the row may not look.
template <bool kCausal, int NT>
__device__ __forceinline__ void mask_mla_fragment(float (&s)[NT][4], int k0, int tq, int kv_len,
                                                  const int (&q_pos)[2]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = k0 + 8 * j + 2 * tq + (e & 1);
      if (key >= kv_len || (kCausal && key > q_pos[e >> 1])) s[j][e] = -CUDART_INF_F;
    }
}

// Where the MLA kernels' key rows live (fa2_mla.cuh's tile copy, fa3/fa3_mla_copy.cuh's
// gather): the ckv and kpe caches from a thread's byte offset into a row, their
// page and row byte strides (32-bit: the host keeps them below 2 GiB), and the
// request's page ids.
template <class T>
struct MlaCacheRows {
  const char* ckv;
  const char* kpe;
  uint32_t ckv_page_bytes, ckv_row_bytes, kpe_page_bytes, kpe_row_bytes;
  const int32_t* pages;  // the request's page ids
  FastDivmod page_div;

  __device__ __forceinline__ MlaCacheRows(const FlashjitAttentionParams& p, const CtaWork& w, int byte_offset)
      : page_div(p.page_size) {
    ckv = static_cast<const char*>(p.k) + byte_offset;
    kpe = static_cast<const char*>(p.v) + byte_offset;
    ckv_page_bytes = uint32_t(p.k_stride_page * int64_t(sizeof(T)));
    ckv_row_bytes = uint32_t(p.k_stride_n * int64_t(sizeof(T)));
    kpe_page_bytes = uint32_t(p.v_stride_page * int64_t(sizeof(T)));
    kpe_row_bytes = uint32_t(p.v_stride_n * int64_t(sizeof(T)));
    pages = p.kv_page_indices + w.kv_start;
  }

  // This thread's place in the ckv and kpe rows of slot `slot` of page `page`.
  __device__ __forceinline__ void row(uint32_t page, uint32_t slot, const char*& c_src, const char*& k_src) const {
    const uint64_t pg = uint64_t(page);
    c_src = ckv + (pg * ckv_page_bytes + slot * ckv_row_bytes);
    k_src = kpe + (pg * kpe_page_bytes + slot * kpe_row_bytes);
  }

  // Page ids and slots of a thread's rows key0 + i * kRowsPerPass (i < kPasses)
  // of the tile at k0, page -1 at or past `valid`: looked up a tile ahead, so
  // that the page-table reads are off the copies' path.
  template <int kPasses>
  struct PageRows {
    int page[kPasses], slot[kPasses];
  };
  template <int kPasses, int kRowsPerPass>
  __device__ __forceinline__ void lookup_rows(PageRows<kPasses>& rows, int key0, int k0, int valid) const {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int key = key0 + i * kRowsPerPass;
      rows.page[i] = -1;
      rows.slot[i] = 0;
      if (key < valid) {
        const int page_at = page_div.div(k0 + key);
        rows.slot[i] = page_div.mod(k0 + key, page_at);
        rows.page[i] = pages[page_at];
      }
    }
  }
};

// The MLA kernels' Q rows (fa2_mla.cuh, fa3/fa3_mla.cuh; Traits: their shape):
// every thread's cp.async of the CTA's packed rows from w.row_begin, each
// [q_nope | q_pe] (q_nope's chunks first, layout L at q_smem), kThreads threads
// from `tid`. Rows past the request are zero-filled. kUnroll: the loop's unroll
// (each kernel keeps the one its SASS was measured with).
template <class Traits, class L, int kThreads, int kUnroll>
__device__ __forceinline__ void copy_mla_q(const FlashjitAttentionParams& p, const CtaWork& w, uint32_t q_smem,
                                           int rows_total, int tid) {
  using T = typename Traits::DType;
  constexpr int kRows = Traits::kRowsPerCta, kChunks = Traits::kQkDim / 8, kCkvChunks = Traits::kCkvDim / 8;
  const T* q_nope = static_cast<const T*>(p.q);
  const T* q_pe = static_cast<const T*>(p.q_pe);
  const auto packed = w.packed_rows();
#pragma unroll kUnroll
  for (int idx = tid; idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = w.row_begin + r;
    const bool ok = row < rows_total;
    const T* src = q_nope;
    if (ok) {
      int token, head;
      packed.locate(row, token, head);
      src = c < kCkvChunks
                ? q_nope + int64_t(token) * p.q_stride_n + int64_t(head) * p.q_stride_h + c * 8
                : q_pe + int64_t(token) * p.q_pe_stride_n + int64_t(head) * p.q_pe_stride_h + (c - kCkvChunks) * 8;
    }
    cp_async_16(q_smem + L::at(r, c), src, ok);
  }
}

// The keys an MLA CTA's kRows packed rows (from w.row_begin, of rows_total)
// see, in tiles of kKeys from key_begin (w.kv_begin: 0, or a split chunk's
// start, a multiple of kKeys): up to the chunk's end and, causal, the CTA's
// last query's position.
template <bool kCausal, int kRows, int kKeys>
struct MlaCtaKeys {
  int offset;       // kv_len - qo_len: query q sits at key position q + offset
  int cta_q_first;  // the CTA's first query token
  int key_begin, num_tiles;

  __device__ __forceinline__ MlaCtaKeys(const CtaWork& w, int rows_total) {
    offset = w.kv_len - w.qo_len;
    const Mask<kCausal, false> mask{offset, 0};
    cta_q_first = w.row_begin / w.group;
    const int cta_q_last = (min(w.row_begin + kRows, rows_total) - 1) / w.group;
    key_begin = w.kv_begin;
    const int key_end = min(mask.key_end(cta_q_last, w.kv_len), w.kv_end);
    num_tiles = key_end > key_begin ? (key_end - key_begin + kKeys - 1) / kKeys : 0;
  }

  // Whether the `keys` keys from k0 need the element mask: some lie past the
  // request, or, causal, past the CTA's first query.
  __device__ __forceinline__ bool needs_mask(int k0, int keys, int kv_len) const {
    return k0 + keys > kv_len || (kCausal && k0 + keys - 1 > cta_q_first + offset);
  }
  // The key position of packed row `row` (of rows_total from w.row_begin; a
  // row past the request takes the last one's).
  __device__ __forceinline__ int query_pos(const CtaWork& w, int rows_total, int row) const {
    return min(w.row_begin + row, rows_total - 1) / w.group + offset;
  }
  // An S fragment of rows row_in_cta[0], [1] (g and g + 8 of an m16 block),
  // keys k0 .. k0 + keys - 1, masked where needs_mask says (mask_mla_fragment).
  template <int NT>
  __device__ __forceinline__ void mask(float (&s)[NT][4], int k0, int keys, const CtaWork& w, int rows_total,
                                       const int (&row_in_cta)[2], int tq) const {
    if (needs_mask(k0, keys, w.kv_len)) {
      int q_pos[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) q_pos[r] = query_pos(w, rows_total, row_in_cta[r]);
      mask_mla_fragment<kCausal>(s, k0, tq, w.kv_len, q_pos);
    }
  }
};

}  // namespace fa2
}  // namespace flashjit
