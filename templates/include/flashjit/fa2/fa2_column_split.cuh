// fa2 tensor-core attention at head dims whose O one warp cannot hold: at 512,
// a warp's m16 fragment of rows over all 512 fp32 columns of O would take 256
// registers a lane. Decode (single and paged) and paged prefill; fp16 / bf16
// q and o, K/V of q's dtype or FP8 codes (widened in shared memory, fa2_fp8.cuh).
//
// A CTA holds one m16 fragment of packed rows (query token x query head of one
// KV head, as fa2_attention.cuh), shared by every warp; the warps split the
// two products differently, as the fa2 MLA kernel does (fa2_mla.cuh):
//   * S = Q.K^T: warp w multiplies the k-steps w, w + W, w + 2W, ... (16 head
//     dims each) of every key of the tile, its Q fragments in registers; the
//     partial logits meet in shared memory (over Q's bytes, once Q is in
//     registers) and every warp sums all W of them in one fixed order, so that
//     every warp holds the same S, bit for bit;
//   * every warp runs the same online softmax on it (fa2::WarpSoftmax, lazy
//     max: rows-split prefill's), so m, l and the rescales agree across warps
//     without further exchange, and rounds P to the input dtype in registers;
//   * O += P.V: warp w owns output columns [D / W * w, D / W * (w + 1)), its V
//     B-fragments read by ldmatrix.trans as fa2_attention.cuh reads them.
// K and V tiles stream through a kStages-deep cp.async ring (one commit group
// a tile: K and V together), a key's page looked up a tile ahead of its copy.
// Barriers per tile: one after the tile lands (it also proves every warp done
// with the previous tile, its slot and the exchange), one after the partial
// logits are written, and with FP8 one after the codes are widened.
// Every tile the CTA loads holds a key some row sees (the key range comes from
// the rows' own bounds), so no step is skipped; masks apply where a tile
// reaches past kv_len, a causal or window bound, or the custom mask's full keys.
#pragma once
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/sink_fold.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_column_split_common.cuh"
#include "flashjit/fa2/fa2_epilogue.cuh"
#include "flashjit/fa2/fa2_fp8.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa2/fa2_softmax.cuh"

namespace flashjit {

// Rendered from flashjit/kernels/fa2.py's Fa2ColumnSplitTiling.
template <class DType_, class KvType_, int kHeadDim_, int kWarps_, int kKeysPerTile_, int kStages_,
          int kMinBlocksPerSm_, bool kPaged_, bool kCausal_, bool kWindow_, bool kSoftCap_, bool kLse_,
          bool kCustomMask_>
struct Fa2ColumnSplitTraits {
  using DType = DType_;
  using KvType = KvType_;  // DType, or an FP8 format whose tiles are widened to DType
  static constexpr bool kKvFp8 = !std::is_same<KvType_, DType_>::value;
  static constexpr int kHeadDim = kHeadDim_, kHeadDimVo = kHeadDim_;
  static constexpr int kWarps = kWarps_, kThreads = 32 * kWarps_;
  static constexpr int kKeysPerTile = kKeysPerTile_, kStages = kStages_, kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr bool kPaged = kPaged_, kCausal = kCausal_, kWindow = kWindow_, kSoftCap = kSoftCap_;
  static constexpr bool kLse = kLse_, kCustomMask = kCustomMask_;
  static constexpr int kRowsPerCta = 16;

  // Q.K^T k-steps of a warp (steps w + kWarps i: every step of a warp at the
  // swizzle phase w % 4, its ldmatrix addresses whole 128-byte blocks apart),
  // and the O columns it owns.
  static constexpr int kQkStepsPerWarp = kHeadDim / 16 / kWarps;
  static constexpr int kColsPerWarp = kHeadDim / kWarps;
  // 16-bit rows (Q, K, V and the widened FP8 tiles), swizzled; FP8 code rows
  // land as they lie (kHeadDim bytes, fa2::PlainTile) for the widening pass.
  static constexpr int kRowBytes = kHeadDim * 2;
  using Layout = fa2::RowMajorTile<kRowBytes>;
  static constexpr int kStageRowBytes = kKvFp8 ? kHeadDim : kRowBytes;
  using StageLayout = std::conditional_t<kKvFp8, fa2::PlainTile<kStageRowBytes>, Layout>;
  // A copy covers one 16-byte chunk of each 128-byte line of a row (one
  // address, and with pages one page lookup, per thread and tile).
  static constexpr int kCopySpan = 128;

  // What fa2::WarpSoftmax reads: one fragment over a whole tile, O as wide as
  // a warp's columns, the lazy max (every warp sees the same logits and takes
  // the same decisions).
  struct Softmax {
    using DType = DType_;
    static constexpr int kFragsM = 1;
    static constexpr int kKeysPerStep = kKeysPerTile_;
    static constexpr int kHeadDimVo = kHeadDim_ / kWarps_;
    static constexpr bool kSplitKeys = false;
    static constexpr bool kSoftCap = kSoftCap_;
  };

  // Shared memory: [Q, later the logit exchange | stage 0: K, V | stage 1 ... |
  // with FP8 the widened K, V]. The exchange is laid out [warp][value][lane].
  static constexpr int kQBytes = kRowsPerCta * kRowBytes;
  static constexpr int kXchgFloatsPerWarp = kRowsPerCta * kKeysPerTile;
  static constexpr int kXchgBytes = kWarps * kXchgFloatsPerWarp * 4;
  static constexpr int kHeadBytes = kQBytes > kXchgBytes ? kQBytes : kXchgBytes;
  static constexpr int kStageTileBytes = kKeysPerTile * kStageRowBytes;  // K's part of a stage; V's follows
  static constexpr int kStageBytes = 2 * kStageTileBytes;
  static constexpr int kTileBytes = kKeysPerTile * kRowBytes;  // a 16-bit K (or V) tile
  static constexpr size_t kSmemBytes =
      size_t(kHeadBytes) + size_t(kStages) * kStageBytes + (kKvFp8 ? 2 * kTileBytes : 0);

  static_assert(std::is_same<DType, __half>::value || std::is_same<DType, __nv_bfloat16>::value,
                "fa2 tensor-core attention takes __half or __nv_bfloat16");
  static_assert(!kKvFp8 || sizeof(KvType_) == 1, "K/V of q's dtype, or FP8 codes");
  static_assert(kWarps % 4 == 0 && kHeadDim % (16 * kWarps) == 0 && kColsPerWarp % 64 == 0,
                "whole k-steps and 128-byte column blocks per warp, a multiple of four warps");
  static_assert(kKeysPerTile % 16 == 0 && kStages >= 2, "whole k16 steps of keys; a 2-stage ring at least");
  static_assert(kKeysPerTile % (kThreads / 8) == 0, "a tile's rows: whole copy passes");
  static_assert(kHeadBytes % 128 == 0 && kStageTileBytes % 128 == 0, "128-byte aligned slots");
};

namespace fa2 {

// The end of a column-split CTA: every warp holds the same m and l of the
// CTA's rows and writes its own columns of O (col0: this lane's first; o: its
// n8 tiles) over rows g and g + 8, either normalised into the output, with the
// head's sink folded in as fa2::write_rows folds it (sink_fold.cuh), or as a
// split-KV chunk's fp32 partial state; warp 0 writes the rows' LSE.
template <class Traits, class Softmax, int NT>
__device__ __forceinline__ void store_column_split_rows(const FlashjitAttentionParams& p, const CtaWork& w,
                                                        float (&o)[1][NT][4], Softmax& softmax, int rows_total,
                                                        int col0) {
  using T = typename Traits::DType;
  constexpr int D = Traits::kHeadDimVo;
  const int lane = threadIdx.x % 32, g = lane / 4;
  const bool writes_lse = threadIdx.x / 32 == 0 && lane % 4 == 0;
  float inv_l[1][2], lse[1][2];
  row_factors<typename Traits::Softmax>(softmax.m, softmax.l, softmax.scale, inv_l, lse);
  if constexpr (Traits::kKvFp8) {  // v_scale: values are codes x v_scale, and O is linear in them
    const float v_scale = kv_scale_value(p.v_scale_ptr, p.v_scale);
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[0][n][e] *= v_scale;
  }
  const auto packed = w.packed_rows();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = w.row_begin + g + 8 * r;
    if (row >= rows_total) continue;
    int token, head;
    packed.locate(row, token, head);
    if (w.split >= 0) {  // fp32 normalised output and LSE; the merge pass rounds once
      const int64_t idx = partial_row(p, token, w.split) * p.num_qo_heads + head;
      float* dst = p.partial_o + idx * D + col0;
#pragma unroll
      for (int n = 0; n < NT; ++n)
        *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[0][n][2 * r] * inv_l[0][r],
                                                              o[0][n][2 * r + 1] * inv_l[0][r]);
      if (writes_lse) p.partial_lse[idx] = lse[0][r];
      continue;
    }
    float lse_out = lse[0][r];
    const float factor = fold_sink(p.sinks, head, lse_out);
    const bool has_sinks = p.sinks != nullptr;
    auto out = [&](float x) {
      const float y = x * inv_l[0][r];
      return has_sinks ? __fmul_rn(y, factor) : y;
    };
    T* dst = static_cast<T*>(p.o) + int64_t(token) * p.o_stride_n + int64_t(head) * p.o_stride_h + col0;
#pragma unroll
    for (int n = 0; n < NT; ++n)
      *reinterpret_cast<uint32_t*>(dst + 8 * n) = pack2<T>(out(o[0][n][2 * r]), out(o[0][n][2 * r + 1]));
    if (Traits::kLse && p.lse != nullptr && writes_lse) p.lse[int64_t(token) * p.lse_stride_n + head] = lse_out;
  }
}

}  // namespace fa2

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    fa2_column_split_attention_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  using T = typename Traits::DType;
  using L = typename Traits::Layout;
  using SL = typename Traits::StageLayout;
  using SoftmaxTraits = typename Traits::Softmax;
  constexpr int D = Traits::kHeadDim, KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages;
  constexpr int ROWS = Traits::kRowsPerCta, WARPS = Traits::kWarps, THREADS = Traits::kThreads;
  constexpr int ROW_BYTES = Traits::kRowBytes, SPAN = Traits::kCopySpan;
  constexpr int NT_S = KEYS / 8, KSTEPS_PV = KEYS / 16, NT_O = Traits::kColsPerWarp / 8;
  constexpr int QK_STEPS = Traits::kQkStepsPerWarp;
  constexpr bool kFp8 = Traits::kKvFp8;
  // FP8 code rows are copied as pairs of codes (16-bit words), as fa2_attention.cuh copies them.
  using CopyT = std::conditional_t<kFp8, uint16_t, T>;
  constexpr int COPY_D = kFp8 ? D / 2 : D, kStride = kFp8 ? 2 : 1;
  constexpr float kLog2e = 1.4426950408889634f;
  const float kNegInf = -CUDART_INF_F;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t q_smem = smem_addr(smem);
  const uint32_t kv_smem = q_smem + Traits::kHeadBytes;
  const uint32_t widened_k = kv_smem + STAGES * Traits::kStageBytes, widened_v = widened_k + Traits::kTileBytes;
  float* xchg = reinterpret_cast<float*>(smem);  // over Q, once Q is in registers

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, tq = lane % 4;
  const CtaWork w = decode_work<Traits::kPaged>(p, ROWS);
  const int rows_total = w.qo_len * w.group;
  if (!w.valid || w.row_begin >= rows_total) return;  // uniform across the CTA
  const int offset = w.kv_len - w.qo_len;
  const int window_left = Traits::kWindow ? min(p.window_left, 1 << 30) : 0;  // as fa2_attention.cuh
  const Mask<Traits::kCausal, Traits::kWindow> mask{offset, window_left};
  const auto custom = custom_mask_of<Traits::kCustomMask>(p, w);
  // Keys any row of the CTA sees, from a KEYS-aligned start, within its split-KV chunk.
  const int q_first = w.row_begin / w.group, q_last = (min(w.row_begin + ROWS, rows_total) - 1) / w.group;
  const int key_begin = max((mask.key_begin(q_first) / KEYS) * KEYS, w.kv_begin);
  const int key_end = min(mask.key_end(q_last, w.kv_len), w.kv_end);
  const int num_tiles = key_end > key_begin ? (key_end - key_begin + KEYS - 1) / KEYS : 0;

  float o[1][NT_O][4];
  fa2::WarpSoftmax<SoftmaxTraits> softmax;
  const float k_scale = kFp8 ? kv_scale_value(p.k_scale_ptr, p.k_scale) : 1.f;  // keys are codes x k_scale
  softmax.scale = Traits::kSoftCap ? 1.f : p.sm_scale * k_scale * kLog2e;
  softmax.cap_in = Traits::kSoftCap ? p.sm_scale * k_scale / p.logits_soft_cap : 0.f;
  softmax.cap_out = Traits::kSoftCap ? p.logits_soft_cap * kLog2e : 0.f;
  fa2::start_rows(softmax, o[0]);

  if (num_tiles > 0) {
    const auto k_rows = kv_rows<CopyT, Traits::kPaged>(p, w, p.k, p.k_stride_n / kStride, p.k_stride_h / kStride,
                                                       p.k_stride_page / kStride);
    const auto v_rows = kv_rows<CopyT, Traits::kPaged>(p, w, p.v, p.v_stride_n / kStride, p.v_stride_h / kStride,
                                                       p.v_stride_page / kStride);
    fa2::copy_q_tile<L, ROWS, D, THREADS, SPAN>(p, w, static_cast<const T*>(p.q), q_smem, rows_total, tid);
    using Copy = std::conditional_t<Traits::kPaged, fa2::PagedTileCopy<CopyT, SL, KEYS, COPY_D, THREADS, SPAN>,
                                    fa2::RaggedTileCopy<CopyT, SL, KEYS, COPY_D, THREADS, SPAN>>;
    const Copy k_copy(k_rows, tid), v_copy(v_rows, tid);
    int pages[Copy::R::kPerThread];  // of this thread's rows of the next tile to issue (K and V share them)
    auto lookup = [&](int tile) {
      if constexpr (Traits::kPaged) {
        if (tile < num_tiles) {
          const int k0 = key_begin + tile * KEYS;
          k_copy.lookup(pages, k0, min(KEYS, w.kv_len - k0));
        }
      }
    };
    // Tile `tile`'s K and V into its ring slot, one commit group (empty past the last tile).
    auto issue = [&](int tile) {
      if (tile < num_tiles) {
        const int k0 = key_begin + tile * KEYS;
        const uint32_t slot = kv_smem + (tile % STAGES) * Traits::kStageBytes;
        if constexpr (Traits::kPaged) {
          k_copy.issue(slot, pages, k0, min(KEYS, w.kv_len - k0));
          v_copy.issue(slot + Traits::kStageTileBytes, pages, k0, min(KEYS, w.kv_len - k0));
        } else {
          k_copy.issue(slot, k0, w.kv_len - k0, k_rows.base);
          v_copy.issue(slot + Traits::kStageTileBytes, k0, w.kv_len - k0, v_rows.base);
        }
      }
      cp_async_commit();
    };
    // Groups: [Q + tile 0], [tile 1], ..., [tile STAGES - 2].
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      lookup(s);
      issue(s);
    }
    lookup(STAGES - 1);

    // Lane offsets (fa2_primitives.cuh): A pattern for Q and for V
    // (ldmatrix.trans), B pattern for K. This warp's k-steps are warp + W i:
    // swizzle phase warp % 4 (one XOR here), block warp / 4 + (W / 4) i. Its O
    // columns start at block kColsPerWarp / 64 * warp (the XOR leaves block bits alone).
    constexpr int kStepBlocks = WARPS / 4;
    const uint32_t a_off0 = L::at(lane % 16, lane / 16, lane % 8);
    const uint32_t b_off0 = L::at(8 * (lane / 16) + lane % 8, (lane / 8) % 2, lane % 8);
    const uint32_t a_warp = (a_off0 ^ (uint32_t(warp % 4) << 5)) + L::block(warp / 4);
    const uint32_t b_warp = (b_off0 ^ (uint32_t(warp % 4) << 5)) + L::block(warp / 4);
    const uint32_t v_warp = a_off0 + L::block(Traits::kColsPerWarp / 64 * warp);

    uint32_t q_frag[QK_STEPS][4];
    cp_async_wait<STAGES - 2>();  // [Q + tile 0] landed for this thread ...
    __syncthreads();              // ... and for all (Q rows come from every thread)
#pragma unroll
    for (int i = 0; i < QK_STEPS; ++i) fa2::ldmatrix_x4(q_frag[i], q_smem + a_warp + L::block(kStepBlocks * i));

    // Element mask of S for the tile at k0: s[j][e] is row g + 8 (e / 2) of
    // the CTA, key k0 + 8 j + 2 tq + e % 2 (visible as in Mask::visible).
    auto mask_tile = [&](float (&sf)[NT_S][4], int, int k0) {
      int q_off[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) q_off[r] = min(w.row_begin + g + 8 * r, rows_total - 1) / w.group + offset;
#pragma unroll
      for (int j = 0; j < NT_S; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + 8 * j + 2 * tq + (e & 1);
          const int qo = q_off[e >> 1];
          bool hidden = key >= w.kv_len || (Traits::kCausal && key > qo) ||
                        (Traits::kWindow && key < qo - window_left);
          if constexpr (Traits::kCustomMask) hidden = hidden || !custom.visible(qo - offset, key);
          if (hidden) sf[j][e] = kNegInf;
        }
    };

    for (int t = 0; t < num_tiles; ++t) {
      const uint32_t slot = kv_smem + (t % STAGES) * Traits::kStageBytes;
      const int t0 = key_begin + t * KEYS;
      cp_async_wait<STAGES - 2>();
      // Tile t landed for every thread; every warp is done with tile t - 1 (its
      // ring slot, refilled next, the widened tiles) and with the exchange.
      __syncthreads();
      issue(t + STAGES - 1);
      lookup(t + STAGES);
      if constexpr (kFp8) {
        fa2::widen_fp8_tile<typename Traits::KvType, T, L, KEYS, D, THREADS>(slot, widened_k, tid);
        fa2::widen_fp8_tile<typename Traits::KvType, T, L, KEYS, D, THREADS>(slot + Traits::kStageTileBytes,
                                                                             widened_v, tid);
        __syncthreads();
      }
      const uint32_t k_s = kFp8 ? widened_k : slot, v_s = kFp8 ? widened_v : slot + Traits::kStageTileBytes;

      // This warp's share of S: its k-steps of every key of the tile.
      float s[1][NT_S][4];
#pragma unroll
      for (int j = 0; j < NT_S; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][j][e] = 0.f;
#pragma unroll
      for (int i = 0; i < QK_STEPS; ++i)
        fa2::mma_qk_step_over_tile<T, KEYS, ROW_BYTES>(s[0], q_frag[i], k_s, b_warp,
                                                       L::block(kStepBlocks * i));
      fa2::sum_logits_across_warps<WARPS, Traits::kXchgFloatsPerWarp>(s[0], xchg, warp, lane);

      const bool need_mask = (Traits::kCustomMask && t0 + KEYS > custom.full_keys) || t0 + KEYS > w.kv_len ||
                             (Traits::kCausal && t0 + KEYS - 1 > q_first + offset) ||
                             (Traits::kWindow && t0 < q_last + offset - window_left);
      uint32_t pa[1][KSTEPS_PV][4];
      softmax.update_max(s, o, t0, need_mask, t == 0, mask_tile);
      softmax.exp_to_p(s, pa, 0);

      // O[:, this warp's columns] += P . V.
#pragma unroll
      for (int kk = 0; kk < KSTEPS_PV; ++kk)
#pragma unroll
        for (int dn = 0; dn < NT_O / 2; ++dn) {
          uint32_t b[4];
          fa2::ldmatrix_x4_trans(b, v_s + kk * 16 * ROW_BYTES + L::pair(v_warp, dn));
          fa2::mma_16816<T>(o[0][2 * dn], pa[0][kk], b[0], b[1]);
          fa2::mma_16816<T>(o[0][2 * dn + 1], pa[0][kk], b[2], b[3]);
        }
    }
    cp_async_wait<0>();  // only empty groups can still be pending
  }
  fa2::store_column_split_rows<Traits>(p, w, o, softmax, rows_total, warp * Traits::kColsPerWarp + 2 * tq);
}

template <class Traits>
int launch_fa2_column_split(const FlashjitAttentionParams& p, cudaStream_t stream) {
  return launch_attention<fa2_column_split_attention_kernel<Traits>, typename Traits::DType, Traits::kHeadDimVo,
                          Traits::kLse>(p, Traits::kThreads, static_cast<int>(Traits::kSmemBytes), stream);
}

template <class Traits>
int fa2_column_split_ctas_per_sm() {
  return ctas_per_sm<fa2_column_split_attention_kernel<Traits>>(Traits::kThreads,
                                                                static_cast<int>(Traits::kSmemBytes));
}

}  // namespace flashjit
