// FlashAttention-2 style attention on tensor cores, for fp16 and bf16 (q, k, v
// and o of one dtype) and head_dim 64 / 128 / 256. Same semantics and ABI as
// cuda_core_attention.cuh: a CTA owns kRowsPerCta packed rows (query token x
// query head pairs of one KV head, token-major) of one request, grid
// (num_work, num_kv_heads).
// Fragment layouts and the swizzle: fa2_primitives.cuh; the compile-time shape:
// fa2_traits.cuh; the online softmax: fa2_softmax.cuh; the K/V ring when the
// TMA unit loads it: fa2_kv_tma.cuh; the end of a CTA (state merge, stores):
// fa2_epilogue.cuh; the host launch: fa2_launch.cuh.
//
// Structure of one CTA (kWarps warps, 16 * kFragsM rows per warp):
//   * Q (kRowsPerCta x D) and K/V tiles (kKeysPerTile x D) live in XOR-swizzled
//     shared memory; K/V tiles stream through a kStages-deep ring, copied by
//     every thread's cp.async or, on the sm_90a wide tilings, loaded by TMA.
//   * Each warp computes S = Q.K^T for its kFragsM m16 fragments of rows with
//     mma.sync.m16n8k16 (each K / V B-fragment loaded once feeds kFragsM mma's)
//     (fp32 accumulation), runs the online softmax on S in registers (fp32,
//     exp2f, logits in log2 units), rounds P to the input dtype in registers and
//     feeds it straight back as the A operand of O += P.V (V through ldmatrix.trans).
//   * The row sum l accumulates the unrounded fp32 P.
//   * The epilogue normalises O, stages it through the warp's own slice of the
//     Q buffer and writes 16-byte vectors; LSE is m + log2(l) in log2 units.
//
#pragma once
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/fa2/fa2_epilogue.cuh"
#include "flashjit/fa2/fa2_fp8.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa2/fa2_softmax.cuh"
#include "flashjit/fa2/fa2_traits.cuh"
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/merge_states.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/fa2/fa2_kv_tma.cuh"
#include "flashjit/common/work.cuh"

namespace flashjit {


template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    fa2_attention_kernel(const __grid_constant__ FlashjitAttentionParams p,
                         const __grid_constant__ KvMapsArg<Traits::kTmaKv> tma_arg) {
  using T = typename Traits::DType;
  constexpr int D = Traits::kHeadDim, DV = Traits::kHeadDimVo, KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages;
  constexpr int THREADS = Traits::kThreads, ROWS = Traits::kRowsPerCta;
  constexpr int FM = Traits::kFragsM, WROWS = Traits::kRowsPerWarp;  // m16 fragments, rows per warp
  constexpr int ROW_BYTES = Traits::kRowBytes;  // a row's data
  constexpr int Q_PITCH = Traits::QLayout::kPitch;  // between rows of the Q tile
  constexpr bool kTma = Traits::kTmaKv;
  using QLayout = typename Traits::QLayout;
  using KvLayout = typename Traits::KvLayout;
  using VLayout = typename Traits::VLayout;
  constexpr int KV_PITCH = KvLayout::kPitch;  // between rows of a K tile
  constexpr int V_PITCH = VLayout::kPitch;    // ... and of a V tile
  constexpr int KSTEPS_QK = D / 16;    // k-steps of S = Q.K^T (head dims)
  constexpr int WKEYS = Traits::kKeysPerWarp;  // keys of each tile this warp computes
  constexpr int SKEYS = Traits::kKeysPerStep, SUB = Traits::kSubTiles;  // ... in SUB steps of SKEYS keys
  constexpr int KSTEPS_PV = SKEYS / 16;  // k-steps of O += P.V (keys)
  constexpr int NT_S = SKEYS / 8;        // n8 tiles of S
  constexpr int NT_O = DV / 8;          // n8 tiles of O
  constexpr bool kQInRegs = Traits::kQInRegs;
  // Two fragments with Q in shared memory (the d128 wide tiling): Q.K^T keeps a
  // two-deep K ring (below), which lets ldmatrix run ahead of the mma's there;
  // the other tilings run without it, as it slowed them.
  constexpr bool kWideQk = FM == 2 && !kQInRegs;
  // The d128 wide TMA kernel, whose loop sits at the register cap: its warp
  // index is known warp-uniform, a masked step reads its lane again, and its
  // K/V ldmatrix addresses are formed per tile (below). With the registers this
  // frees it runs faster; d256 (8 warps of one fragment, not at the cap) gained
  // nothing from these forms and keeps its own, as do the others (docs/fa2.md,
  // "Tilings and why").
  constexpr bool kLeanLoop = kTma && kWideQk;
  // The span of the Q, K and V copies (fa2::TileRows): one 16-byte chunk of
  // whole rows per thread, or, on the d128 wide tiling with a plain causal mask,
  // one chunk of each 128-byte line of its rows, so that a row costs one 64-bit
  // address (and one packed-row lookup for Q) and its lines sit at immediate
  // offsets. Lines speed up plain causal d128 only: paged decode and
  // non-causal d128 ran slower with them (HMMAs waited longer on their
  // ldmatrix, the L2 hit rate fell), and they spill with soft-cap or a window
  // (docs/fa2.md, "Tilings and why").
  constexpr bool kPlainCausal = Traits::kCausal && !Traits::kSoftCap && !Traits::kWindow;
  constexpr int kCopySpan = (kWideQk && kPlainCausal) ? 128 : ROW_BYTES;
  // An FP8 cache (fa2_fp8.cuh): rows of codes are copied as pairs of codes
  // (16-bit words, so the copies keep their 16-byte chunks and element
  // strides halve) into slots of StageLayout, one whole row a span.
  constexpr bool kFp8 = Traits::kKvFp8;
  using CopyT = std::conditional_t<kFp8, uint16_t, T>;
  constexpr int COPY_D = kFp8 ? D / 2 : D, KV_COPY_SPAN = kFp8 ? D : kCopySpan;
  // V rows, as wide as K's but for DeepSeek's 192 / 128 (then ragged, 16-bit, whole rows a span).
  constexpr int COPY_DV = kFp8 ? DV / 2 : DV, V_COPY_SPAN = DV == D ? KV_COPY_SPAN : DV * 2;
  constexpr int kStride = kFp8 ? 2 : 1;
  using StageLayout = typename Traits::KvStageLayout;
  using VStageLayout = typename Traits::VStageLayout;
  // Commit groups are [Q + K_0], [V_0], [K_1], [V_1], ...; see the main loop.
  // With kOneWait, wait_group(2S-4) at the top of tile t completes V_t as well.
  constexpr int kWaitK = 2 * STAGES - 3, kWaitV = 2 * STAGES - 2, kWaitKV = 2 * STAGES - 4;
  constexpr float kLog2e = 1.4426950408889634f;
  const float kNegInf = -CUDART_INF_F;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t q_smem = smem_addr(smem);
  // Stage s: K at kv_smem + s * kStageBytes, V after it; with TMA, the stages'
  // mbarriers after the last.
  const uint32_t kv_smem = kTma ? (q_smem + Traits::kQBytes + Traits::kKvAlign - 1) & ~uint32_t(Traits::kKvAlign - 1)
                                : q_smem + Traits::kQBytes;
  const uint32_t kv_bars = kv_smem + STAGES * Traits::kStageBytes;
  // FP8: the widened K and V tiles every warp's math reads.
  const uint32_t widened_k = kv_smem + STAGES * Traits::kStageBytes, widened_v = widened_k + Traits::kKvTileBytes;
  static_assert(!kTma || DV == D, "TMA rings hold K and V tiles of one width");

  const int tid = threadIdx.x, lane = tid % 32, warp = kLeanLoop ? fa2::warp_uniform(tid / 32) : tid / 32;
  if constexpr (kTma) {
    if (tid == 0) {  // the descriptors travel to the TMA unit while the work is decoded
      tma::prefetch_map(&tma_arg.maps.k);
      tma::prefetch_map(&tma_arg.maps.v);
    }
  }
  const CtaWork w = decode_work<Traits::kPaged>(p, ROWS);
  const int rows_total = w.qo_len * w.group;
  if (!w.valid || w.row_begin >= rows_total) return;  // uniform across the CTA
  const int offset = w.kv_len - w.qo_len;
  // Clamped so that q + offset - window_left cannot overflow int; any window
  // of 2^30 keys or more already covers every key.
  const int window_left = Traits::kWindow ? min(p.window_left, 1 << 30) : 0;
  const Mask<Traits::kCausal, Traits::kWindow> mask{offset, window_left};
  const auto custom = custom_mask_of<Traits::kCustomMask>(p, w);

  // Key range any row of the CTA can see, from a KEYS-aligned start, within
  // its split-KV chunk (whose bounds are multiples of KEYS).
  const int cta_q_first = w.row_begin / w.group;
  const int cta_q_last = (min(w.row_begin + ROWS, rows_total) - 1) / w.group;
  const int key_begin = max((mask.key_begin(cta_q_first) / KEYS) * KEYS, w.kv_begin);
  const int key_end = min(mask.key_end(cta_q_last, w.kv_len), w.kv_end);
  const int num_tiles = key_end > key_begin ? (key_end - key_begin + KEYS - 1) / KEYS : 0;

  // This warp's rows: warp_row0 .. warp_row0 + WROWS - 1 (fragment f: rows
  // 16f .. 16f + 15 of them); rows past the request are padding (zero Q,
  // clamped positions, never stored).
  const int warp_row0 = w.row_begin + (Traits::kSplitKeys ? 0 : warp * WROWS);
  const int warp_key0 = Traits::kSplitKeys ? warp * WKEYS : 0;  // this warp's keys within each tile
  const bool warp_active = warp_row0 < rows_total;
  const int wq_first = min(warp_row0, rows_total - 1) / w.group;
  const int wq_last = min(warp_row0 + WROWS - 1, rows_total - 1) / w.group;
  // This thread's rows are 16f + g and 16f + g + 8 of the warp. A key is
  // visible exactly as in Mask::visible: key < kv_len, key <= q + offset when
  // causal, key >= q + offset - window_left with a window. q + offset is
  // recomputed (one integer division per row) in the tiles that need the
  // element mask instead of being kept in registers across the loop: kFragsM = 2
  // sits at the 255-register cap and would otherwise spill on sm_80 / sm_89.

  // Logits leave the Q.K^T mma in natural units without sm_scale; the softmax
  // applies it, or the soft-cap cap * tanh(s * sm_scale / cap) in log2 units
  // (fa2_softmax.cuh).
  float o[FM][NT_O][4];
  fa2::WarpSoftmax<Traits> softmax;
  // An FP8 cache's k_scale multiplies every logit (keys are codes x k_scale).
  const float k_scale = kFp8 ? kv_scale_value(p.k_scale_ptr, p.k_scale) : 1.f;
  softmax.scale = Traits::kSoftCap ? 1.f : p.sm_scale * k_scale * kLog2e;
  softmax.cap_in = Traits::kSoftCap ? p.sm_scale * k_scale / p.logits_soft_cap : 0.f;
  softmax.cap_out = Traits::kSoftCap ? p.logits_soft_cap * kLog2e : 0.f;
#pragma unroll
  for (int f = 0; f < FM; ++f) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      softmax.m[f][r] = kNegInf;
      softmax.l[f][r] = 0.f;
    }
#pragma unroll
    for (int n = 0; n < NT_O; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[f][n][e] = 0.f;
  }

  if (num_tiles > 0) {
    // With TMA (fa2_kv_tma.cuh), thread 0 sets up the ring's barriers and
    // starts loading the first tiles before the Q copies.
    struct NoRing {};
    std::conditional_t<kTma, fa2::TmaKvRing<Traits>, NoRing> ring;
    if constexpr (kTma) {
      ring = {kv_smem, kv_bars, key_begin, num_tiles};
      if (tid == 0) {
        ring.init();
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
          if (s < num_tiles && ring.full(w, s)) ring.load(tma_arg.maps, w, s);
      }
    }
    const T* q_base = static_cast<const T*>(p.q);
    const auto k_rows = kv_rows<CopyT, Traits::kPaged>(p, w, p.k, p.k_stride_n / kStride, p.k_stride_h / kStride,
                                                       p.k_stride_page / kStride);
    const auto v_rows = kv_rows<CopyT, Traits::kPaged>(p, w, p.v, p.v_stride_n / kStride, p.v_stride_h / kStride,
                                                       p.v_stride_page / kStride);

    // ---- Q tile -> swizzled shared memory (first commit group: with K_0, or alone with TMA).
    fa2::copy_q_tile<QLayout, ROWS, D, THREADS, kCopySpan>(p, w, q_base, q_smem, rows_total, tid);

    // Who copies which K/V rows: all threads the whole tile, or, when warps
    // split the keys, each warp its own WKEYS rows. Then no warp reads rows
    // another copied, and the main loop needs no CTA barrier: warps drift
    // apart and keep more copies in flight.
    constexpr int LOAD_KEYS = Traits::kSplitKeys ? WKEYS : KEYS;
    constexpr int LOAD_THREADS = Traits::kSplitKeys ? 32 : THREADS;
    const int load_tid = Traits::kSplitKeys ? lane : tid;
    const uint32_t load_off = warp_key0 * StageLayout::kPitch;
    // Per-thread copy addresses computed once (fa2::RaggedTileCopy, fa2::PagedTileCopy).
    using Copy = std::conditional_t<
        Traits::kPaged, fa2::PagedTileCopy<CopyT, StageLayout, LOAD_KEYS, COPY_D, LOAD_THREADS, KV_COPY_SPAN>,
        fa2::RaggedTileCopy<CopyT, StageLayout, LOAD_KEYS, COPY_D, LOAD_THREADS, KV_COPY_SPAN>>;
    // Pages of this thread's rows of the next tile to issue (K and V share
    // them), looked up one tile ahead of the copy.
    int pages[Copy::R::kPerThread];
    // V's copies: the same as K's, or, at head_dim_vo < head_dim (ragged
    // only), copies of the narrower rows into V's part of the slot.
    using VCopy = std::conditional_t<DV == D, Copy,
                                     fa2::RaggedTileCopy<CopyT, VStageLayout, LOAD_KEYS, COPY_DV, LOAD_THREADS, V_COPY_SPAN>>;
    const Copy k_copy(k_rows, load_tid);
    const VCopy v_copy(v_rows, load_tid);
    auto lookup = [&](int tile) {
      if constexpr (Traits::kPaged) {
        if (tile < num_tiles) {
          const int k0 = key_begin + tile * KEYS + warp_key0;
          k_copy.lookup(pages, k0, min(LOAD_KEYS, w.kv_len - k0));
        }
      }
    };
    // Issues tile `tile`'s K (or V) into its ring slot and commits one group;
    // past the last tile it commits an empty group so the counts stay uniform.
    auto issue = [&](const auto& copy, const CopyT* fallback, int tile, uint32_t tile_off) {
      if (tile < num_tiles) {
        const int k0 = key_begin + tile * KEYS + warp_key0;
        const uint32_t dst = kv_smem + (tile % STAGES) * Traits::kStageBytes + tile_off + load_off;
        if constexpr (Traits::kPaged) {
          copy.issue(dst, pages, k0, min(LOAD_KEYS, w.kv_len - k0));
        } else {
          copy.issue(dst, k0, w.kv_len - k0, fallback);
        }
      }
      cp_async_commit();
    };
    auto issue_k = [&](int tile) { issue(k_copy, k_rows.base, tile, 0); };
    auto issue_v = [&](int tile) { issue(v_copy, v_rows.base, tile, Traits::kStageTileBytes); };
    // The barrier that makes a landed tile visible to the threads that read it.
    auto tile_barrier = [] {
      if constexpr (Traits::kSplitKeys) {
        __syncwarp();
      } else {
        __syncthreads();
      }
    };
    if constexpr (kTma) {
      cp_async_commit();  // Q alone
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s)
        if (s < num_tiles && !ring.full(w, s)) ring.template copy_partial<kCopySpan>(p, w, s);
      __syncthreads();  // thread 0 initialised the barriers before anyone waits on them
    } else {
#pragma unroll
      for (int s = 0; s < STAGES - 1; ++s) {
        lookup(s);
        issue_k(s);  // s == 0: this group also holds Q
        issue_v(s);
      }
      lookup(STAGES - 1);
    }

    // Per-lane ldmatrix offsets of the 16 columns 16i .. 16i + 15 (chunk pair i;
    // see fa2_primitives.cuh). A pattern: row lane % 16, chunk 2i + lane / 16.
    // B pattern: row 8 * (lane / 16) + lane % 8, chunk 2i + (lane / 8) % 2. In
    // both, row % 8 == lane % 8. The swizzle puts i % 4 only in bits 5-6 of the
    // offset ((2i + c) ^ r == (c ^ r) ^ 2i for c < 2) and i / 4 in whole 128-byte
    // blocks, so chunk pair i is the pair-0 offset with an XOR and an immediate
    // (SwizzledTile::pair): one register per pattern and layout, not four, which
    // two fragments at the register cap need. Q (row-major) and V (KvLayout)
    // take the A pattern, K the B pattern.
    const uint32_t a_off0 = QLayout::at(lane % 16, lane / 16, lane % 8);
    const uint32_t v_off0 = VLayout::at(lane % 16, lane / 16, lane % 8);
    const uint32_t b_off0 = KvLayout::at(8 * (lane / 16) + lane % 8, (lane / 8) % 2, lane % 8);
    // Shared-memory address of chunk pair i of the 16-row block at `rows`.
    auto a_at = [a_off0](uint32_t rows, int i) { return rows + QLayout::pair(a_off0, i); };
    auto v_at = [v_off0](uint32_t rows, int i) { return rows + VLayout::pair(v_off0, i); };
    auto b_at = [b_off0](uint32_t rows, int i) { return rows + KvLayout::pair(b_off0, i); };
    // kLeanLoop: the lane's K (V) address in a ring slot is formed once per tile,
    // k_lane = slot + b_off0, and chunk pair i taken from it by an XOR and an
    // immediate: the slots are 128-byte aligned, so the XOR still meets only
    // b_off0's bits. Otherwise ptxas keeps pair(b_off0, i) for i % 4 = 0..3 in
    // four registers across the loop.
    static_assert(Traits::kStageBytes % 128 == 0 && Traits::kKvTileBytes % 128 == 0 && KV_PITCH % 128 == 0 &&
                      Traits::kStageTileBytes % 128 == 0 && V_PITCH % 128 == 0,
                  "128-byte aligned slots and tile rows");
    // Fragment f of this warp's Q rows at + f * 16 * Q_PITCH.
    const uint32_t q_warp = q_smem + (Traits::kSplitKeys ? 0 : warp * WROWS * Q_PITCH);

    uint32_t q_frag[kQInRegs ? FM : 1][kQInRegs ? KSTEPS_QK : 1][4];
    if constexpr (kQInRegs || Traits::kSplitKeys) {
      if constexpr (kTma) {
        cp_async_wait<0>();  // Q landed for this thread ...
      } else {
        cp_async_wait<kWaitK>();  // [Q + K_0] landed for this thread ...
      }
      __syncthreads();          // ... and for every thread (Q rows come from all of them)
    }
    if constexpr (kQInRegs) {
#pragma unroll
      for (int f = 0; f < FM; ++f)
#pragma unroll
        for (int kk = 0; kk < KSTEPS_QK; ++kk)
          fa2::ldmatrix_x4(q_frag[f][kk], a_at(q_warp + f * 16 * Q_PITCH, kk));
    }

    // Warp-uniform, for the step of keys k0 .. k0 + SKEYS - 1: no key is visible
    // to any row of the warp (skip the math), or some key is invisible to some
    // row (apply the element mask).
    struct StepFlags {
      bool skip, mask;
    };
    auto step_flags = [&](int k0) {
      StepFlags f;
      f.skip = !warp_active || (Traits::kCausal && k0 > wq_last + offset) ||
               (Traits::kWindow && k0 + SKEYS - 1 < wq_first + offset - window_left);
      f.mask = (Traits::kCustomMask && k0 + SKEYS > custom.full_keys) || k0 + SKEYS > w.kv_len ||
               (Traits::kCausal && k0 + SKEYS - 1 > wq_first + offset) ||
               (Traits::kWindow && k0 < wq_last + offset - window_left);
      return f;
    };

    // S = Q.K^T for the step at row kofs of the K tile at k_s: fragment f, n-tile
    // j covers rows 16f .. 16f + 15, keys kofs + 8j .. + 7. Each K B-fragment is
    // loaded once and feeds FM mma's.
    auto compute_s = [&](float (&s)[FM][NT_S][4], uint32_t k_s, uint32_t k_lane, int kofs) {
#pragma unroll
      for (int f = 0; f < FM; ++f)
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[f][j][e] = 0.f;
      auto load_q = [&](uint32_t (&a)[FM][4], int kk) {
#pragma unroll
        for (int f = 0; f < FM; ++f) {
          if constexpr (kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[f][e] = q_frag[f][kk][e];
          } else {
            fa2::ldmatrix_x4(a[f], a_at(q_warp + f * 16 * Q_PITCH, kk));
          }
        }
      };
      // K rows kofs + 16jn .. + 15, head dims 16kk .. 16kk + 15.
      auto load_k = [&](uint32_t (&b)[4], int kk, int jn) {
        const uint32_t row_off = (kofs + jn * 16) * KV_PITCH;
        fa2::ldmatrix_x4(b, kLeanLoop ? KvLayout::pair(k_lane, kk) + row_off : b_at(k_s + row_off, kk));
      };
      // S n-tiles 2jn, 2jn + 1 of every fragment += A . B.
      auto mma_keys = [&](int jn, const uint32_t (&a)[FM][4], const uint32_t (&b)[4]) {
#pragma unroll
        for (int f = 0; f < FM; ++f) {
          fa2::mma_16816<T>(s[f][2 * jn], a[f], b[0], b[1]);
          fa2::mma_16816<T>(s[f][2 * jn + 1], a[f], b[2], b[3]);
        }
      };
      constexpr int NJ = SKEYS / 16;
      if constexpr (kWideQk) {
        // K B-fragments in a two-deep register ring: the ldmatrix of step i + 1
        // is issued before the mma's of step i, so that its latency hides
        // behind them (step i: k-step i / NJ, key block i % NJ). ptxas had kept
        // one K fragment at the register cap, and each group of four mma's
        // waited for its ldmatrix.
        constexpr int NSTEPS = KSTEPS_QK * NJ;
        uint32_t b[2][4], a[FM][4];
        load_k(b[0], 0, 0);
#pragma unroll
        for (int i = 0; i < NSTEPS; ++i) {
          if (i % NJ == 0) load_q(a, i / NJ);
          if (i + 1 < NSTEPS) load_k(b[(i + 1) % 2], (i + 1) / NJ, (i + 1) % NJ);
          mma_keys(i % NJ, a, b[i % 2]);
        }
      } else {
        // Each K fragment loaded just before its mma's.
#pragma unroll
        for (int kk = 0; kk < KSTEPS_QK; ++kk) {
          uint32_t a[FM][4];
          load_q(a, kk);
#pragma unroll
          for (int jn = 0; jn < NJ; ++jn) {
            uint32_t b[4];
            load_k(b, kk, jn);
            mma_keys(jn, a, b);
          }
        }
      }
    };

    // Element mask of fragment f's S for the step of keys from k0: s[j][e] is
    // row 16f + g + 8 * (e / 2), key k0 + 8j + 2 * tq + e % 2 (g = lane / 4,
    // tq = lane % 4).
    auto mask_fragment = [&](float (&sf)[NT_S][4], int f, int k0) {
      const int mask_lane = kLeanLoop ? fa2::lane_id() : lane;
      const int g = mask_lane / 4, tq = mask_lane % 4;
      int q_off[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) q_off[r] = min(warp_row0 + 16 * f + g + 8 * r, rows_total - 1) / w.group + offset;
#pragma unroll
      for (int j = 0; j < NT_S; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + 8 * j + 2 * tq + (e & 1);
          const int qo = q_off[e >> 1];
          bool hidden = key >= w.kv_len || (Traits::kCausal && key > qo) || (Traits::kWindow && key < qo - window_left);
          if constexpr (Traits::kCustomMask) hidden = hidden || !custom.visible(qo - offset, key);
          if (hidden) sf[j][e] = kNegInf;
        }
    };

    // O += P.V for the step at row kofs of the V tile at v_s: n-tiles 2dn, 2dn+1
    // cover head dims 16dn .. 16dn+15; each V B-fragment is loaded once and feeds
    // FM mma's.
    auto accumulate_pv = [&](const uint32_t (&pa)[FM][KSTEPS_PV][4], uint32_t v_s, uint32_t v_lane, int kofs) {
#pragma unroll
      for (int kk = 0; kk < KSTEPS_PV; ++kk) {
#pragma unroll
        for (int dn = 0; dn < DV / 16; ++dn) {
          uint32_t b[4];
          const uint32_t row_off = (kofs + kk * 16) * V_PITCH;
          fa2::ldmatrix_x4_trans(b, kLeanLoop ? VLayout::pair(v_lane, dn) + row_off : v_at(v_s + row_off, dn));
#pragma unroll
          for (int f = 0; f < FM; ++f) {
            fa2::mma_16816<T>(o[f][2 * dn], pa[f][kk], b[0], b[1]);
            fa2::mma_16816<T>(o[f][2 * dn + 1], pa[f][kk], b[2], b[3]);
          }
        }
      }
    };

    // ---- Main loop. Iteration t consumes ring slot t % STAGES. Before it, the
    // committed groups are [Q+K_0], [V_0], ..., [K_{t+S-2}], [V_{t+S-2}] (S =
    // STAGES): 2S-3 groups follow K_t, so wait_group(2S-3) completes K_t. The
    // barrier after it also proves every warp (with split keys: every lane of
    // this warp, the only reader of its rows) finished tile t-1, whose slot
    // (t-1) % S == (t+S-1) % S then receives tile t+S-1 ([K], [V]: two more
    // groups). 2S-2 groups then follow V_t: wait_group(2S-2) before P.V. With
    // kOneWait, wait_group(2S-4) before that barrier completes V_t too, and P.V
    // needs no second wait or barrier.
    // (Unrolled by its stages, so that ring-slot offsets are immediates, this
    // loop ran no faster once the softmax was one basic block.)
    for (int t = 0; t < num_tiles; ++t) {
      const uint32_t slot = kv_smem + (t % STAGES) * Traits::kStageBytes;
      const uint32_t k_s = kFp8 ? widened_k : slot, v_s = kFp8 ? widened_v : slot + Traits::kStageTileBytes;
      const uint32_t k_lane = kLeanLoop ? fa2::opaque(k_s + b_off0) : 0, v_lane = kLeanLoop ? fa2::opaque(v_s + v_off0) : 0;
      const int t0 = key_begin + t * KEYS;

      if constexpr (kTma) {
        ring.wait(w, t);
        if (t == 0) cp_async_wait<0>();  // Q
        if constexpr (Traits::kSlotRelease) {
          // Warps release slots through mbarriers (fa2_kv_tma.cuh): only Q's
          // rows (tile 0) and a partial tile's rows need a CTA barrier.
          if (t == 0 || !ring.full(w, t)) __syncthreads();
        } else {
          tile_barrier();
        }
        ring.template issue<kCopySpan>(p, tma_arg.maps, w, t + STAGES - 1);
      } else {
        if constexpr (Traits::kOneWait || kFp8) {
          cp_async_wait<kWaitKV>();
        } else {
          cp_async_wait<kWaitK>();
        }
        tile_barrier();
        issue_k(t + STAGES - 1);
        issue_v(t + STAGES - 1);
        lookup(t + STAGES);
        if constexpr (kFp8) {
          // Tile t's codes -> the widened K/V pair: the barrier above proved
          // every reader done with tile t - 1's; with split keys each warp
          // widens its own rows.
          constexpr int WIDEN_ROWS = Traits::kSplitKeys ? WKEYS : KEYS;
          const uint32_t rows_off = warp_key0 * KV_PITCH;
          fa2::widen_fp8_tile<typename Traits::KvType, T, KvLayout, WIDEN_ROWS, D, LOAD_THREADS>(
              slot + load_off, widened_k + rows_off, load_tid);
          fa2::widen_fp8_tile<typename Traits::KvType, T, KvLayout, WIDEN_ROWS, D, LOAD_THREADS>(
              slot + Traits::kStageTileBytes + load_off, widened_v + rows_off, load_tid);
          tile_barrier();
        }
      }

#pragma unroll
      for (int h = 0; h < SUB; ++h) {
        const int kofs = warp_key0 + h * SKEYS;  // this step's first key within the tile
        const StepFlags step = step_flags(t0 + kofs);
        uint32_t pa[FM][KSTEPS_PV][4];  // P in T, A-operand layout, per m16 fragment
        float s[FM][NT_S][4];
        if (!step.skip) {
          compute_s(s, k_s, k_lane, kofs);
          softmax.update_max(s, o, t0 + kofs, step.mask, t == 0 && h == 0, mask_fragment);
#pragma unroll
          for (int f = 0; f < FM; ++f) softmax.exp_to_p(s, pa, f);
        }
        if (!Traits::kOneWait && !kTma && !kFp8 && h == 0) {  // V of the whole tile, before the first step's P.V
          cp_async_wait<kWaitV>();
          tile_barrier();
        }
        // The d128 wide tiling sits at the register cap: without this fence
        // ptxas moves the second fragment's exponentials into P.V, which leaves
        // registers for one V fragment at a time, and each mma then waits for
        // its ldmatrix. Where there is room (two d64 fragments, Q in registers,
        // one wait per tile), that interleave is what keeps the tensor pipe
        // busy (the d64 wide tiling runs unfenced; docs/fa2.md, "Tilings and why").
        if constexpr (Traits::kFencePv) __syncwarp();
        if (!step.skip) accumulate_pv(pa, v_s, v_lane, kofs);
      }  // steps
      if constexpr (Traits::kSlotRelease) ring.release(t);
    }
    // Every group still pending is empty (tiles past num_tiles), and the warp's
    // own Q rows are only ever read by this warp: no CTA barrier needed below.
  }

  if constexpr (kFp8) {  // v_scale: values are codes x v_scale, and O is linear in them
    const float v_scale = kv_scale_value(p.v_scale_ptr, p.v_scale);
#pragma unroll
    for (int f = 0; f < FM; ++f)
#pragma unroll
      for (int n = 0; n < NT_O; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[f][n][e] *= v_scale;
  }
  if constexpr (Traits::kSplitKeys) {
    if (!fa2::merge_warp_states<Traits>(o, softmax.m, softmax.l, smem, softmax.scale)) return;
  }
  fa2::store_rows<Traits>(p, w, o, softmax.m, softmax.l, smem, warp_row0, rows_total, softmax.scale);
}

}  // namespace flashjit
