// Decode attention on CUDA cores: one query token per request, fp32 logits,
// fp32 softmax and fp32 P.V throughout.
//
// The rows of a CTA are the query heads of one KV head (up to kRowsPerCta).
// Every thread keeps its slice of those queries in registers, so one read of a
// key from shared memory serves all of them:
//   - a key is spread over kLanesPerKey lanes, 8 head dims each (16 where a
//     key's dims take more than a warp at 8: head dim 512); a warp works
//     on kKeyGroups keys side by side, and the rows' partial logits of a key
//     are reduce-scattered over its lanes, so that each lane ends with the
//     full logit of one row (reduce_scatter below);
//   - lane groups are a power of two wide, as the shuffles that reduce and
//     merge them halve: where head_dim / 8 is not (48, 80, 96, 112, 144, ...),
//     the group's last lanes hold no dims (kLanesActive of kLanesPerKey). They
//     copy nothing (their slots are zero-filled) and add zeros, which is
//     exact, so they still end with their row's full logit and run its
//     softmax as the other lanes do;
//   - each warp streams its own chunks of keys (chunk c goes to warp c mod
//     kWarps) through a private cp.async ring, and each thread copies exactly
//     the 16-byte pieces it later reads, so the loop needs no barrier at all;
//   - the softmax runs once per chunk on each lane's row; weights and rescale
//     factors reach the lanes that need them by one shuffle each;
//   - at the end the key groups of a warp merge by shuffles, the warps through
//     shared memory.
// A profile found the loop instruction-bound, so its address arithmetic is
// 32-bit and division-free (see DecodeKvRows).
// The query position is the last key (kv_len - 1), so a causal mask hides
// nothing and a window only moves the first key.
// An FP8 KV cache (DTypeKV of one byte) is copied as it lies, a lane's dims of
// a key (8 or 16: kDimsPerLane) as 8 or 16 bytes, and widened to fp32 where
// the loop reads it (unpack8_fp8, unpack16); k_scale is folded into the
// query's scale and v_scale into the final normalisation, so the loop itself
// does not change.
#pragma once
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/merge_states.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/sink_fold.cuh"
#include "flashjit/common/work.cuh"

namespace flashjit {

template <class DType_, class DTypeKV_, int kHeadDim_, int kWarps_, int kKeysPerGroup_, int kStages_,
          int kDimsPerLane_, int kMinBlocksPerSm_, bool kPaged_, bool kWindow_, bool kSoftCap_, bool kLse_>
struct CudaCoreDecodeTraits {
  using DType = DType_;      // q and o
  using DTypeKV = DTypeKV_;  // K and V: DType, or an FP8 format
  static constexpr bool kKvFp8 = kIsFp8<DTypeKV>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kKeysPerGroup = kKeysPerGroup_;  // keys one lane group takes per chunk
  static constexpr int kStages = kStages_;
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kWindow = kWindow_;
  static constexpr bool kSoftCap = kSoftCap_;
  static constexpr bool kLse = kLse_;

  // Head dims of a key per lane: 8, or 16 with an FP8 cache, whose lane then
  // copies and reads 16 bytes of codes a key, as a 16-bit cache's lane does:
  // half the lanes per key, twice the keys per warp instruction; or 16 past
  // head dim 256, where 8 a lane would take more than a warp's 32 lanes.
  static constexpr int kDimsPerLane = kDimsPerLane_;
  static constexpr int kLanesActive = kHeadDim / kDimsPerLane;
  static constexpr int kLanesPerKey = pow2_at_least(kLanesActive);
  static constexpr bool kAllLanesActive = kLanesActive == kLanesPerKey;
  static constexpr int kKeyGroups = 32 / kLanesPerKey;
  static constexpr int kKeysPerChunk = kKeyGroups * kKeysPerGroup;  // one warp, one pipeline stage
  // Bytes of a lane's dims of one K (or V) row, and the copies that move
  // them: 16-byte slots (one or two for 16-bit types, two or four for fp32), one
  // 8-byte slot for FP8 at 8 dims a lane.
  static constexpr int kLaneBytes = kDimsPerLane * int(sizeof(DTypeKV));
  static constexpr int kSlotBytes = kLaneBytes < 16 ? kLaneBytes : 16;
  static constexpr int kSlotElems = kSlotBytes / int(sizeof(DTypeKV));
  static constexpr int kVecsPerKey = kLaneBytes / kSlotBytes;
  static constexpr int kRowsPerCta = 4;  // flashjit/kernels/cuda_core.py CudaDecodeTiling.rows_per_cta
  static constexpr int kThreads = 32 * kWarps;
  // Four CTAs of four warps (at most 128 registers a thread) keep 16 warps
  // per SM to hide the latency of the shuffles that every logit waits for.
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;

  static_assert(kHeadDim % kDimsPerLane == 0 && kLanesPerKey <= 32 && 32 % kLanesPerKey == 0,
                "a key's dims over at most a warp's lanes: head_dim 8..256 (8 a lane), 16..512 (16 a lane)");
  static_assert(kSlotBytes == 16 || (kKvFp8 && kSlotBytes == 8), "a lane's dims fill 16-byte slots, or one 8-byte FP8 slot");
  static_assert(kDimsPerLane == 8 || kDimsPerLane == 16, "8 or 16 dims a lane");
  static_assert(kKvFp8 || std::is_same<DType, DTypeKV>::value, "K/V of q's dtype, or FP8");

  // Per warp and stage: K then V, kKeysPerGroup keys, kVecsPerKey slots, 32 lanes.
  static constexpr uint32_t kStageBytes = 2 * kKeysPerGroup * kVecsPerKey * 32 * kSlotBytes;
  static constexpr size_t kRingBytes = size_t(kWarps) * kStages * kStageBytes;
  // The warps' states (acc, then m and l per row), written once the ring is drained.
  static constexpr size_t kMergeBytes = sizeof(float) * kWarps * kRowsPerCta * (kHeadDim + 2);
  static constexpr size_t kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
};

// Sums kRows partial logits over the kLanes lanes of a key group, scattering
// the results: each halving step sends half of a lane's rows to its partner
// and keeps the other half, then plain butterflies finish. Afterwards lane
// holds in v[0] the full logit of row (lane % kLanes) / (kLanes / kRows): for
// four rows over 16 lanes that is 5 shuffles instead of 16, and the softmax
// then works on one value per lane.
template <int kOff, int kCount>
__device__ __forceinline__ void reduce_scatter(float* v, int lane) {
  if constexpr (kOff > 0) {
    if constexpr (kCount > 1) {
      constexpr int kHalf = kCount / 2;
      const bool upper = (lane & kOff) != 0;
#pragma unroll
      for (int i = 0; i < kHalf; ++i) {
        const float send = upper ? v[i] : v[i + kHalf];
        const float keep = upper ? v[i + kHalf] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kOff);
      }
      reduce_scatter<kOff / 2, kHalf>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], kOff);
      reduce_scatter<kOff / 2, 1>(v, lane);
    }
  }
}

// Where one lane's dims of key `key` lie in K and V: a slot of one of the
// request's pages, or a ragged row. Strides are 32-bit byte counts (the host
// rejects strides of 2 GiB or more, and pages of 4 GiB or more), so that an
// address costs one wide multiply-add per stride.
template <class T, bool kPaged>
struct DecodeKvRows {
  const char* k;            // KV head and the lane's dims applied
  const char* v;
  uint32_t k_page, v_page;  // bytes between pages
  uint32_t k_row, v_row;    // bytes between tokens (within a page)
  const int32_t* pages;
  FastDivmod page_div;

  // From the KV head's K and V rows (work.cuh), with this lane's dims applied.
  __device__ __forceinline__ DecodeKvRows(const KvRows<T, kPaged>& k_rows, const KvRows<T, kPaged>& v_rows, int dim0)
      : page_div(k_rows.page_div) {
    constexpr int64_t kElt = sizeof(T);
    k = reinterpret_cast<const char*>(k_rows.base + dim0);
    v = reinterpret_cast<const char*>(v_rows.base + dim0);
    k_row = uint32_t(k_rows.stride_n * kElt);
    v_row = uint32_t(v_rows.stride_n * kElt);
    k_page = uint32_t(k_rows.stride_page * kElt);
    v_page = uint32_t(v_rows.stride_page * kElt);
    pages = k_rows.pages;
  }
  // The page holding `key` (a global load; 0 for ragged rows).
  __device__ __forceinline__ int page_of(int key) const { return kPaged ? pages[page_div.div(key)] : 0; }
  // Addresses of this lane's dims of `key`, which lies in `page`.
  __device__ __forceinline__ void rows_of(int page, int key, const char*& k_src, const char*& v_src) const {
    if constexpr (kPaged) {
      const uint32_t slot = uint32_t(page_div.mod(key, page_div.div(key)));
      k_src = k + (uint64_t(uint32_t(page)) * k_page + slot * k_row);
      v_src = v + (uint64_t(uint32_t(page)) * v_page + slot * v_row);
    } else {
      k_src = k + uint64_t(uint32_t(key)) * k_row;
      v_src = v + uint64_t(uint32_t(key)) * v_row;
    }
  }
};

// An FP8 cache's scale (kv_scale_value); exactly 1 for K/V of q's dtype, which read nothing.
template <class Traits>
__device__ __forceinline__ float kv_scale(const float* device_value, float value) {
  if constexpr (Traits::kKvFp8) {
    return kv_scale_value(device_value, value);
  } else {
    return 1.f;
  }
}

// One slot of a lane's K or V row: global -> shared, and shared -> floats.
template <class Traits>
__device__ __forceinline__ void copy_kv_slot(uint32_t dst, const char* src, bool valid) {
  if constexpr (Traits::kSlotBytes == 16) {
    cp_async_16(dst, src, valid);
  } else {
    cp_async_8(dst, src, valid);
  }
}
template <class Traits>
__device__ __forceinline__ void read_kv_slot(uint32_t addr, float* out) {
  if constexpr (Traits::kSlotBytes == 16) {
    unpack16<typename Traits::DTypeKV>(ld_shared_16(addr), out);
  } else {
    unpack8_fp8<typename Traits::DTypeKV>(ld_shared_8(addr), out);
  }
}

template <class Traits, int kRows>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    cuda_core_decode_attention_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  using DType = typename Traits::DType;
  using DTypeKV = typename Traits::DTypeKV;
  constexpr int D = Traits::kHeadDim, DPL = Traits::kDimsPerLane, LANES = Traits::kLanesPerKey;
  constexpr int GROUPS = Traits::kKeyGroups, NK = Traits::kKeysPerGroup, VECS = Traits::kVecsPerKey;
  constexpr int WARPS = Traits::kWarps, STAGES = Traits::kStages, CHUNK = Traits::kKeysPerChunk;
  constexpr int SLOT = Traits::kSlotBytes, SLOT_ELEMS = Traits::kSlotElems;
  constexpr uint32_t kStageBytes = Traits::kStageBytes, kVecBytes = 32 * SLOT;  // one slot of every lane
  constexpr float kLog2e = 1.4426950408889634f;
  static_assert(kRows >= 1 && kRows <= Traits::kRowsPerCta && kRows <= LANES, "rows per CTA, at most one per lane of a key");

  extern __shared__ __align__(16) unsigned char smem[];
  const CtaWork w = decode_work<Traits::kPaged>(p, Traits::kRowsPerCta);
  const int rows_total = w.qo_len * w.group;  // qo_len is 1: the rows are the group's heads
  if (!w.valid || w.row_begin >= rows_total) return;  // uniform across the CTA

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int key_group = lane / LANES, dim0 = (lane % LANES) * DPL;
  const bool lane_active = Traits::kAllLanesActive || dim0 < D;  // a lane past the dims (see the top)

  // This lane's dims of each row's query, pre-scaled so that logits come out
  // in log2 units (natural units when the soft-cap needs them).
  // FP8: k_scale joins the query's scale (logits of the dequantised keys).
  const float q_scale = (Traits::kSoftCap ? p.sm_scale : p.sm_scale * kLog2e) * kv_scale<Traits>(p.k_scale_ptr, p.k_scale);
  // One query token: packed row r is query head kv_head * group + r of it.
  float q[kRows][DPL];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = w.row_begin + r;
    const bool ok = row < rows_total && lane_active;
    const DType* src = static_cast<const DType*>(p.q) + int64_t(w.qo_start) * p.q_stride_n +
                       int64_t(w.kv_head * w.group + row) * p.q_stride_h + dim0;
#pragma unroll
    for (int e = 0; e < DPL; ++e) q[r][e] = ok ? to_float(src[e]) * q_scale : 0.f;
  }

  const Mask<false, Traits::kWindow> mask{w.kv_len - w.qo_len, p.window_left};
  const int key_begin = max(mask.key_begin(0), w.kv_begin);
  const int key_end = w.kv_end;
  const int num_chunks = key_end > key_begin ? (key_end - key_begin + CHUNK - 1) / CHUNK : 0;
  const int my_chunks = num_chunks > warp ? (num_chunks - warp + WARPS - 1) / WARPS : 0;
  // Key n of this lane's group in the warp's i-th chunk is first_key + i * kChunkStride + n * GROUPS.
  const int first_key = key_begin + warp * CHUNK + key_group;
  constexpr int kChunkStride = WARPS * CHUNK;

  const DecodeKvRows<DTypeKV, Traits::kPaged> rows(
      kv_rows<DTypeKV, Traits::kPaged>(p, w, p.k, p.k_stride_n, p.k_stride_h, p.k_stride_page),
      kv_rows<DTypeKV, Traits::kPaged>(p, w, p.v, p.v_stride_n, p.v_stride_h, p.v_stride_page),
      lane_active ? dim0 : 0);  // an idle lane's zero-fills name a mapped address
  // This lane's slots: [stage][K, V][key][slot][lane].
  const uint32_t ring_begin = smem_addr(smem + warp * STAGES * kStageBytes) + lane * SLOT;
  const uint32_t ring_end = ring_begin + STAGES * kStageBytes;
  auto next_stage = [&](uint32_t stage) { return stage + kStageBytes == ring_end ? ring_begin : stage + kStageBytes; };

  // Page ids are looked up one chunk before their copies are issued, so that
  // the copies never wait on the page table.
  int page[NK];
  auto lookup_pages = [&](int i) {
#pragma unroll
    for (int n = 0; n < NK; ++n) {
      const int key = first_key + i * kChunkStride + n * GROUPS;
      page[n] = (i < my_chunks && key < key_end && lane_active) ? rows.page_of(key) : 0;
    }
  };
  auto issue_chunk = [&](int i, uint32_t stage) {
    if (i < my_chunks) {
#pragma unroll
      for (int n = 0; n < NK; ++n) {
        const int key = first_key + i * kChunkStride + n * GROUPS;
        const bool ok = key < key_end && lane_active;
        const char *k_src = rows.k, *v_src = rows.v;  // zero-filled past the keys, but mapped
        if (ok) rows.rows_of(page[n], key, k_src, v_src);
#pragma unroll
        for (int vec = 0; vec < VECS; ++vec) {
          copy_kv_slot<Traits>(stage + (n * VECS + vec) * kVecBytes, k_src + vec * SLOT, ok);
          copy_kv_slot<Traits>(stage + ((NK + n) * VECS + vec) * kVecBytes, v_src + vec * SLOT, ok);
        }
      }
    }
    cp_async_commit();  // possibly empty: keeps one group per stage for the waits below
  };

  uint32_t write_stage = ring_begin;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    lookup_pages(s);
    issue_chunk(s, write_stage);
    write_stage = next_stage(write_stage);
  }
  lookup_pages(STAGES - 1);

  // Softmax state: m and l of this lane's row, acc of every row.
  float m_mine = -CUDART_INF_F, l_mine = 0.f, acc[kRows][DPL];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[r][e] = 0.f;
  // Row r's value of a per-row quantity, from a lane of this key group that holds row r.
  const int group_lane0 = lane & ~(LANES - 1);
  auto row_value = [&](float mine, int r) {
    return kRows == 1 ? mine : __shfl_sync(0xffffffffu, mine, group_lane0 + r * (LANES / kRows));
  };

  uint32_t read_stage = ring_begin;
  for (int i = 0; i < my_chunks; ++i) {
    // Refill the stage consumed last iteration; only this thread reads it.
    issue_chunk(i + STAGES - 1, write_stage);
    write_stage = next_stage(write_stage);
    lookup_pages(i + STAGES);
    cp_async_wait<STAGES - 1>();

    // The logits of this lane's row (see reduce_scatter) for the chunk's keys.
    float s[NK];
#pragma unroll
    for (int n = 0; n < NK; ++n) {
      float kf[DPL];
#pragma unroll
      for (int vec = 0; vec < VECS; ++vec)
        read_kv_slot<Traits>(read_stage + (n * VECS + vec) * kVecBytes, kf + vec * SLOT_ELEMS);
      float dot[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        dot[r] = 0.f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) dot[r] = fmaf(q[r][e], kf[e], dot[r]);
      }
      reduce_scatter<LANES / 2, kRows>(dot, lane);
      s[n] = dot[0];
      if (Traits::kSoftCap) s[n] = p.logits_soft_cap * tanhf(s[n] / p.logits_soft_cap) * kLog2e;
    }
    // Only a warp's last chunk can run past the keys (uniform across the warp).
    const int chunk_key0 = first_key - key_group + i * kChunkStride;
    if (chunk_key0 + CHUNK > key_end) {
#pragma unroll
      for (int n = 0; n < NK; ++n)
        if (chunk_key0 + key_group + n * GROUPS >= key_end) s[n] = -CUDART_INF_F;
    }

    float m_new = m_mine;
#pragma unroll
    for (int n = 0; n < NK; ++n) m_new = fmaxf(m_new, s[n]);
    // While every key so far is masked, m stays -inf: subtract 0 instead,
    // which maps the -inf logits (and the -inf m) to weight 0.
    const float m_sub = m_new == -CUDART_INF_F ? 0.f : m_new;
    const float rescale = fast_exp2(m_mine - m_sub);
    m_mine = m_new;
    l_mine *= rescale;
#pragma unroll
    for (int n = 0; n < NK; ++n) {
      s[n] = fast_exp2(s[n] - m_sub);  // now the weight
      l_mine += s[n];
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float f = row_value(rescale, r);
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[r][e] *= f;
    }

#pragma unroll
    for (int n = 0; n < NK; ++n) {
      float vf[DPL];
#pragma unroll
      for (int vec = 0; vec < VECS; ++vec)
        read_kv_slot<Traits>(read_stage + ((NK + n) * VECS + vec) * kVecBytes, vf + vec * SLOT_ELEMS);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float weight = row_value(s[n], r);
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[r][e] = fmaf(weight, vf[e], acc[r][e]);
      }
    }
    read_stage = next_stage(read_stage);
  }
  cp_async_wait<0>();  // the trailing (zero-filled) copies land before the ring is reused
  float m[kRows], l[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = row_value(m_mine, r);
    l[r] = row_value(l_mine, r);
  }

  // Merge the key groups of this warp: afterwards every group holds the warp's state.
#pragma unroll
  for (int off = LANES; off < 32; off *= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[r], off);
      const float l_other = __shfl_xor_sync(0xffffffffu, l[r], off);
      const float m_all = fmaxf(m[r], m_other);
      const float f_mine = exp2_diff(m[r], m_all), f_other = exp2_diff(m_other, m_all);
      m[r] = m_all;
      l[r] = l[r] * f_mine + l_other * f_other;
#pragma unroll
      for (int e = 0; e < DPL; ++e) {
        const float a_other = __shfl_xor_sync(0xffffffffu, acc[r][e], off);
        acc[r][e] = acc[r][e] * f_mine + a_other * f_other;
      }
    }
  }

  // Merge the warps through shared memory: [warp][row][acc..., m, l].
  __syncthreads();
  float* merge = reinterpret_cast<float*>(smem);
  constexpr int kStride = D + 2;
  if (key_group == 0 && lane_active) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float* dst = merge + (warp * Traits::kRowsPerCta + r) * kStride;
#pragma unroll
      for (int e = 0; e < DPL; ++e) dst[dim0 + e] = acc[r][e];
      if (lane == 0) {
        dst[D] = m[r];
        dst[D + 1] = l[r];
      }
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < kRows * D; idx += Traits::kThreads) {
    const int r = idx / D, d = idx % D, row = w.row_begin + r;
    if (row >= rows_total) break;
    float m_all = -CUDART_INF_F;
#pragma unroll
    for (int wp = 0; wp < WARPS; ++wp) m_all = fmaxf(m_all, merge[(wp * Traits::kRowsPerCta + r) * kStride + D]);
    float l_all = 0.f, o = 0.f;
#pragma unroll
    for (int wp = 0; wp < WARPS; ++wp) {
      const float* src = merge + (wp * Traits::kRowsPerCta + r) * kStride;
      const float f = exp2_diff(src[D], m_all);
      l_all += src[D + 1] * f;
      o = fmaf(src[d], f, o);
    }
    // A row that sees no key (kv_len 0, an empty window) outputs 0 and LSE -inf.
    o = l_all > 0.f ? o / l_all : 0.f;
    if constexpr (Traits::kKvFp8) o *= kv_scale<Traits>(p.v_scale_ptr, p.v_scale);  // v_scale, on the normalised output
    const float lse = l_all > 0.f ? m_all + log2f(l_all) : -CUDART_INF_F;
    const int token = w.qo_start, head = w.kv_head * w.group + row;
    if (w.split >= 0) {  // fp32 partial state; the merge pass rounds once to DType
      const int64_t prow = partial_row(p, token, w.split) * p.num_qo_heads + head;
      p.partial_o[prow * D + d] = o;
      if (d == 0) p.partial_lse[prow] = lse;
    } else {
      float lse_out = lse;  // with the head's sink, where the call has sinks (sink_fold.cuh)
      const float factor = fold_sink(p.sinks, head, lse_out);
      static_cast<DType*>(p.o)[token * p.o_stride_n + head * p.o_stride_h + d] =
          from_float<DType>(p.sinks != nullptr ? __fmul_rn(o, factor) : o);
      if (Traits::kLse && p.lse != nullptr && d == 0) p.lse[token * p.lse_stride_n + head] = lse_out;
    }
  }
}

// The rows a CTA holds follow the group size (query heads per KV head), so
// MHA does not pay for four rows of arithmetic.
template <class Traits>
int launch_cuda_core_decode(const FlashjitAttentionParams& p, cudaStream_t stream) {
  const int group = p.num_kv_heads > 0 ? p.num_qo_heads / p.num_kv_heads : 1;
  const int threads = Traits::kThreads, smem = static_cast<int>(Traits::kSmemBytes);
  using O = typename Traits::DType;
  constexpr int D = Traits::kHeadDim;
  constexpr bool kLse = Traits::kLse;
  if (group == 1) return launch_attention<cuda_core_decode_attention_kernel<Traits, 1>, O, D, kLse>(p, threads, smem, stream);
  if (group == 2) return launch_attention<cuda_core_decode_attention_kernel<Traits, 2>, O, D, kLse>(p, threads, smem, stream);
  return launch_attention<cuda_core_decode_attention_kernel<Traits, 4>, O, D, kLse>(p, threads, smem, stream);
}

// Same for every row count: their shared memory and register cap are equal.
template <class Traits>
int cuda_core_decode_ctas_per_sm() {
  return ctas_per_sm<cuda_core_decode_attention_kernel<Traits, Traits::kRowsPerCta>>(Traits::kThreads,
                                                                            static_cast<int>(Traits::kSmemBytes));
}

}  // namespace flashjit
