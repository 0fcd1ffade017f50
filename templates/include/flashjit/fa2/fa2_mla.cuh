// MLA (DeepSeek latent attention) on mma.sync tensor cores, fp16 / bf16, paged.
// An MLA batch is MQA with one KV head: a CTA's 16 packed rows are (query
// token x head) pairs of one request (row r: token r / num_heads, head
// r % num_heads), keys are [ckv | kpe] (576 wide) and values ckv (512 wide);
// logits = sm_scale * (q_nope.ckv + q_pe.kpe), o = softmax . ckv.
//
// A warp cannot hold 16 rows x 512 fp32 columns of O (256 registers per lane),
// so the four warps share the rows and split the work differently per product:
//   * S = Q.K^T: warp w multiplies the k-steps w, w + 4, ... (144 of the 576
//     dims) of every key of the tile, from its Q fragments held in registers;
//     the partial logits meet in shared memory and every warp sums all four in
//     the same order, so every warp holds the same S, bit for bit;
//   * every warp runs the same online softmax on it (fa2::WarpSoftmax), so the
//     running max and row sums agree across warps without further exchange,
//     and rounds P to the input dtype in registers as fa2 does;
//   * O += P.V: warp w owns output columns [128 w, 128 w + 128), its V
//     fragments read by ldmatrix.trans from the ckv part of the same tile.
// One tile of keys lives in shared memory once and serves as K and as V. Tiles
// stream through a kStages-deep cp.async ring from the pages (any page size,
// pages in any order; a key's page looked up a tile ahead of its copy).
// Barriers per tile: one after the tile lands (it also proves every warp done
// with the previous tile, its slot and the exchange), one after the partial
// logits are written. An FP8 cache (Traits::kKvFp8) lands as codes; after the
// first barrier each thread widens the chunks it copied into the one 16-bit
// tile that S and P.V read, and a third barrier publishes it; its scales are
// applied as fa2_mla_fp8.cuh says.
#pragma once
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/merge_states.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_column_split_common.cuh"
#include "flashjit/fa2/fa2_epilogue.cuh"
#include "flashjit/fa2/fa2_mla_fp8.cuh"
#include "flashjit/fa2/fa2_mla_traits.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa2/fa2_mla_primitives.cuh"
#include "flashjit/fa2/fa2_softmax.cuh"

namespace flashjit {
namespace fa2 {

// One thread's copies of a tile of keys: kThreadsPerKey threads per key, thread
// `sub` of a key copying chunks sub, sub + kThreadsPerKey, ... of its [ckv | kpe]
// row (a warp's copy instruction reads 64 contiguous bytes of 8 keys). An FP8
// cache's rows land unswizzled, and widen() makes them the 16-bit tile's rows.
template <class Traits>
struct MlaTileCopy : MlaCacheRows<typename Traits::KvType> {
  using Rows = MlaCacheRows<typename Traits::KvType>;
  using Rows::ckv, Rows::pages, Rows::page_div;
  static constexpr int kTpk = Traits::kThreadsPerKey, kPer = Traits::kKvChunksPerThread;
  static constexpr int kCkvPer = Traits::kKvCkvChunks / kTpk;  // of a thread's chunks, those in ckv
  int key, sub;  // this thread's key within a tile, its chunk phase

  __device__ __forceinline__ MlaTileCopy(const FlashjitAttentionParams& p, const CtaWork& w, int tid)
      : Rows(p, w, (tid % kTpk) * 16), key(tid / kTpk), sub(tid % kTpk) {}

  // The page of this thread's key in the tile at `first` (0 past `valid` keys).
  __device__ __forceinline__ int lookup(int first, int valid) const {
    return key < valid ? pages[page_div.div(first + key)] : 0;
  }

  // Copies this thread's chunks of the tile at `first` into `dst`; keys at or
  // past `valid` are zero-filled, reading nothing.
  __device__ __forceinline__ void issue(uint32_t dst, int page, int first, int valid) const {
    const int k = first + key;
    const bool ok = key < valid;
    const char *c_src, *k_src;
    Rows::row(uint32_t(page), uint32_t(page_div.mod(k, page_div.div(k))), c_src, k_src);
    const uint32_t row = dst + key * Traits::kKvRowBytes;
    const int r7 = key & 7;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int c = sub + kTpk * i;  // the XOR meets only the low 3 bits: c stays in its 128-byte block
      const char* src = i < kCkvPer ? c_src + i * kTpk * 16 : k_src + (i - kCkvPer) * kTpk * 16;
      cp_async_16(row + (Traits::kKvFp8 ? c << 4 : (c ^ r7) << 4), ok ? src : ckv, ok);
    }
  }

  // An FP8 cache: this thread's chunks of the code tile at `codes` (copied by
  // issue(), landed) widened into its key's row of the 16-bit tile at `dst`.
  __device__ __forceinline__ void widen(uint32_t codes, uint32_t dst) const {
    widen_mla_chunks<Traits, kPer, kTpk>(codes + key * Traits::kKvRowBytes, dst, key, sub);
  }
};

// The kStages-deep cp.async ring both fa2 MLA kernels stream their tiles of
// keys through. A key's page is looked up a tile ahead of its copy, so that
// the page-table load is not waited for between a barrier and the copies.
// Every tile commits one group, empty past the last, so that the counts stay
// uniform and wait_group(kStages - 2) before tile t always completes tile t.
template <class Traits>
struct MlaTileRing {
  const MlaTileCopy<Traits> copy;
  const uint32_t kv_smem;
  const int key_begin, num_tiles, kv_len;
  int page = 0;  // of this thread's key in the next tile to issue

  __device__ __forceinline__ MlaTileRing(const FlashjitAttentionParams& p, const CtaWork& w, int tid,
                                         uint32_t kv_smem_, int key_begin_, int num_tiles_)
      : copy(p, w, tid), kv_smem(kv_smem_), key_begin(key_begin_), num_tiles(num_tiles_), kv_len(w.kv_len) {}

  __device__ __forceinline__ uint32_t slot(int tile) const {
    return kv_smem + (tile % Traits::kStages) * Traits::kStageBytes;
  }
  __device__ __forceinline__ void lookup(int tile) {
    if (tile < num_tiles) {
      const int k0 = key_begin + tile * Traits::kKeysPerTile;
      page = copy.lookup(k0, min(Traits::kKeysPerTile, kv_len - k0));
    }
  }
  __device__ __forceinline__ void issue(int tile) {
    if (tile < num_tiles) {
      const int k0 = key_begin + tile * Traits::kKeysPerTile;
      copy.issue(slot(tile), page, k0, min(Traits::kKeysPerTile, kv_len - k0));
    }
    cp_async_commit();
  }
  // Tiles 0 .. kStages - 2 in flight, the next one's page looked up.
  __device__ __forceinline__ void fill() {
#pragma unroll
    for (int s = 0; s < Traits::kStages - 1; ++s) {
      lookup(s);
      issue(s);
    }
    lookup(Traits::kStages - 1);
  }
  // Once tile t has landed and every warp is done with tile t - 1: its slot
  // takes tile t + kStages - 1.
  __device__ __forceinline__ void refill_after(int t) {
    issue(t + Traits::kStages - 1);
    lookup(t + Traits::kStages);
  }
};

}  // namespace fa2

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    fa2_mla_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  using T = typename Traits::DType;
  using L = typename Traits::Layout;
  using SoftmaxTraits = typename Traits::Softmax;
  constexpr int KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages, ROW_BYTES = Traits::kRowBytes;
  constexpr int ROWS = Traits::kRowsPerCta, WARPS = Traits::kWarps;
  constexpr int NT_S = KEYS / 8;                       // n8 tiles of S (the whole tile's keys)
  constexpr int NT_O = Traits::kVoColsPerWarp / 8;     // n8 tiles of this warp's O columns
  constexpr int KSTEPS_PV = KEYS / 16;
  constexpr int QK_STEPS = Traits::kQkStepsPerWarp;
  static_assert(!Traits::kKvFp8 || (QK_STEPS - 1) * WARPS == Traits::kCkvDim / 16,
                "an FP8 cache's ratio goes between a warp's ckv k-steps and its one kpe k-step");
  constexpr float kLog2e = 1.4426950408889634f;
  const float kNegInf = -CUDART_INF_F;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t q_smem = smem_addr(smem);
  const uint32_t kv_smem = q_smem + Traits::kHeadBytes;
  float* xchg = reinterpret_cast<float*>(smem);  // over Q, once Q is in registers

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, tq = lane % 4;
  const CtaWork w = decode_work<true>(p, ROWS);
  const int rows_total = w.qo_len * w.group;
  if (!w.valid || w.row_begin >= rows_total) return;  // uniform across the CTA
  const fa2::MlaCtaKeys<Traits::kCausal, ROWS, KEYS> keys(w, rows_total);
  const int key_begin = keys.key_begin, num_tiles = keys.num_tiles;

  float o[1][NT_O][4];
  fa2::WarpSoftmax<SoftmaxTraits> softmax;
  const fa2::MlaScales<Traits::kKvFp8> scales(p, kLog2e);  // an FP8 cache's (fa2_mla_fp8.cuh)
  const float ckv_ratio = scales.ckv_ratio, out_scale = scales.out;
  softmax.scale = scales.softmax;
  softmax.cap_in = 0.f;
  softmax.cap_out = 0.f;
  fa2::start_rows(softmax, o[0]);

  if (num_tiles > 0) {
    fa2::copy_mla_q<Traits, L, Traits::kThreads, 3>(p, w, q_smem, rows_total, tid);
    // Groups: [Q + tile 0], [tile 1], ..., [tile S-2].
    fa2::MlaTileRing<Traits> ring(p, w, tid, kv_smem, key_begin, num_tiles);
    ring.fill();

    // Lane offsets (fa2_primitives.cuh): A pattern for Q and for V
    // (ldmatrix.trans), B pattern for K. This warp's k-steps are warp + 4 i, at
    // swizzle phase `warp` and block i: one XOR here, then + i * 128 per step.
    // Its O columns start at block 2 * warp (the XOR leaves the block bits alone).
    const uint32_t a_off0 = L::at(lane % 16, lane / 16, lane % 8);
    const uint32_t b_off0 = L::at(8 * (lane / 16) + lane % 8, (lane / 8) % 2, lane % 8);
    const uint32_t a_warp = a_off0 ^ (uint32_t(warp) << 5);
    const uint32_t b_warp = b_off0 ^ (uint32_t(warp) << 5);
    const uint32_t v_warp = a_off0 + L::block(2 * warp);

    uint32_t q_frag[QK_STEPS][4];
    cp_async_wait<STAGES - 2>();  // [Q + tile 0] landed for this thread ...
    __syncthreads();              // ... and for all (Q rows come from every thread)
#pragma unroll
    for (int i = 0; i < QK_STEPS; ++i) fa2::ldmatrix_x4(q_frag[i], q_smem + a_warp + L::block(i));

    // Element mask of S for the tile at k0: s[j][e] is row g + 8 (e / 2) of the
    // CTA, key k0 + 8 j + 2 tq + e % 2.
    auto mask_tile = [&](float (&sf)[NT_S][4], int, int k0) {
      int q_off[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) q_off[r] = keys.query_pos(w, rows_total, g + 8 * r);
      fa2::mask_mla_fragment<Traits::kCausal>(sf, k0, tq, w.kv_len, q_off);
    };

    for (int t = 0; t < num_tiles; ++t) {
      const uint32_t tile_s = ring.slot(t);
      const int t0 = key_begin + t * KEYS;
      cp_async_wait<STAGES - 2>();
      // Tile t landed for every thread; every warp is done with tile t - 1 (its
      // ring slot, refilled next) and with the exchange it read.
      __syncthreads();
      ring.refill_after(t);
      uint32_t tile_k = tile_s;  // K and V: the ring slot, or an FP8 cache's widened tile
      if constexpr (Traits::kKvFp8) {
        tile_k = q_smem + Traits::kWidenedOffset;
        ring.copy.widen(tile_s, tile_k);
        __syncthreads();  // every row widened
      }

      // This warp's share of S: k-steps warp + 4 i of every key of the tile
      // (an FP8 cache: the ckv part x ckv_ratio before the last, kpe, step).
      float s[1][NT_S][4];
#pragma unroll
      for (int j = 0; j < NT_S; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][j][e] = 0.f;
#pragma unroll
      for (int i = 0; i < QK_STEPS; ++i) {
        if constexpr (Traits::kKvFp8) {
          if (i == QK_STEPS - 1) fa2::scale_ckv_part(s[0], ckv_ratio);
        }
        fa2::mma_qk_step_over_tile<T, KEYS, ROW_BYTES>(s[0], q_frag[i], tile_k, b_warp, L::block(i));
      }
      fa2::sum_logits_across_warps<WARPS, Traits::kXchgFloatsPerWarp>(s[0], xchg, warp, lane);

      const bool need_mask = keys.needs_mask(t0, KEYS, w.kv_len);
      uint32_t pa[1][KSTEPS_PV][4];
      softmax.update_max(s, o, t0, need_mask, t == 0, mask_tile);
      softmax.exp_to_p(s, pa, 0);

      // O[:, 128 warp ...] += P . V, V = the ckv part of the tile.
#pragma unroll
      for (int kk = 0; kk < KSTEPS_PV; ++kk)
#pragma unroll
        for (int dn = 0; dn < NT_O / 2; ++dn) {
          uint32_t b[4];
          fa2::ldmatrix_x4_trans(b, tile_k + kk * 16 * ROW_BYTES + L::pair(v_warp, dn));
          fa2::mma_16816<T>(o[0][2 * dn], pa[0][kk], b[0], b[1]);
          fa2::mma_16816<T>(o[0][2 * dn + 1], pa[0][kk], b[2], b[3]);
        }
    }
    cp_async_wait<0>();  // only empty groups can still be pending
  }

  // Epilogue: every warp holds the same m and l; it writes its own columns.
  float inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    softmax.l[0][r] += __shfl_xor_sync(0xffffffffu, softmax.l[0][r], 1);
    softmax.l[0][r] += __shfl_xor_sync(0xffffffffu, softmax.l[0][r], 2);
    // A row that sees no key (kv_len 0, or fully masked) outputs 0, LSE -inf.
    inv_l[r] = softmax.l[0][r] > 0.f ? 1.f / softmax.l[0][r] : 0.f;
    if constexpr (Traits::kKvFp8) inv_l[r] *= out_scale;  // V is ckv: codes x ckv_scale
  }
  auto lse_of = [&](int r) {
    return softmax.l[0][r] > 0.f ? __fadd_rn(__fmul_rn(softmax.m[0][r], softmax.scale), log2f(softmax.l[0][r]))
                                 : kNegInf;  // roundings spelled out: see fa2_softmax.cuh
  };
  const auto packed = w.packed_rows();
  const int col0 = warp * Traits::kVoColsPerWarp + 2 * tq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = w.row_begin + g + 8 * r;
    if (row >= rows_total) continue;
    int token, head;
    packed.locate(row, token, head);
    fa2::store_mla_row<T, Traits::kVoDim, Traits::kLse>(p, w, token, head, o[0], r, inv_l[r], lse_of(r), col0,
                                                        warp == 0 && tq == 0);
  }
}

template <class Traits>
int launch_fa2_mla(const FlashjitAttentionParams& p, cudaStream_t stream) {
  return launch_attention<fa2_mla_kernel<Traits>, typename Traits::DType, Traits::kVoDim, Traits::kLse>(
      p, Traits::kThreads, static_cast<int>(Traits::kSmemBytes), stream);
}

template <class Traits>
int fa2_mla_ctas_per_sm() {
  return ctas_per_sm<fa2_mla_kernel<Traits>>(Traits::kThreads, static_cast<int>(Traits::kSmemBytes));
}

}  // namespace flashjit
