// Attention on CUDA cores: fp32 logits, fp32 softmax and fp32 P.V throughout.
//
// A CTA owns kRowWarps * kRowsPerWarp packed rows of one KV head; its warps
// split the rows and share each K/V tile. Prefill runs here; decode, with a
// handful of rows per KV head, has its own kernel (cuda_core_decode.cuh).
//
// Per 32-key tile each lane owns one key for Q.K (reading a 16-byte-padded K row,
// conflict-free) and owns head dims lane, lane+32, ... for P.V. A head_dim_vo
// that is an odd multiple of 16 (48, 80, ...) leaves lanes 16..31 without a
// dim in the last slot: they skip its reads and stores (kVoLanesFull false),
// and every dim keeps its own chain over the keys, as at the other head dims.
#pragma once
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/merge_states.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/sink_fold.cuh"
#include "flashjit/common/work.cuh"

namespace flashjit {

template <class DTypeQ_, class DTypeKV_, class DTypeO_, int kHeadDimQK_, int kHeadDimVO_,
          int kRowsPerWarp_, int kRowWarps_, bool kPaged_, bool kCausal_, bool kWindow_,
          bool kSoftCap_, bool kLse_>
struct CudaCoreTraits {
  using DTypeQ = DTypeQ_;
  using DTypeKV = DTypeKV_;
  using DTypeO = DTypeO_;
  static constexpr int kHeadDimQK = kHeadDimQK_;
  static constexpr int kHeadDimVO = kHeadDimVO_;
  static constexpr int kRowsPerWarp = kRowsPerWarp_;
  static constexpr int kRowWarps = kRowWarps_;
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kWindow = kWindow_;
  static constexpr bool kSoftCap = kSoftCap_;
  static constexpr bool kLse = kLse_;

  static constexpr int kKeysPerTile = 32;
  // A minimum of 3 resident CTAs (at most 170 registers a thread) is what keeps
  // ptxas from spilling a few bytes in some variants; shared memory allows 3 anyway.
  static constexpr int kMinBlocksPerSm = 3;
  static constexpr int kThreads = 32 * kRowWarps;
  static constexpr int kRowsPerCta = kRowsPerWarp * kRowWarps;
  static constexpr int kKvVec = Vec16<DTypeKV>::kElems;
  // K rows padded by 16 bytes so that lanes reading different rows at the same
  // column fall in different banks.
  static constexpr int kKRowStride = kHeadDimQK + kKvVec;
  // Q.K steps (16-byte K vectors) unrolled together: 4 where they divide the
  // row, else 2 (16-bit head dims 48, 80, ...), as a remainder loop costs the
  // registers that the heaviest variants at 208 and 240 dims do not have.
  static constexpr int kQkSteps = kHeadDimQK / kKvVec;
  static constexpr int kQkUnroll = kQkSteps % 4 == 0 ? 4 : kQkSteps % 2 == 0 ? 2 : 1;
  static constexpr int kDimsPerLane = (kHeadDimVO + 31) / 32;
  // Every lane has a dim in every slot (head_dim_vo a multiple of 32).
  static constexpr bool kVoLanesFull = kHeadDimVO % 32 == 0;

  static_assert(kHeadDimQK % kKvVec == 0 && kHeadDimQK % 4 == 0, "head_dim_qk tiling");
  static_assert(kHeadDimVO % 16 == 0 && kHeadDimVO % kKvVec == 0, "head_dim_vo tiling");

  // Whether lane's slot i holds a dim (i + 1 < kDimsPerLane is known where the
  // loops are unrolled, so only the last slot tests the lane).
  static __device__ __forceinline__ bool vo_dim(int lane, int i) {
    return kVoLanesFull || i + 1 < kDimsPerLane || lane < kHeadDimVO % 32;
  }

  // Shared memory layout, in bytes; all offsets are 16-byte aligned.
  static constexpr size_t kQBytes = sizeof(float) * kRowsPerCta * kHeadDimQK;
  static constexpr size_t kKTileBytes = sizeof(DTypeKV) * kKeysPerTile * kKRowStride;
  static constexpr size_t kVTileBytes = sizeof(DTypeKV) * kKeysPerTile * kHeadDimVO;
  static constexpr size_t kPBytes = sizeof(float) * kRowWarps * kRowsPerWarp * kKeysPerTile;
  static constexpr size_t kSmemBytes = kQBytes + kPBytes + kKTileBytes + kVTileBytes;
};

// Issues asynchronous copies of kRows keys from `first` on (ragged rows or
// page slots) to shared memory (row stride kSmemStride) in 16-byte vectors;
// rows past `valid` are zero-filled so that no uninitialised value reaches the
// arithmetic. Every copy of the tile is in flight before any is waited for.
template <class T, int kCols, int kSmemStride, int kRows, int kThreads, class Rows>
__device__ __forceinline__ void copy_rows_async(T* smem, const Rows& src, int first, int valid, int thread) {
  constexpr int kVec = Vec16<T>::kElems;
  constexpr int kVecsPerRow = kCols / kVec;
  static_assert(kCols % kVec == 0 && kVecsPerRow <= kThreads, "whole vectors per row, a row per round at least");
  if constexpr (kThreads % kVecsPerRow == 0) {
    static_assert((kRows * kVecsPerRow) % kThreads == 0, "whole vectors per thread");
#pragma unroll 8
    for (int i = 0; i < kRows * kVecsPerRow / kThreads; ++i) {
      const int idx = thread + i * kThreads;
      const int r = idx / kVecsPerRow, c = (idx % kVecsPerRow) * kVec;
      const bool ok = r < valid;
      cp_async_16(smem_addr(smem + r * kSmemStride + c), ok ? src.row(first + r) + c : src.base, ok);
    }
  } else {
    // Rows of a vector count that does not divide the threads (16-bit head
    // dims 48, 80, ...): whole rows a round, the threads past them idle, so
    // that a thread's column and first row are divided out once.
    constexpr int kRowsPerRound = kThreads / kVecsPerRow;
    const int r0 = thread / kVecsPerRow, c = (thread % kVecsPerRow) * kVec;
    if (r0 >= kRowsPerRound) return;
#pragma unroll 8
    for (int i = 0; i < (kRows + kRowsPerRound - 1) / kRowsPerRound; ++i) {
      const int r = r0 + i * kRowsPerRound;
      if (kRows % kRowsPerRound == 0 || r < kRows) {
        const bool ok = r < valid;
        cp_async_16(smem_addr(smem + r * kSmemStride + c), ok ? src.row(first + r) + c : src.base, ok);
      }
    }
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    cuda_core_attention_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  using DTypeQ = typename Traits::DTypeQ;
  using DTypeKV = typename Traits::DTypeKV;
  using DTypeO = typename Traits::DTypeO;
  constexpr int D_QK = Traits::kHeadDimQK, D_VO = Traits::kHeadDimVO;
  constexpr int R = Traits::kRowsPerWarp, KEYS = Traits::kKeysPerTile;
  constexpr int ROW_WARPS = Traits::kRowWarps;
  constexpr int DPL = Traits::kDimsPerLane;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(16) unsigned char smem[];
  float* q_s = reinterpret_cast<float*>(smem);
  float* p_s = reinterpret_cast<float*>(smem + Traits::kQBytes);
  unsigned char* tiles = smem + Traits::kQBytes + Traits::kPBytes;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_warp = warp;
  const CtaWork w = decode_work<Traits::kPaged>(p, Traits::kRowsPerCta);
  const int rows_total = w.qo_len * w.group;
  if (!w.valid || w.row_begin >= rows_total) return;  // uniform across the CTA
  const Mask<Traits::kCausal, Traits::kWindow> mask{w.kv_len - w.qo_len, p.window_left};

  // Stage this CTA's queries in fp32, pre-scaled so that logits come out in
  // log2 units (or in natural units when the soft-cap needs them).
  const float q_scale = Traits::kSoftCap ? p.sm_scale : p.sm_scale * kLog2e;
  {
    const auto packed = w.packed_rows();
    for (int idx = threadIdx.x; idx < Traits::kRowsPerCta * D_QK; idx += Traits::kThreads) {
      int r = idx / D_QK, d = idx % D_QK, row = w.row_begin + r;
      float val = 0.f;
      if (row < rows_total) {
        int token, head;
        packed.locate(row, token, head);
        val = to_float(static_cast<const DTypeQ*>(p.q)[token * p.q_stride_n + head * p.q_stride_h + d]) *
              q_scale;
      }
      q_s[idx] = val;
    }
  }

  const int warp_row0 = w.row_begin + row_warp * R;
  int row_qpos[R];
#pragma unroll
  for (int r = 0; r < R; ++r) row_qpos[r] = min(warp_row0 + r, rows_total - 1) / w.group;

  // Key range any row of the CTA can see, in whole tiles, within this CTA's
  // split (split boundaries are multiples of the tile, so no tile straddles one).
  const int cta_q_first = w.row_begin / w.group;
  const int cta_q_last = min(w.row_begin + Traits::kRowsPerCta, rows_total) - 1;
  const int key_begin = max((mask.key_begin(cta_q_first) / KEYS) * KEYS, w.kv_begin);
  const int key_end = min(mask.key_end(cta_q_last / w.group, w.kv_len), w.kv_end);
  const int num_tiles = key_end > key_begin ? (key_end - key_begin + KEYS - 1) / KEYS : 0;

  DTypeKV* k_s = reinterpret_cast<DTypeKV*>(tiles);
  DTypeKV* v_s = reinterpret_cast<DTypeKV*>(tiles + Traits::kKTileBytes);
  float* my_p = p_s + (warp * R) * KEYS;
  const auto k_rows = kv_rows<DTypeKV, Traits::kPaged>(p, w, p.k, p.k_stride_n, p.k_stride_h, p.k_stride_page);
  const auto v_rows = kv_rows<DTypeKV, Traits::kPaged>(p, w, p.v, p.v_stride_n, p.v_stride_h, p.v_stride_page);
  const int loader = threadIdx.x;  // all warps load each tile together

  float m[R], l[R], acc[R][DPL];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -CUDART_INF_F;
    l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[r][i] = 0.f;
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int t0 = key_begin + tile * KEYS;
    __syncthreads();  // previous tiles fully consumed (and q_s written, first time)
    const int valid = min(KEYS, w.kv_len - t0);
    copy_rows_async<DTypeKV, D_QK, Traits::kKRowStride, KEYS, 32 * ROW_WARPS>(k_s, k_rows, t0, valid, loader);
    copy_rows_async<DTypeKV, D_VO, D_VO, KEYS, 32 * ROW_WARPS>(v_s, v_rows, t0, valid, loader);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // Logits for key t0 + lane, one per row of this warp.
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.f;
    const DTypeKV* k_row = k_s + lane * Traits::kKRowStride;
#pragma unroll Traits::kQkUnroll
    for (int d = 0; d < D_QK; d += Traits::kKvVec) {
      float kf[Traits::kKvVec];
      unpack16<DTypeKV>(*reinterpret_cast<const uint4*>(k_row + d), kf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float* qrow = q_s + (row_warp * R + r) * D_QK + d;
#pragma unroll
        for (int e = 0; e < Traits::kKvVec; e += 4) {
          float4 qv = *reinterpret_cast<const float4*>(qrow + e);
          s[r] = fmaf(qv.x, kf[e], s[r]);
          s[r] = fmaf(qv.y, kf[e + 1], s[r]);
          s[r] = fmaf(qv.z, kf[e + 2], s[r]);
          s[r] = fmaf(qv.w, kf[e + 3], s[r]);
        }
      }
    }

    const int key = t0 + lane;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (Traits::kSoftCap) s[r] = p.logits_soft_cap * tanhf(s[r] / p.logits_soft_cap) * kLog2e;
      if (!mask.visible(row_qpos[r], key, w.kv_len)) s[r] = -CUDART_INF_F;
      const float m_new = fmaxf(m[r], warp_max(s[r]));
      const float rescale = exp2_diff(m[r], m_new);
      const float prob = exp2_diff(s[r], m_new);
      m[r] = m_new;
      // Per-lane partial, summed across lanes at the end; one explicit FMA, so that
      // no row of the unrolled loop gets another rounding (see fa2_softmax.cuh).
      l[r] = fmaf(l[r], rescale, prob);
      my_p[r * KEYS + lane] = prob;
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[r][i] *= rescale;
    }
    __syncwarp();

#pragma unroll 4
    for (int j = 0; j < KEYS; j += 4) {
      float vf[4][DPL];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int i = 0; i < DPL; ++i)
          vf[jj][i] = Traits::vo_dim(lane, i) ? to_float(v_s[(j + jj) * D_VO + lane + 32 * i]) : 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float4 pv = *reinterpret_cast<const float4*>(my_p + r * KEYS + j);
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
          acc[r][i] = fmaf(pv.x, vf[0][i], acc[r][i]);
          acc[r][i] = fmaf(pv.y, vf[1][i], acc[r][i]);
          acc[r][i] = fmaf(pv.z, vf[2][i], acc[r][i]);
          acc[r][i] = fmaf(pv.w, vf[3][i], acc[r][i]);
        }
      }
    }
    __syncwarp();
  }

#pragma unroll
  for (int r = 0; r < R; ++r) l[r] = warp_sum(l[r]);
  const auto packed = w.packed_rows();

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = warp_row0 + r;
    if (row >= rows_total) break;
    int token, head;
    packed.locate(row, token, head);
    // A row that sees no key (kv_len 0, or masked out entirely) outputs 0 and LSE -inf.
    const float inv_l = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float lse = l[r] > 0.f ? m[r] + log2f(l[r]) : -CUDART_INF_F;
    if (w.split >= 0) {  // fp32 partial state; the merge pass rounds once to DTypeO
      const int64_t idx = partial_row(p, token, w.split) * p.num_qo_heads + head;
#pragma unroll
      for (int i = 0; i < DPL; ++i)
        if (Traits::vo_dim(lane, i)) p.partial_o[idx * D_VO + lane + 32 * i] = acc[r][i] * inv_l;
      if (lane == 0) p.partial_lse[idx] = lse;
      continue;
    }
    float lse_out = lse;  // with the head's sink, where the call has sinks (sink_fold.cuh)
    const float factor = fold_sink(p.sinks, head, lse_out);
    DTypeO* out = static_cast<DTypeO*>(p.o) + token * p.o_stride_n + head * p.o_stride_h;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      const float y = acc[r][i] * inv_l;
      if (Traits::vo_dim(lane, i)) out[lane + 32 * i] = from_float<DTypeO>(p.sinks != nullptr ? __fmul_rn(y, factor) : y);
    }
    if (Traits::kLse && p.lse != nullptr && lane == 0) p.lse[token * p.lse_stride_n + head] = lse_out;
  }
}

template <class Traits>
int launch_cuda_core_attention(const FlashjitAttentionParams& p, cudaStream_t stream) {
  return launch_attention<cuda_core_attention_kernel<Traits>, typename Traits::DTypeO, Traits::kHeadDimVO,
                          Traits::kLse>(p, Traits::kThreads, static_cast<int>(Traits::kSmemBytes), stream);
}

template <class Traits>
int cuda_core_ctas_per_sm() {
  return ctas_per_sm<cuda_core_attention_kernel<Traits>>(Traits::kThreads, static_cast<int>(Traits::kSmemBytes));
}

}  // namespace flashjit
