// What one CTA computes, decoded from the launch parameters; where its keys
// and values live (ragged rows or pages); and the attention mask every backend
// applies. Rows are (query token, head) pairs of one KV head packed
// token-major: row r is token r / group, head r % group of the group, so all
// query heads that share a KV head share its tiles.
#pragma once
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/grid_dependency.cuh"

namespace flashjit {

// Division by a runtime constant d >= 1 without a divide instruction, exact for
// dividends below 2^31 (round-up multiplier, Granlund and Montgomery 1994):
// q = (umulhi(n, m) + n) >> l with l = ceil(log2 d), m = 2^32 (2^l - d) / d + 1.
struct FastDivmod {
  uint32_t d, m, l;
  FastDivmod() = default;
  __device__ __forceinline__ explicit FastDivmod(int divisor) : d(divisor) {
    l = d > 1 ? 32 - __clz(d - 1) : 0;
    // A power of two (GQA groups, page sizes) needs no 64-bit division: m = 1.
    m = (d & (d - 1)) == 0 ? 1u : static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1);
  }
  __device__ __forceinline__ int div(int n) const { return (__umulhi(uint32_t(n), m) + uint32_t(n)) >> l; }
  __device__ __forceinline__ int mod(int n, int q) const { return n - q * int(d); }
};

struct CtaWork {
  bool valid;            // false: an empty work slot, the CTA has nothing to do
  int qo_start, qo_len;  // token range of the request's queries
  int kv_start, kv_len;  // ragged: token offset of its keys; paged: offset into kv_page_indices
  int kv_begin, kv_end;  // the keys this CTA covers (a split-KV chunk, or all of them)
  int split;             // chunk index, or -1: the CTA sees every key and writes o itself
  int row_begin;         // first packed row of this CTA
  int kv_head;
  int group;             // query heads per KV head
  int request;           // the request's index in the batch (0 for a single request)

  // Packed rows -> query token and query head, dividing by the group with a
  // multiply-high. Built once before a loop over rows and dropped after it (not
  // kept in registers across the main loop): a divide instruction per row cost a
  // 128-row CTA's prologue and epilogue hundreds of instructions per thread.
  struct PackedRows {
    int qo_start, head0;
    FastDivmod by_group;
    __device__ __forceinline__ void locate(int row, int& token, int& head) const {
      const int q = by_group.div(row);
      token = qo_start + q;
      head = head0 + by_group.mod(row, q);
    }

    // The element offsets (token * stride_n + head * stride_h) of rows first,
    // first + kStep, first + 2 kStep, ...: one division for the first row, then
    // an add per row (kStep % group heads on, and a token on where they wrap).
    // A CTA's Q copies and output stores walk 8-16 rows per thread: a division
    // and two 64-bit products per row would cost the Q copies more than the
    // copies themselves, on the path before a CTA's first tile.
    template <int kStep>
    struct Walk {
      int64_t offset;       // of the current row
      int head_in_group;    // its row % group
      int group, head_step;
      int64_t step_offset;  // kStep / group tokens and kStep % group heads on
      int64_t wrap_offset;  // one token on, group heads back
      __device__ __forceinline__ void next() {
        offset += step_offset;
        head_in_group += head_step;
        if (head_in_group >= group) {
          head_in_group -= group;
          offset += wrap_offset;
        }
      }
    };
    template <int kStep>
    __device__ __forceinline__ Walk<kStep> walk(int first, int64_t stride_n, int64_t stride_h) const {
      Walk<kStep> w;
      const int q = by_group.div(first);
      w.head_in_group = by_group.mod(first, q);
      w.group = int(by_group.d);
      w.offset = int64_t(qo_start + q) * stride_n + int64_t(head0 + w.head_in_group) * stride_h;
      const int q_step = by_group.div(kStep);
      w.head_step = by_group.mod(kStep, q_step);
      w.step_offset = int64_t(q_step) * stride_n + int64_t(w.head_step) * stride_h;
      w.wrap_offset = stride_n - int64_t(w.group) * stride_h;
      return w;
    }
  };
  __device__ __forceinline__ PackedRows packed_rows() const {
    return PackedRows{qo_start, kv_head * group, FastDivmod(group)};
  }
};

// The grid's x walks (work slot, KV head) pairs in bands: slots
// [b * band_items, (b + 1) * band_items) for KV head 0, then the same slots for
// head 1, ..., then band b + 1. The hardware starts CTAs in x order, so one band
// (every slot) keeps the CTAs that share a KV head's keys together in L2,
// while narrower bands keep the plan's longest-first order across heads: with
// one band a causal batch's last head started its longest tiles at the end of
// the grid. The host picks band_items (ops._plan).
//
// decode_work_at decodes launch position (x, z) for kernels whose CTAs walk
// several positions (a persistent grid); decode_work is the CTA's own.
template <bool kPaged>
__device__ __forceinline__ CtaWork decode_work_at(const FlashjitAttentionParams& p, int rows_per_cta, unsigned x,
                                                  unsigned z) {
  CtaWork w;
  const unsigned items = p.num_work, heads = p.num_kv_heads;
  const unsigned per_band = p.band_items > 0 && unsigned(p.band_items) < items ? unsigned(p.band_items) : items;
  const unsigned first = x / (per_band * heads) * per_band;
  const unsigned in_band = min(per_band, items - first);
  const unsigned r = x - first * heads;
  w.kv_head = int(r / in_band);
  const int slot = int(first + r % in_band);
  // Without a plan (one request), the last query tiles first: under a causal
  // mask they see the most keys.
  int request = 0, tile = p.num_work - 1 - slot, chunk = 0;
  w.split = -1;
  if (p.work != nullptr) {
    const FlashjitWorkItem item = p.work[slot];
    request = item.request;
    tile = item.tile;
    w.split = item.split;
    chunk = item.chunk;
  } else if (p.num_splits > 1) {
    w.split = int(z);
    chunk = p.kv_chunk;
  }
  w.valid = request >= 0;
  if (!w.valid) request = 0;
  w.request = request;
  if (p.qo_indptr != nullptr) {
    w.qo_start = p.qo_indptr[request];
    w.qo_len = p.qo_indptr[request + 1] - w.qo_start;
    w.kv_start = p.kv_indptr[request];
    const int n = p.kv_indptr[request + 1] - w.kv_start;
    if constexpr (kPaged) {
      w.kv_len = n > 0 ? (n - 1) * p.page_size + p.kv_last_page_len[request] : 0;
    } else {
      w.kv_len = n;
    }
  } else {
    w.qo_start = 0;
    w.qo_len = p.qo_len;
    w.kv_start = 0;
    w.kv_len = p.kv_len;
  }
  w.kv_begin = w.split >= 0 ? w.split * chunk : 0;
  w.kv_end = w.split >= 0 ? min(w.kv_begin + chunk, w.kv_len) : w.kv_len;
  w.row_begin = tile * rows_per_cta;
  w.group = p.num_qo_heads / p.num_kv_heads;
  return w;
}

// The launch positions a persistent CTA takes, in order. A plan may deal them
// out itself (p.cta_walk, ops/_plan.py deal_positions: in launch order, each to
// the CTA that ends soonest in the plan's costs): cta_walk = [ctas, ctas + 1
// offsets, the positions of CTA 0, CTA 1, ...], taken when ctas is this
// grid's size. Otherwise rounds of gridDim.x, CTA j the j-th of even rounds and
// the j-th from the end of odd ones: the plan orders positions longest first,
// so the rounds' long and short ones pair up on each SM. A grid of one CTA per
// position gets one round, its own. A position at or past `positions` is
// inactive (the last round's). kPlanWalk false: the rounds alone (batch-
// invariant mode's fold kernel, whose plans give no walk).
template <bool kPlanWalk>
struct CtaWalk {
  const int32_t* list;  // this CTA's positions, or null: rounds of gridDim.x
  // kPlanWalk: the CTA's rounds (the list's length); else the launch's positions.
  // (The fold kernel keeps the rounds' own test: ptxas placed its spills otherwise.)
  unsigned count;
  __device__ __forceinline__ CtaWalk(const FlashjitAttentionParams& p, unsigned positions) {
    const int32_t* walk = p.cta_walk;
    list = nullptr;
    count = kPlanWalk ? (positions + gridDim.x - 1) / gridDim.x : positions;
    if (kPlanWalk && walk != nullptr && unsigned(walk[0]) == gridDim.x) {
      const int first = walk[1 + blockIdx.x];
      list = walk + 2 + gridDim.x + first;
      count = unsigned(walk[2 + blockIdx.x] - first);
    }
  }
  // Whether the CTA has a round `round` (each one before it has).
  __device__ __forceinline__ bool has(unsigned round) const {
    return kPlanWalk ? round < count : round * gridDim.x < count;
  }
  __device__ __forceinline__ unsigned position(unsigned round) const {
    if (kPlanWalk && list != nullptr) return unsigned(list[round]);
    return round * gridDim.x + ((round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  }
};

// Every attention kernel starts here, fa3's MLA kernels too, except
// fa3_attention_kernel, whose persistent CTAs wait once before their first
// position; see grid_dependency.cuh. The work item and its request's offsets
// (qo_indptr, kv_indptr, last page lengths) are the plan's own arrays, copied
// in by the plan and written by no grid, so a first-wave CTA decodes them
// while the grid before finishes: two dependent global round trips off the
// start of every call (docs/mla.md, "Where it stands").
template <bool kPaged>
__device__ __forceinline__ CtaWork decode_work(const FlashjitAttentionParams& p, int rows_per_cta) {
  allow_dependent_grids();
  const CtaWork w = decode_work_at<kPaged>(p, rows_per_cta, blockIdx.x, blockIdx.z);
  wait_for_primary_grid();
  return w;
}

// Row of partial state that (token, split) writes; see FlashjitAttentionParams.
__device__ __forceinline__ int64_t partial_row(const FlashjitAttentionParams& p, int token, int split) {
  return p.merge_indptr != nullptr ? int64_t(p.merge_indptr[token]) + split
                                   : int64_t(token) * p.num_splits + split;
}

// Address of key `key` (0-based within its request) of one KV head: a strided
// row of a ragged tensor, or a slot of one of the request's pages.
template <class T, bool kPaged>
struct KvRows {
  const T* base;          // KV head applied; ragged: the request's first row too
  int64_t stride_n;       // between consecutive tokens (within a page)
  int64_t stride_page;
  const int32_t* pages;   // the request's page ids
  FastDivmod page_div;    // division by the page size (1 for ragged rows)

  // The page holding `key` (a global load; 0 for ragged rows). Kernels that
  // pipeline their copies look pages up a tile ahead, so that the copy itself
  // does not wait for the page table.
  __device__ __forceinline__ int page_of(int key) const {
    if constexpr (!kPaged) {
      return 0;
    } else {
      return pages[page_div.div(key)];
    }
  }
  // Address of `key`, which lies in `page` (from page_of); no memory access.
  __device__ __forceinline__ const T* row_in(int page, int key) const {
    if constexpr (!kPaged) {
      return base + int64_t(key) * stride_n;
    } else {
      const int slot = page_div.mod(key, page_div.div(key));
      return base + int64_t(page) * stride_page + int64_t(slot) * stride_n;
    }
  }
  __device__ __forceinline__ const T* row(int key) const { return row_in(page_of(key), key); }
};

template <class T, bool kPaged>
__device__ __forceinline__ KvRows<T, kPaged> kv_rows(const FlashjitAttentionParams& p, const CtaWork& w,
                                                     const void* data, int64_t stride_n, int64_t stride_h,
                                                     int64_t stride_page) {
  KvRows<T, kPaged> r;
  r.base = static_cast<const T*>(data) + int64_t(w.kv_head) * stride_h;
  r.stride_n = stride_n;
  r.stride_page = stride_page;
  r.page_div = FastDivmod(kPaged ? p.page_size : 1);
  if constexpr (kPaged) {
    r.pages = p.kv_page_indices + w.kv_start;
  } else {
    r.base += int64_t(w.kv_start) * stride_n;
    r.pages = nullptr;
  }
  return r;
}

// An FP8 cache's dequantisation scale: the device float when the host passed
// one (read after the grid dependency wait, so a CUDA graph replays with the
// value it holds then), else the float in the params.
__device__ __forceinline__ float kv_scale_value(const float* device_value, float value) {
  return device_value != nullptr ? *device_value : value;
}

// A custom mask (speculative decoding's token trees): bit q * kv_len + key of
// the request's packed segment (little-endian within each byte, as
// flashinfer.packbits(..., bitorder="little") packs) says whether query q sees
// the key. The segment starts at byte mask_indptr[request] (byte 0 for a
// single request without one).
struct CustomMask {
  const uint8_t* bits;
  int kv_len;
  int full_keys;  // keys [0, full_keys) are visible to every query of the request

  __device__ __forceinline__ static CustomMask of(const FlashjitAttentionParams& p, const CtaWork& w) {
    const uint8_t* base = static_cast<const uint8_t*>(p.custom_mask);
    return {base + (p.mask_indptr != nullptr ? p.mask_indptr[w.request] : 0), w.kv_len,
            p.mask_full_keys != nullptr ? p.mask_full_keys[w.request] : 0};
  }
  // For key < kv_len.
  __device__ __forceinline__ bool visible(int q, int key) const {
    const int64_t bit = int64_t(q) * kv_len + key;
    return (__ldg(bits + (bit >> 3)) >> (bit & 7)) & 1;
  }
};

// What a kernel built without custom masks holds in a CustomMask's place.
struct NoCustomMask {
  int full_keys = 0;  // never read: the condition that reads it starts with kCustomMask
};

// The request's custom mask where the kernel takes one, else a NoCustomMask.
template <bool kCustomMask>
__device__ __forceinline__ auto custom_mask_of(const FlashjitAttentionParams& p, const CtaWork& w) {
  if constexpr (kCustomMask) {
    return CustomMask::of(p, w);
  } else {
    return NoCustomMask{};
  }
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
