// MLA (DeepSeek latent attention) on warpgroup MMA (sm_90a), fp16 / bf16,
// paged. As in fa2_mla.cuh, an MLA batch is MQA with one KV head: a CTA's 64
// packed rows are (query token x head) pairs of one request, keys are [ckv |
// kpe] (576 wide) and values ckv (512 wide); logits = sm_scale * (q_nope.ckv +
// q_pe.kpe), o = softmax . ckv.
//
// Three warpgroups:
// - the loader (warpgroup 0) gathers each tile of 64 keys from the pages by
//   cp.async into a ring of kStages slots (any page size, pages in any order),
//   every thread arriving on the slot's "full" mbarrier once its copies land;
//   it looks up the next tile's pages while this one's copies fly, and only
//   its first warp polls the slot's "empty" mbarrier before a refill. With key
//   groups (Traits::kKeyGroups > 1) it copies a tile in groups of blocks and
//   also arrives at a named barrier per group once its copies of the group
//   have landed, where the softmax consumer waits before S's k-steps over it.
// - two consumers share the 64 rows. One warpgroup cannot hold O (64 x 512
//   fp32: 256 registers a thread), so each owns half of O's columns; the
//   softmax consumer (warpgroup 2) also computes S = Q.K^T over the whole tile
//   (wgmma N 64, Q and K K-major in shared memory: Q is read once a tile) and
//   runs the online softmax of the fa2 family on it (lazy max, P rounded to
//   the input dtype). P goes to the slot's kpe block, which S no longer
//   needs, and the rows' rescale factors to shared memory. Each consumer
//   multiplies P by its 256 columns of the tile's ckv part (wgmma N 256, P and
//   V from shared memory, V MN-major): the softmax consumer at once, then the
//   next tile's S behind it; the other when a barrier per tile hands it P and
//   the factors (the softmax consumer arrives, never waits for it).
// Row sums meet once at the end; each consumer writes its output columns, or,
// for a split-KV chunk, fp32 partial rows (and the softmax consumer the LSE).
// An FP8 cache (Traits::kKvFp8): the loader copies codes and widens them into
// the slot (fa3_mla_fp8.cuh); S takes the ckv part x ckv_scale / kpe_scale
// between its ckv and kpe k-steps, the softmax scale sm_scale x kpe_scale, O
// ckv_scale (fa2/fa2_mla_fp8.cuh). Its launches never take the pairs kernel.
#pragma once
#include <math_constants.h>
#include <stdint.h>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/kernel_config.cuh"
#include "flashjit/common/merge_states.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_epilogue.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa2/fa2_mla_primitives.cuh"
#include "flashjit/fa3/fa3_mla_copy.cuh"
#include "flashjit/fa3/fa3_mla_fp8.cuh"
#include "flashjit/fa3/fa3_mla_pairs.cuh"
#include "flashjit/fa3/fa3_mla_store.cuh"
#include "flashjit/fa3/fa3_mla_traits.cuh"
#include "flashjit/fa3/fa3_primitives.cuh"
#include "flashjit/fa3/fa3_wgmma.cuh"

namespace flashjit {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fa3_mla_kernel(const __grid_constant__ FlashjitAttentionParams p,
                   const __grid_constant__ typename Traits::TmaArg tma_arg) {
  using T = typename Traits::DType;
  using Tile = typename Traits::Tile;
  constexpr int KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages, ROWS = Traits::kRowsPerCta;
  constexpr int WG_COLS = Traits::kColsPerWarpgroup;
  constexpr int NT_S = KEYS / 8, NT_O = WG_COLS / 8;
  constexpr int KSTEPS_QK = Traits::kQkDim / 16, KSTEPS_PV = KEYS / 16;
  constexpr float kLog2e = 1.4426950408889634f, kLazyLog2 = 8.f;
  const float kNegInf = -CUDART_INF_F;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const uint32_t base = smem_addr(smem);
  const uint32_t q_smem = base + Traits::kQOffset;
  const uint32_t bars = base + Traits::kBarOffset;
  auto slot_of = [&](int t) { return base + Traits::kKvOffset + (t % STAGES) * Traits::kTileBytes; };
  auto full = [&](int t) { return bars + 8 * (t % STAGES); };
  auto empty = [&](int t) { return bars + 8 * (STAGES + t % STAGES); };
  auto group_bar = [&](int t, int g) { return bars + 8 * (2 * STAGES + (t % STAGES) * Traits::kKeyGroups + g); };

  const int tid = threadIdx.x, warpgroup = tid / 128, lane = tid % 32;
  const CtaWork w = decode_work<true>(p, ROWS);
  const int rows_total = w.qo_len * w.group;
  if (!w.valid || w.row_begin >= rows_total) return;  // uniform across the CTA
  const fa2::MlaCtaKeys<Traits::kCausal, ROWS, KEYS> keys(w, rows_total);
  const int key_begin = keys.key_begin, num_tiles = keys.num_tiles;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      tma::mbar_init(full(s), Traits::kLoaderThreads);
      tma::mbar_init(empty(s), Traits::kConsumerWarps);
      if constexpr (Traits::kTma)
        for (int g = 0; g < Traits::kKeyGroups; ++g) tma::mbar_init(group_bar(s, g), 1);
    }
    tma::fence_mbar_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- Loader.
    fa3::set_max_registers_dec<Traits::kLoaderRegs>();
    if constexpr (Traits::kKvFp8) {  // codes, widened in the slots; the 16-bit loader below is not reached
      fa3::mla_fp8_loader<Traits>(p, w, tma_arg, key_begin, num_tiles, tid, slot_of, full, empty, group_bar);
      return;
    }
    using Gather = fa3::MlaGather<Traits>;
    const Gather gather(p, w, tid);
    typename Gather::Rows rows;
    auto lookup = [&](int t) {
      const int k0 = key_begin + t * KEYS;
      gather.lookup(rows, k0, min(KEYS, w.kv_len - k0));
    };
    if (num_tiles > 0) lookup(0);
    for (int t = 0; t < num_tiles; ++t) {
      if (t >= STAGES) {
        // The slot's previous tile (t - STAGES) completed phase t / STAGES - 1.
        if (tid < 32) tma::mbar_wait(empty(t), ((t / STAGES) - 1) & 1);
        fa3::loader_barrier();
      }
      // By TMA (Traits::kTma): a whole tile within one page (page_box_rows: 64
      // where the page size is a multiple of 64, else 0).
      if constexpr (Traits::kTma) {
        const int k0 = key_begin + t * KEYS;
        if (tma_arg.page_box_rows > 0 && k0 % KEYS == 0 && k0 + KEYS <= w.kv_len) {
          if (tid == 0)
            fa3::load_mla_tile_tma<Traits>(tma_arg.maps, slot_of(t), rows.page[0], rows.slot[0],
                                           [&](int g) { return group_bar(t, g); });
          if (t + 1 < num_tiles) lookup(t + 1);
          // Each group once its boxes landed (the first warp polls), to the
          // softmax consumer; then the whole tile, on "full".
#pragma unroll
          for (int g = 0; g < Traits::kKeyGroups; ++g) {
            if (tid < 32) tma::mbar_wait(group_bar(t, g), (t / STAGES) & 1);
            fa3::loader_barrier();
            if constexpr (Traits::kKeyGroups > 1) fa3::key_group_arrive<Traits>(t, g);
          }
          tma::mbar_arrive(full(t));
          continue;
        }
        if (tma_arg.page_box_rows > 0) {
          // A gathered tile where others come by TMA: its group barriers' phases
          // stay in step with the slot's tiles (an arrival and its wait).
          if (tid == 0)
            for (int g = 0; g < Traits::kKeyGroups; ++g) tma::mbar_arrive(group_bar(t, g));
          if (tid < 32)
            for (int g = 0; g < Traits::kKeyGroups; ++g) tma::mbar_wait(group_bar(t, g), (t / STAGES) & 1);
        }
      }
      if constexpr (Traits::kKeyGroups == 1)
        gather.issue(slot_of(t), rows);
      else
        gather.issue_groups(slot_of(t), rows);
      cp_async_arrive_noinc(full(t));
      if (t + 1 < num_tiles) lookup(t + 1);
      if constexpr (Traits::kKeyGroups > 1) gather.arrive_groups(t);  // as each group lands, to the softmax consumer
    }
    cp_async_commit();
    cp_async_wait<0>();  // exits with no copy of this thread in flight
    return;
  }

  // ---- Consumers: warpgroup c = 0, 1 owns O's columns 256c .. 256c + 255;
  // c = 1 also computes S and the softmax. Warp wq of each holds rows 16 wq .. 16 wq + 15.
  fa3::set_max_registers_inc<Traits::kConsumerRegs>();
  const int c = warpgroup - 1, ctid = tid - 128, wq = (tid % 128) / 32;
  const int g = lane / 4, tq = lane % 4;
  const bool softmax_wg = c == 1;
  fa2::copy_mla_q<Traits, Tile, Traits::kConsumerThreads, 2>(p, w, q_smem, rows_total, ctid);
  cp_async_commit();
  cp_async_wait<0>();
  fa3::fence_async_shared();
  fa3::consumers_barrier();

  // Per tile parity, the factor each row's O takes (1 where the max stays): a
  // buffer is rewritten two tiles on, once that tile's keys have landed in the
  // slot the other consumer frees only after it has read the factors.
  float* factors = reinterpret_cast<float*>(smem + Traits::kFactorOffset);
  float* row_sums = reinterpret_cast<float*>(smem + Traits::kSumOffset);
  const int row_in_cta[2] = {16 * wq + g, 16 * wq + g + 8};
  const fa2::MlaScales<Traits::kKvFp8> scales(p, kLog2e);  // with an FP8 cache's scales
  const float scale = scales.softmax, ckv_ratio = scales.ckv_ratio, out_scale = scales.out;
  float m[2] = {kNegInf, kNegInf}, m_ref[2] = {0.f, 0.f}, l[2] = {0.f, 0.f};
  float o[NT_O][4];
#pragma unroll
  for (int n = 0; n < NT_O; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float s[NT_S][4];  // the softmax consumer's

  // Until tile t's keys have landed; the gather wrote them through the generic
  // proxy, so a proxy fence orders them before wgmma's reads.
  auto wait_full = [&](int t) {
    tma::mbar_wait(full(t), (t / STAGES) & 1);
    fa3::fence_async_shared();
  };
  // S = Q.K^T of tile t (issued and committed), once the tile has landed, or,
  // where the tiling has key groups, waiting for each group before its
  // k-steps. Its own wgmma.fence: S's registers were last written by the softmax.
  auto issue_qk = [&](int t) {
    if constexpr (Traits::kKeyGroups == 1) wait_full(t);
    fa3::fence();
    const uint64_t q_desc = fa3::fresh(fa3::smem_desc(q_smem, 16, 1024));
    const uint64_t k_desc = fa3::smem_desc(slot_of(t), 16, 1024);
#pragma unroll
    for (int kk = 0; kk < KSTEPS_QK; ++kk) {
      if constexpr (Traits::kKeyGroups > 1) {
        if (kk % (4 * Traits::kBlocksPerGroup) == 0) {  // a k-step is a quarter of a 64-column block
          fa3::key_group_sync<Traits>(t, kk / (4 * Traits::kBlocksPerGroup));
          fa3::fence_async_shared();
        }
      }
      if constexpr (Traits::kKvFp8) {
        if (kk == Traits::kCkvDim / 16) {  // the ckv part landed: x ckv_ratio before the kpe k-steps
          fa3::commit();
          fa3::wait<0>();
          fa3::fence_operands(s);
          fa2::scale_ckv_part(s, ckv_ratio);
          fa3::fence();
        }
      }
      const uint32_t at = Tile::block(kk / 4) + (kk % 4) * 32;
      fa3::mma_ss<T, KEYS>(s, fa3::advance(q_desc, at), fa3::advance(k_desc, at), kk > 0);
    }
    fa3::commit();
  };
  // O[:, 256c ...] += P.V of tile t: P in the slot's kpe block, V its ckv part.
  auto issue_pv = [&](int t) {
    fa3::fence();
    const uint64_t p_desc = fa3::smem_desc(slot_of(t) + Tile::block(Traits::kBlocks - 1), 16, 1024);
    const uint64_t v_desc =
        fa3::smem_desc(slot_of(t) + Tile::block(c * (WG_COLS / 64)), Tile::kBlockBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < KSTEPS_PV; ++kk)
      fa3::mma_ss_vt<T, WG_COLS>(o, fa3::advance(p_desc, kk * 32), fa3::advance(v_desc, kk * 16 * 128), 1);
    fa3::commit();
  };

  // O *= each row's factor, skipped where every row of the warp keeps its max.
  auto rescale = [&](const float (&factor)[2]) {
    if (__any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < NT_O; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] *= factor[e >> 1];
    }
  };
  // This warpgroup's P.V of tile t landed: one arrival per warp on the slot's "empty".
  auto release = [&](int t) {
    fa3::fence_operands(o);
    __syncwarp();
    if (lane == 0) tma::mbar_arrive(empty(t));
  };

  // No product is left in flight across a loop's back edge: ptxas serializes
  // every wgmma of a kernel whose accumulators it cannot track through one
  // (C7515). The consumers run loops of their own: the softmax consumer hands
  // each tile's P and factors over (a barrier per tile parity, so that it can
  // be a tile ahead) and goes on to its P.V and the next S without waiting for
  // the other, which multiplies its half when they arrive.
  if (softmax_wg) {
    if (num_tiles > 0) {
      issue_qk(0);
      fa3::wait<0>();
      fa3::fence_operands(s);
    }
    for (int t = 0; t < num_tiles; ++t) {
      float* factor_t = factors + (t & 1) * ROWS;
      float factor[2];
      const int k0 = key_begin + t * KEYS;
      keys.mask(s, k0, KEYS, w, rows_total, row_in_cta, tq);
      // The lazy max of the fa2 family (fa2_softmax.cuh): a row moves only once
      // it has grown by more than kLazyLog2 in log2 units; (-inf) - (-inf) =
      // NaN compares false, so a row that sees no key yet never moves, and a
      // first visible key always does.
      float mx[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[r] = fmaxf(m[r], fa2::row_max<NT_S>(s, r));
      fa2::quad_max(mx);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool moves = (mx[r] - m[r]) * scale > kLazyLog2;
        const float ref = mx[r] == kNegInf ? 0.f : mx[r] * scale;
        // From m itself, not m_ref: a first move (m = -inf) gives 0, never 2^-ref.
        factor[r] = moves ? fa2::exp2_fast(m[r] * scale - ref) : 1.f;
        if (moves) {
          m[r] = mx[r];
          m_ref[r] = ref;
          l[r] *= factor[r];
        }
        if (tq == 0) factor_t[row_in_cta[r]] = factor[r];
      }
      // P = 2^(s * scale - m_ref): fp32 sums into l, rounded to T into the
      // slot's kpe block (a 64 x 64 tile: chunk j of row r at j ^ (r % 8), and
      // rows r and r + 8 share r % 8 = g).
      unsigned char* p_tile = smem + Traits::kKvOffset + (t % STAGES) * Traits::kTileBytes +
                              Tile::block(Traits::kBlocks - 1);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        fa2::exp2_row<NT_S>(s, r, scale, m_ref[r]);
        l[r] += fa2::row_sum<NT_S>(s, r);
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
          *reinterpret_cast<uint32_t*>(p_tile + row_in_cta[r] * 128 + ((j ^ g) << 4) + 4 * tq) =
              fa2::pack2<T>(s[j][2 * r], s[j][2 * r + 1]);
      }
      // After the last tile, the rows' sums over each quad go with its P and
      // factors: the other consumer reads them past the same hand-off, and
      // this one keeps them.
      if (t + 1 == num_tiles) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
          l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
          if (tq == 0) row_sums[row_in_cta[r]] = l[r];
        }
      }
      fa3::fence_async_shared();
      fa3::warpgroup_barrier(2);  // P_t of all four warps, for this warpgroup's wgmma
      rescale(factor);
      issue_pv(t);
      fa3::handoff_arrive(t);  // P_t and its factors, to the other consumer
      if (t + 1 < num_tiles) issue_qk(t + 1);
      if constexpr (Traits::kEarlyRelease) {
        // The slot goes back as P.V_t lands, while S_{t+1} (the next slot) runs.
        if (t + 1 < num_tiles)
          fa3::wait<1>();
        else
          fa3::wait<0>();
        release(t);
        fa3::wait<0>();
        fa3::fence_operands(s);
      } else {
        fa3::wait<0>();  // P.V_t (and S_{t+1}) landed
        fa3::fence_operands(s);
        release(t);
      }
    }
  } else {
    for (int t = 0; t < num_tiles; ++t) {
      fa3::handoff_sync(t);
      wait_full(t);  // passes at once (tile t landed before P_t); orders it before this warpgroup's wgmma
      const float* factor_t = factors + (t & 1) * ROWS;
      const float factor[2] = {factor_t[row_in_cta[0]], factor_t[row_in_cta[1]]};
      rescale(factor);
      issue_pv(t);
      fa3::wait<0>();
      release(t);
    }
  }

  // The row sums came with the last tile's P (none without tiles).
  if (!softmax_wg) {
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = num_tiles > 0 ? row_sums[row_in_cta[r]] : 0.f;
  }
  if constexpr (Traits::kKvFp8) {  // V is ckv: codes x ckv_scale
#pragma unroll
    for (int n = 0; n < NT_O; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= out_scale;
  }
  // Both consumers stage their halves (the consumers' barrier, id 1).
  fa3::store_mla_rows_staged<T, Traits::kVoDim, Traits::kLse, ROWS>(
      p, w, o, l, m_ref, row_in_cta, rows_total, c * WG_COLS, tq, softmax_wg && tq == 0, smem + Traits::kQOffset,
      q_smem, 1, 256, ctid % 128);
}

// The launch's TMA maps: the 16-bit cache's (128-byte swizzled boxes the
// wgmma reads), or an FP8 cache's codes (fa3::encode_mla_code_maps).
template <class Traits>
int encode_mla_maps(KvTensorMaps* maps, const FlashjitAttentionParams& p) {
  if constexpr (Traits::kKvFp8)
    return fa3::encode_mla_code_maps(maps, p, Traits::kCkvDim, Traits::kKpeDim, Traits::kKeysPerTile);
  else
    return tma::encode_paged_kv_maps<typename Traits::DType>(maps, p, Traits::kCkvDim, Traits::kKpeDim,
                                                              Traits::kKeysPerTile);
}

template <class Traits>
int launch_fa3_mla(const FlashjitAttentionParams& p, cudaStream_t stream) {
  typename Traits::TmaArg tma_arg{};
  // Pages of 64 keys or more by TMA where the driver encodes the maps (ckv as
  // K, kpe as V, one KV head: p.num_kv_heads is 1); else every tile is
  // gathered. TMA boxes take the issue off the loader's threads at every head
  // count (docs/mla.md, "Tilings and why").
  if constexpr (Traits::kTma) {
    if (p.num_work > 0 && p.page_size >= Traits::kKeysPerTile && p.page_size % Traits::kKeysPerTile == 0 &&
        encode_mla_maps<Traits>(&tma_arg.maps, p) == cudaSuccess)
      tma_arg.page_box_rows = Traits::kKeysPerTile;
  }
  // With Traits::kPairs, the pairs kernel (fa3_mla_pairs.cuh) where every
  // tile comes by TMA and more than 64 heads make two or more CTAs read each
  // request's keys; with one CTA a request this kernel is the faster
  // (docs/mla.md, "Tilings and why").
  if constexpr (Traits::kPairs) {
    if (tma_arg.page_box_rows > 0 && p.num_qo_heads > Traits::kRowsPerCta)
      return launch_attention<fa3_mla_pairs_kernel<Traits>, typename Traits::DType, Traits::kVoDim, Traits::kLse>(
          p, Traits::kPairThreads, static_cast<int>(Traits::kPairSmemBytes), stream, tma_arg);
  }
  return launch_attention<fa3_mla_kernel<Traits>, typename Traits::DType, Traits::kVoDim, Traits::kLse>(
      p, Traits::kThreads, static_cast<int>(Traits::kSmemBytes), stream, tma_arg);
}

template <class Traits>
int fa3_mla_ctas_per_sm() {
  return ctas_per_sm<fa3_mla_kernel<Traits>>(Traits::kThreads, static_cast<int>(Traits::kSmemBytes));
}

}  // namespace flashjit
