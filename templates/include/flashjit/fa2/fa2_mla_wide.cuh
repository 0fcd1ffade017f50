// The fa2 MLA kernel for large head counts (MlaWideTraits): 64 packed rows per
// CTA, eight warps, one CTA per SM. fa2_mla.cuh's 16-row CTAs read each tile of
// keys once per 16 rows (eight CTAs per request with 128 heads, each streaming
// all of its keys through L2 and shared memory) and exchange fp32 partial
// logits between their warps; here a tile serves 64 rows:
//   * S = Q.K^T: warp (rg = w % 4, part = w / 4) takes rows 16 rg .. + 15 and
//     keys 32 part .. + 31 of the 64-key tile over all 576 dims, its Q
//     fragments read from shared memory each k-step (16 rows x 576 dims do not
//     fit a warp's registers beside O);
//   * the two warps of a row group trade their row maxima through shared
//     memory at a named barrier (64 threads), take the same new max (the same
//     lazy max as fa2::WarpSoftmax: a row moves only when it grew by more than
//     2^8), each keeps the row sums of its own keys, and each writes its P,
//     rounded to the input dtype, to a 64 x 64 tile in shared memory; the
//     rescale factor of every row goes there too;
//   * O += P.V: warp w owns output columns [64 w, 64 w + 64) of all 64 rows
//     (four m16 fragments, 128 fp32 registers): each V fragment read by
//     ldmatrix.trans feeds four mma's (one per 16 rows), each P fragment eight.
// Barriers per tile: the tile landed (every warp is also done with the previous
// tile's slot, P and factors), the row-group pair's maxima, P written; an FP8
// cache (Traits::kKvFp8) one more, after each thread has widened the chunks it
// copied into the 16-bit tile S and P.V read (fa2_mla_fp8.cuh).
#pragma once
#include "flashjit/fa2/fa2_mla.cuh"

namespace flashjit {
namespace fa2 {
// bar.sync on barrier `id` (1..15) for `threads` threads of the CTA.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
}  // namespace fa2

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fa2_mla_wide_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  using T = typename Traits::DType;
  using L = typename Traits::Layout;
  using PL = typename Traits::PLayout;
  constexpr int KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages, ROW_BYTES = Traits::kRowBytes;
  constexpr int ROWS = Traits::kRowsPerCta, PARTS = Traits::kKeyParts, WKEYS = Traits::kKeysPerWarp;
  constexpr int FM = ROWS / 16;                    // m16 fragments of O per warp
  constexpr int NT_S = WKEYS / 8;                  // n8 tiles of this warp's S
  constexpr int NT_O = Traits::kVoColsPerWarp / 8; // n8 tiles of this warp's O columns
  constexpr int KSTEPS_PV = KEYS / 16;
  constexpr float kLog2e = 1.4426950408889634f, kLazyLog2 = 8.f;
  const float kNegInf = -CUDART_INF_F;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t q_smem = smem_addr(smem);
  const uint32_t kv_smem = q_smem + Traits::kQBytes;
  const uint32_t p_smem = q_smem + Traits::kPOffset;
  float* xmax = reinterpret_cast<float*>(smem + Traits::kMaxOffset);    // [part][row]
  float* xscale = reinterpret_cast<float*>(smem + Traits::kScaleOffset);  // [row]
  int* xmoved = reinterpret_cast<int*>(smem + Traits::kMovedOffset);      // [row group]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, tq = lane % 4;
  const int rg = warp % Traits::kRowGroups, part = warp / Traits::kRowGroups;
  const CtaWork w = decode_work<true>(p, ROWS);
  const int rows_total = w.qo_len * w.group;
  if (!w.valid || w.row_begin >= rows_total) return;  // uniform across the CTA
  const fa2::MlaCtaKeys<Traits::kCausal, ROWS, KEYS> keys(w, rows_total);
  const int key_begin = keys.key_begin, num_tiles = keys.num_tiles;
  const fa2::MlaScales<Traits::kKvFp8> scales(p, kLog2e);  // with an FP8 cache's scales
  const float scale = scales.softmax, ckv_ratio = scales.ckv_ratio, out_scale = scales.out;

  // Softmax state of this warp's rows 16 rg + g (+ 8): the max (shared by the
  // row group's two warps) and the sums over this warp's keys (lane partials).
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  float o[FM][NT_O][4];
#pragma unroll
  for (int f = 0; f < FM; ++f)
#pragma unroll
    for (int n = 0; n < NT_O; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[f][n][e] = 0.f;

  if (num_tiles > 0) {
    fa2::copy_mla_q<Traits, L, Traits::kThreads, 2>(p, w, q_smem, rows_total, tid);
    fa2::MlaTileRing<Traits> ring(p, w, tid, kv_smem, key_begin, num_tiles);
    ring.fill();

    // A pattern (Q, P; V by ldmatrix.trans) and B pattern (K) lane offsets.
    const uint32_t a_off0 = L::at(lane % 16, lane / 16, lane % 8);
    const uint32_t b_off0 = L::at(8 * (lane / 16) + lane % 8, (lane / 8) % 2, lane % 8);
    const uint32_t q_warp = q_smem + 16 * rg * ROW_BYTES;
    const uint32_t v_warp = a_off0 + L::block(warp * Traits::kVoColsPerWarp / 64);
    const uint32_t p_off0 = PL::at(lane % 16, lane / 16, lane % 8);
    // Where this lane's P values go: row 16 rg + g + 8 h, chunk (keys) 4 part + j.
    const uint32_t p_store = Traits::kPOffset + 16 * rg * PL::kPitch + 4 * tq;
    int q_off[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) q_off[r] = keys.query_pos(w, rows_total, 16 * rg + g + 8 * r);

    cp_async_wait<STAGES - 2>();
    __syncthreads();

    for (int t = 0; t < num_tiles; ++t) {
      const uint32_t tile_s = ring.slot(t);
      const int t0 = key_begin + t * KEYS;
      cp_async_wait<STAGES - 2>();
      // Tile t landed; every warp is done with tile t - 1, its P and factors.
      __syncthreads();
      ring.refill_after(t);
      uint32_t tile_k = tile_s;  // K and V: the ring slot, or an FP8 cache's widened tile
      if constexpr (Traits::kKvFp8) {
        tile_k = q_smem + Traits::kWidenedOffset;
        ring.copy.widen(tile_s, tile_k);
        __syncthreads();  // every row widened
      }

      float s[NT_S][4];
#pragma unroll
      for (int j = 0; j < NT_S; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
      const uint32_t k_warp = tile_k + part * WKEYS * ROW_BYTES;
#pragma unroll
      for (int i = 0; i < Traits::kQkSteps; ++i) {
        if constexpr (Traits::kKvFp8) {
          if (i == Traits::kCkvDim / 16) fa2::scale_ckv_part(s, ckv_ratio);  // the ckv part, before kpe's steps
        }
        uint32_t a[4];
        fa2::ldmatrix_x4(a, q_warp + L::pair(a_off0, i));
#pragma unroll
        for (int jn = 0; jn < WKEYS / 16; ++jn) {
          uint32_t b[4];
          fa2::ldmatrix_x4(b, k_warp + jn * 16 * ROW_BYTES + L::pair(b_off0, i));
          fa2::mma_16816<T>(s[2 * jn], a, b[0], b[1]);
          fa2::mma_16816<T>(s[2 * jn + 1], a, b[2], b[3]);
        }
      }

      // s[j][e]: row 16 rg + g + 8 (e / 2), key t0 + WKEYS part + 8 j + 2 tq + e % 2.
      const int k0 = t0 + part * WKEYS;
      if (keys.needs_mask(k0, WKEYS, w.kv_len))
        fa2::mask_mla_fragment<Traits::kCausal>(s, k0, tq, w.kv_len, q_off);
      float mx[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[r] = fa2::row_max<NT_S>(s, r);
      fa2::quad_max(mx);
      if (tq == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) xmax[part * ROWS + 16 * rg + g + 8 * r] = mx[r];
      }
      fa2::named_barrier_sync(1 + rg, 32 * PARTS);
      // The tile's max over both parts (the same in both warps: fmaxf is exact),
      // and the lazy max's decision, as fa2::WarpSoftmax (fa2_softmax.cuh).
      bool moves[2];
      float rescale[2], m_ref[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * rg + g + 8 * r;
        float tile_max = mx[r];
#pragma unroll
        for (int v = 0; v < PARTS; ++v)
          if (v != part) tile_max = fmaxf(tile_max, xmax[v * ROWS + row]);
        const float mn = fmaxf(m[r], tile_max);
        moves[r] = (mn - m[r]) * scale > kLazyLog2;  // NaN (both -inf) compares false
        const float ref = mn == kNegInf ? 0.f : __fmul_rn(mn, scale);
        rescale[r] = moves[r] ? fa2::exp2_fast(__fsub_rn(__fmul_rn(m[r], scale), ref)) : 1.f;
        if (moves[r]) m[r] = mn;
        l[r] = __fmul_rn(l[r], rescale[r]);
        m_ref[r] = m[r] == kNegInf ? 0.f : __fmul_rn(m[r], scale);
      }
      const bool any = __any_sync(0xffffffffu, moves[0] || moves[1]);
      if (part == 0) {
        if (tq == 0) {
#pragma unroll
          for (int r = 0; r < 2; ++r) xscale[16 * rg + g + 8 * r] = rescale[r];
        }
        if (lane == 0) xmoved[rg] = any;
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        fa2::exp2_row<NT_S>(s, r, scale, m_ref[r]);
        l[r] = __fadd_rn(l[r], fa2::row_sum<NT_S>(s, r));  // unrounded fp32 P
      }
#pragma unroll
      for (int j = 0; j < NT_S; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<uint32_t*>(smem + p_store + PL::at(g + 8 * r, part * NT_S + j, g)) =
              fa2::pack2<T>(s[j][2 * r], s[j][2 * r + 1]);
      __syncthreads();  // P and the factors of every row written

#pragma unroll
      for (int f = 0; f < FM; ++f) {
        if (xmoved[f]) {
          const float r0 = xscale[16 * f + g], r1 = xscale[16 * f + g + 8];
#pragma unroll
          for (int n = 0; n < NT_O; ++n) {
            o[f][n][0] *= r0;
            o[f][n][1] *= r0;
            o[f][n][2] *= r1;
            o[f][n][3] *= r1;
          }
        }
      }
      // O[:, 64 warp ...] += P . V over the tile's 64 keys, V = its ckv part.
#pragma unroll
      for (int kk = 0; kk < KSTEPS_PV; ++kk) {
        uint32_t pa[FM][4];
#pragma unroll
        for (int f = 0; f < FM; ++f) fa2::ldmatrix_x4(pa[f], p_smem + 16 * f * PL::kPitch + PL::pair(p_off0, kk));
#pragma unroll
        for (int dn = 0; dn < NT_O / 2; ++dn) {
          uint32_t b[4];
          fa2::ldmatrix_x4_trans(b, tile_k + kk * 16 * ROW_BYTES + L::pair(v_warp, dn));
#pragma unroll
          for (int f = 0; f < FM; ++f) {
            fa2::mma_16816<T>(o[f][2 * dn], pa[f], b[0], b[1]);
            fa2::mma_16816<T>(o[f][2 * dn + 1], pa[f], b[2], b[3]);
          }
        }
      }
    }
    cp_async_wait<0>();
  }

  // Epilogue: each row's sum over both key parts and its max, through shared
  // memory (the maxima's and factors' slots, once every warp has read them).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  __syncthreads();
  if (tq == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      xmax[part * ROWS + 16 * rg + g + 8 * r] = l[r];
      if (part == 0) xscale[16 * rg + g + 8 * r] = m[r];
    }
  }
  __syncthreads();
  const auto packed = w.packed_rows();
  const int col0 = warp * Traits::kVoColsPerWarp + 2 * tq;
#pragma unroll
  for (int f = 0; f < FM; ++f)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int cta_row = 16 * f + g + 8 * r, row = w.row_begin + cta_row;
      if (row >= rows_total) continue;
      float sum = xmax[cta_row];
#pragma unroll
      for (int v = 1; v < PARTS; ++v) sum = __fadd_rn(sum, xmax[v * ROWS + cta_row]);
      // A row that sees no key (kv_len 0, or fully masked) outputs 0, LSE -inf.
      float inv_l = sum > 0.f ? 1.f / sum : 0.f;
      if constexpr (Traits::kKvFp8) inv_l *= out_scale;  // V is ckv: codes x ckv_scale
      const float lse =
          sum > 0.f ? __fadd_rn(__fmul_rn(xscale[cta_row], scale), log2f(sum)) : kNegInf;
      int token, head;
      packed.locate(row, token, head);
      fa2::store_mla_row<T, Traits::kVoDim, Traits::kLse>(p, w, token, head, o[f], r, inv_l, lse, col0,
                                                          warp == 0 && tq == 0);
    }
}

// The fa2 MLA library's two kernels: fa2_mla_kernel (Narrow) below kWideMinHeads
// query heads, fa2_mla_wide_kernel (Wide) from there; the host plans with the
// shape of the one a head count runs (flashjit_rows_per_cta_for and friends).
template <class Narrow, class Wide, int kWideMinHeads>
struct MlaKernelPair {
  __host__ __device__ static constexpr bool wide(int heads) { return kWideMinHeads > 0 && heads >= kWideMinHeads; }
  static int launch(const FlashjitAttentionParams& p, cudaStream_t stream) {
    if constexpr (kWideMinHeads > 0) {
      if (wide(p.num_qo_heads))
        return launch_attention<fa2_mla_wide_kernel<Wide>, typename Wide::DType, Wide::kVoDim, Wide::kLse>(
            p, Wide::kThreads, static_cast<int>(Wide::kSmemBytes), stream);
    }
    return launch_fa2_mla<Narrow>(p, stream);
  }
  static int rows_per_cta(int heads) {
    if constexpr (kWideMinHeads > 0) {
      if (wide(heads)) return Wide::kRowsPerCta;
    }
    return Narrow::kRowsPerCta;
  }
  static int split_align(int heads) {
    if constexpr (kWideMinHeads > 0) {
      if (wide(heads)) return Wide::kKeysPerTile;
    }
    return Narrow::kKeysPerTile;
  }
  static int ctas_per_sm(int heads) {
    if constexpr (kWideMinHeads > 0) {
      if (wide(heads)) return flashjit::ctas_per_sm<fa2_mla_wide_kernel<Wide>>(Wide::kThreads, int(Wide::kSmemBytes));
    }
    return fa2_mla_ctas_per_sm<Narrow>();
  }
};

}  // namespace flashjit
