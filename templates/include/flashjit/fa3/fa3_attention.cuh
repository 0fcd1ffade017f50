// The fa3 tensor-core attention kernel (sm_90a): prefill over ragged or single
// requests with warpgroup MMA (wgmma), K/V by TMA and warp specialization.
//
// Same ABI, work decoding, masks and split-KV partial states as the fa2 family
// (work.cuh, fa2_epilogue.cuh): a CTA covers 128 packed rows (query token x
// query head of one KV head) of one work item. Its three warpgroups:
// - the loader (warpgroup 0, registers given up by setmaxnreg): one thread
//   loads each K/V tile of whole rows by TMA into a ring of kStages slots,
//   each with a "full" mbarrier (bytes landed) and an "empty" one (every
//   consumer warp done with the slot). A batch's partial last tile, whose rows
//   past the request TMA would read from the next request, is copied by the
//   loader's first warp (cp.async, V's rows past the request zeroed), then
//   fenced for the async proxy and published by one arrival on the slot's
//   full barrier (fa3::copy_partial_tile).
//   From a paged cache (kPaged), whole tiles come by TMA too, one box per page
//   (or a tile's worth of a larger page) where boxes are 64 rows or more
//   (fa3_launch.cuh); otherwise, and for a partial last tile, the whole loader
//   warpgroup gathers the tile by cp.async (fa2::PagedTileCopy: pages looked up
//   per row, rows past the request zero-filled), each thread arriving on the
//   full barrier when its copies land (cp.async.mbarrier.arrive.noinc).
// - two consumers (warpgroups 1 and 2), 64 rows each: per tile, S = Q.K^T by
//   wgmma from shared memory (Q and K K-major), the online softmax of the fa2
//   family on the accumulators (fa2_softmax.cuh: same lazy max, P rounded to
//   the input dtype), O += P.V by wgmma with P from registers and V MN-major
//   from shared memory, then the slot handed back. The two warpgroups run
//   unsynchronised with each other, so one's softmax overlaps the other's
//   matrix products.
// Rows are written by fa2::store_rows, through each warpgroup's own Q rows.
#pragma once
#include <math_constants.h>
#include <stdint.h>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_epilogue.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa2/fa2_softmax.cuh"
#include "flashjit/fa3/fa3_fp8.cuh"
#include "flashjit/fa3/fa3_loader.cuh"
#include "flashjit/fa3/fa3_primitives.cuh"
#include "flashjit/fa3/fa3_traits.cuh"
#include "flashjit/fa3/fa3_wgmma.cuh"

namespace flashjit {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fa3_attention_kernel(const __grid_constant__ FlashjitAttentionParams p,
                         const __grid_constant__ KvMapsPagedArg tma_arg) {
  using T = typename Traits::DType;
  using KvLayout = typename Traits::KvLayout;
  using QTile = typename Traits::QTile;
  constexpr int D = Traits::kHeadDim, KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages;
  constexpr int ROWS = Traits::kRowsPerCta, WG_ROWS = Traits::kRowsPerWarpgroup;
  constexpr int DV = Traits::kHeadDimVo;
  // O's accumulator spans whole 64-column blocks (NT_ACC n8 tiles), the output its first NT_O.
  constexpr int NT_S = KEYS / 8, NT_O = DV / 8, NT_ACC = Traits::kVoTileCols / 8, KSTEPS_QK = D / 16,
                KSTEPS_PV = KEYS / 16;
  constexpr float kLog2e = 1.4426950408889634f;
  const float kNegInf = -CUDART_INF_F;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle repeats every 1024 bytes: the layout starts on such a boundary.
  const uint32_t raw = smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const uint32_t base = smem_addr(smem);
  const uint32_t q_smem = base + Traits::kQOffset, bars = base + Traits::kBarOffset;
  // Per slot, for K and for V apart: "full" (the tile landed) and "empty"
  // (every consumer warp is done with it), so that K of a slot is reloaded
  // once Q.K^T has read it while P.V may still be reading V.
  auto full_k = [&](int tile) { return bars + 8 * (tile % STAGES); };
  auto full_v = [&](int tile) { return bars + 8 * (STAGES + tile % STAGES); };
  auto empty_k = [&](int tile) { return bars + 8 * (2 * STAGES + tile % STAGES); };
  auto empty_v = [&](int tile) { return bars + 8 * (3 * STAGES + tile % STAGES); };
  auto k_slot = [&](int tile) { return base + (tile % STAGES) * Traits::kStageBytes; };

  const int tid = threadIdx.x, lane = tid % 32, warpgroup = tid / 128;
  if ((!Traits::kPaged || tma_arg.page_box_rows > 0) && tid == 0) {  // the descriptors travel to the TMA unit while the work is decoded
    tma::prefetch_map(&tma_arg.maps.k);
    tma::prefetch_map(&tma_arg.maps.v);
  }
  allow_dependent_grids();  // see grid_dependency.cuh
  wait_for_primary_grid();
  // Clamped so that q + offset - window_left cannot overflow int.
  const int window_left = Traits::kWindow ? min(p.window_left, 1 << 30) : 0;
  // What one launch position (work slot, KV head, split) computes: its rows
  // and the key range any of them can see, from a KEYS-aligned start, within
  // its split-KV chunk (whose bounds are multiples of KEYS). A persistent CTA
  // takes its positions in the order CtaWalk gives (work.cuh); otherwise each
  // CTA takes one. A position past the last is inactive.
  struct Item {
    CtaWork w;
    int rows_total, offset, key_begin, num_tiles;
    bool active;
  };
  const unsigned slots = unsigned(p.num_work) * unsigned(p.num_kv_heads);
  const unsigned positions = slots * unsigned(p.work == nullptr && p.num_splits > 1 ? p.num_splits : 1);
  auto item_at = [&](unsigned position) {
    Item it;
    const unsigned at = min(position, positions - 1);
    it.w = decode_work_at<Traits::kPaged>(p, ROWS, at % slots, at / slots);
    const CtaWork& w = it.w;
    it.rows_total = w.qo_len * w.group;
    it.active = position < positions && w.valid && w.row_begin < it.rows_total;  // uniform across the CTA
    it.offset = w.kv_len - w.qo_len;
    const Mask<Traits::kCausal, Traits::kWindow> mask{it.offset, window_left};
    const int cta_q_first = w.row_begin / w.group;
    const int cta_q_last = (min(w.row_begin + ROWS, it.rows_total) - 1) / w.group;
    it.key_begin = max((mask.key_begin(cta_q_first) / KEYS) * KEYS, w.kv_begin);
    const int key_end = min(mask.key_end(cta_q_last, w.kv_len), w.kv_end);
    it.num_tiles = it.active && key_end > it.key_begin ? (key_end - it.key_begin + KEYS - 1) / KEYS : 0;
    return it;
  };
  const CtaWalk<!Traits::kChunkFold> walk(p, positions);

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      // One arrival: the TMA issuer's (with the bytes) or the partial-tile
      // copier's; paged, every loader thread's; an FP8 cache's, every loader
      // warp's once it has widened its part of the tile (fa3_fp8.cuh).
      constexpr int kFullArrivals = Traits::kKvFp8 ? Traits::kLoaderThreads / 32
                                    : Traits::kPaged ? Traits::kLoaderThreads : 1;
      tma::mbar_init(full_k(s), kFullArrivals);
      tma::mbar_init(full_v(s), kFullArrivals);
      tma::mbar_init(empty_k(s), Traits::kConsumerWarps);
      tma::mbar_init(empty_v(s), Traits::kConsumerWarps);
    }
    if constexpr (Traits::kKvFp8) {  // code slots: every loader thread arrives (the TMA issuer with the bytes)
#pragma unroll
      for (int s = 0; s < Traits::kCodeSlots; ++s)
        tma::mbar_init(base + Traits::kCodeBarOffset + 8 * s, Traits::kLoaderThreads);
    }
    tma::fence_mbar_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // Tiles count on across positions (seq): ring slot and barrier phases follow
    // the CTA's tile sequence, so the next position's first tiles load while
    // the consumers finish the last one's.
    auto for_each_position = [&](auto&& load_position) {
      int seq = 0;
      for (unsigned round = 0; walk.has(round); ++round) {
        const Item it = item_at(walk.position(round));
        if (!it.active) continue;
        load_position(it, seq);
        seq += it.num_tiles;
      }
    };
    if constexpr (Traits::kKvFp8) {
      fa3::load_fp8_kv_tiles<Traits>(p, tma_arg, base, tid, for_each_position, full_k, full_v, empty_k, empty_v,
                                     k_slot);
    } else {
      fa3::load_kv_tiles<Traits>(p, tma_arg, smem, tid, for_each_position, full_k, full_v, empty_k, empty_v, k_slot);
    }
    return;
  }

  // ---- Consumers: warpgroup c = 0, 1 owns rows wg_row0 .. wg_row0 + 63.
  fa3::set_max_registers_inc<Traits::kConsumerRegs>();
  const int c = warpgroup - 1, ctid = tid - 128 * warpgroup, warp_in_wg = ctid / 32;
  // Round r's Q buffer, where its output is staged too: buffer r % kQBuffers of
  // [buffer 0: warpgroup 1, 2 | buffer 1: ...] (Fa3QPrefetchTraits).
  constexpr uint32_t kQBufferBytes = Traits::kConsumerWarpgroups * Traits::kQWarpgroupBytes;
  const uint32_t q_wg0 = q_smem + c * Traits::kQWarpgroupBytes;
  auto q_buffer = [&](unsigned r) { return Traits::kQBuffers == 1 ? q_wg0 : q_wg0 + (r % 2) * kQBufferBytes; };
  auto stage = [&](unsigned r) {
    return Traits::kQBuffers == 1 ? smem + Traits::kStoreBase : smem + Traits::kStoreBase + (r % 2) * kQBufferBytes;
  };
  int seq = 0;  // tiles of earlier positions: see the loader
  // Turns (Fa3PingPongTraits): a warpgroup's products wait at its barrier (4 +
  // c) for the other's arrival, and arrive at the other's once issued. Both
  // issue the same products (every tile of every position), so the turns pair
  // up; warpgroup 1 goes first. The second's last arrival is left unmatched.
  auto take_turn = [&] {
    if constexpr (Traits::kPingPong) fa3::named_barrier_sync(4 + c, 256);
  };
  auto pass_turn = [&] {
    if constexpr (Traits::kPingPong) fa3::named_barrier_arrive(5 - c, 256);
  };
  if constexpr (Traits::kPingPong) {
    if (c == 1) pass_turn();
  }
  for (unsigned round = 0; walk.has(round); ++round) {
    const unsigned position = walk.position(round);
    // Neither an inactive position (an empty work slot: no tiles, no rows) nor
    // a warpgroup whose rows all lie past the request (the last CTA of a
    // request with 64 rows or fewer left) skips code by a branch: ptxas takes
    // one around the products as divergent and serializes every wgmma of the
    // kernel (C7520). They run on zero-filled Q and store nothing.
    const Item it = item_at(position);
    const CtaWork& w = it.w;
    const int rows_total = it.active ? it.rows_total : 0, offset = it.offset;
    // The first key of tile 0 for run_tiles, which the fold kernel moves on
    // chunk by chunk (as it does seq).
    int key_begin = it.key_begin;
    const int num_tiles = it.num_tiles;
    const int wg_row0 = w.row_begin + c * WG_ROWS;
    const int warp_row0 = wg_row0 + 16 * warp_in_wg;
    const uint32_t q_wg = q_buffer(round);
    if constexpr (Traits::kQBuffers == 1) {
      // This warpgroup's Q rows by cp.async (rows past the request zero-filled),
      // once every warp has read back the previous position's output staged there.
      // (Not through the second buffer's copy_q: with it, ptxas assigned the d192
      // fold kernel's registers otherwise.)
      fa3::warpgroup_barrier(1 + c);
      CtaWork wq = w;
      wq.row_begin = wg_row0;
      fa2::copy_q_tile<QTile, WG_ROWS, D, 128, Traits::kCopySpan>(p, wq, static_cast<const T*>(p.q), q_wg, rows_total,
                                                                  ctid);
      cp_async_commit();
      cp_async_wait<0>();
      fa3::fence_async_shared();
      fa3::warpgroup_barrier(1 + c);
    } else {
      // This round's Q was copied during the last one (round 0's here); the next
      // round's goes into the other buffer once every warp has read back the
      // last round's output staged there, and lands while this round runs.
      // copy_q: this warpgroup's Q rows of position `at` into `dst`.
      auto copy_q = [&](const Item& at, uint32_t dst) {
        CtaWork wq = at.w;
        wq.row_begin = at.w.row_begin + c * WG_ROWS;
        fa2::copy_q_tile<QTile, WG_ROWS, D, 128, Traits::kCopySpan>(p, wq, static_cast<const T*>(p.q), dst,
                                                                    at.active ? at.rows_total : 0, ctid);
        cp_async_commit();
      };
      fa3::warpgroup_barrier(1 + c);
      if (round == 0) copy_q(it, q_wg);
      if (walk.has(round + 1)) {
        copy_q(item_at(walk.position(round + 1)), q_buffer(round + 1));
      } else {
        cp_async_commit();  // an empty group: this round's copy is always the second newest
      }
      cp_async_wait<1>();
      fa3::fence_async_shared();
      fa3::warpgroup_barrier(1 + c);
    }

    // The epilogue reads each row's sink (p.sinks, one per query head) after the
    // tile loop: the line is fetched into L1 now, off that path. A KV head's
    // query heads are adjacent; their first and last sink cover group <= 32.
    // (Not in the fold kernel, whose spills at d192 and d256 it moved.)
    if (!Traits::kChunkFold && p.sinks != nullptr && c == 0 && ctid < 2)
      fa3::prefetch_l1(p.sinks + w.kv_head * w.group + ctid * (w.group - 1));

    // Logits leave Q.K^T in natural units; the softmax applies sm_scale (or the
    // soft-cap) in log2 units (fa2_softmax.cuh), and an FP8 cache's k_scale
    // (keys are codes x k_scale).
    fa2::WarpSoftmax<Traits> softmax;
    const float sm_scale = Traits::kKvFp8 ? p.sm_scale * kv_scale_value(p.k_scale_ptr, p.k_scale) : p.sm_scale;
    softmax.scale = Traits::kSoftCap ? 1.f : sm_scale * kLog2e;
    softmax.cap_in = Traits::kSoftCap ? sm_scale / p.logits_soft_cap : 0.f;
    softmax.cap_out = Traits::kSoftCap ? p.logits_soft_cap * kLog2e : 0.f;
    float o[1][NT_ACC][4];
    // The state before a row's first key: the position's, and each chunk's
    // in batch-invariant mode's fold kernel.
    auto fresh_state = [&] {
      softmax.m[0][0] = softmax.m[0][1] = kNegInf;
      softmax.l[0][0] = softmax.l[0][1] = 0.f;
#pragma unroll
      for (int n = 0; n < NT_ACC; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[0][n][e] = 0.f;
    };
    fresh_state();

    // This warp's rows (clamped past the request) for the masks: a tile needs
    // the element mask when some key of it is invisible to some row of the warp.
    const int wq_first = min(warp_row0, rows_total - 1) / w.group;
    const int wq_last = min(warp_row0 + 15, rows_total - 1) / w.group;
    const int g = lane / 4, tq = lane % 4;
    const Mask<Traits::kCausal, Traits::kWindow> mask{offset, window_left};
    int q_pos[2];  // query position of this thread's rows g and g + 8
#pragma unroll
    for (int r = 0; r < 2; ++r) q_pos[r] = min(warp_row0 + g + 8 * r, rows_total - 1) / w.group;
    // s[j][e]: row g + 8 * (e / 2), key k0 + 8j + 2 * tq + e % 2 (fa3_wgmma.cuh).
    auto mask_tile = [&](float (&sf)[NT_S][4], int, int k0) {
#pragma unroll
      for (int j = 0; j < NT_S; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!mask.visible(q_pos[e >> 1], k0 + 8 * j + 2 * tq + (e & 1), w.kv_len)) sf[j][e] = kNegInf;
    };

    // S = Q.K^T of tile t (issued and committed, not waited for).
    // Each product's descriptors are formed per tile from one base (an add per
    // k-step): the compiler would otherwise keep all of Q's k-step descriptors
    // live across the loop, 2 registers each (d256: 32, and spills).
    auto issue_qk = [&](float (&s)[1][NT_S][4], int t) {
      const uint64_t q_desc = fa3::fresh(fa3::smem_desc(q_wg, 16, 1024));
      const uint64_t k_desc = fa3::smem_desc(k_slot(seq + t), 16, 1024);
#pragma unroll
      for (int kk = 0; kk < KSTEPS_QK; ++kk) {
        const uint32_t at_q = QTile::block(kk / 4) + (kk % 4) * 32, at_k = KvLayout::block(kk / 4) + (kk % 4) * 32;
        fa3::mma_ss<T, KEYS>(s[0], fa3::advance(q_desc, at_q), fa3::advance(k_desc, at_k), kk > 0);
      }
      fa3::commit();
    };
    // O += P.V of tile t (issued and committed).
    auto issue_pv = [&](const uint32_t (&pa)[1][KSTEPS_PV][4], int t) {
      const uint64_t v_desc = fa3::smem_desc(k_slot(seq + t) + Traits::kKTileBytes, KEYS * 128, 1024);
#pragma unroll
      for (int kk = 0; kk < KSTEPS_PV; ++kk)
        fa3::mma_rs<T, Traits::kVoTileCols>(o[0], pa[0][kk], fa3::advance(v_desc, kk * 16 * 128), 1);
      fa3::commit();
    };
    // The softmax of tile t's S up to its exponentials: the row maxima, and
    // m_ref; o_zero: O is still 0 (or left to the caller, with defer_rescale,
    // to rescale by factor[] once the P.V in flight has landed).
    auto max_tile = [&](float (&s)[1][NT_S][4], int t, bool o_zero, bool defer_rescale, float (&factor)[2]) {
      const int k0 = key_begin + t * KEYS;
      const bool need_mask = k0 + KEYS > w.kv_len || (Traits::kCausal && k0 + KEYS - 1 > wq_first + offset) ||
                             (Traits::kWindow && k0 < wq_last + offset - window_left);
      const float m_ref_before[2] = {softmax.m_ref[0][0], softmax.m_ref[0][1]};
      softmax.update_max(s, o, k0, need_mask, o_zero, mask_tile);
      // The factor update_max gives O when a row's max moves, from the same
      // exponent references: exactly 1 where it stays.
      if (defer_rescale) {
#pragma unroll
        for (int r = 0; r < 2; ++r) factor[r] = fa2::exp2_fast(m_ref_before[r] - softmax.m_ref[0][r]);
      }
    };
    // The whole softmax of tile t's S into P (pa).
    auto softmax_tile = [&](float (&s)[1][NT_S][4], uint32_t (&pa)[1][KSTEPS_PV][4], int t, bool o_zero,
                            bool defer_rescale, float (&factor)[2]) {
      max_tile(s, t, o_zero, defer_rescale, factor);
      softmax.exp_to_p(s, pa, 0);
    };
    // Until tile t's K (or V) has landed in its slot. A gathered paged tile
    // (every tile without TMA boxes, and a partial last one) was written by
    // cp.async, the generic proxy: a proxy fence orders it before wgmma's reads.
    // (An FP8 cache's tiles were fenced by the loader threads that widened them.)
    auto wait_full = [&](bool v, int t) {
      tma::mbar_wait(v ? full_v(seq + t) : full_k(seq + t), ((seq + t) / STAGES) & 1);
      if constexpr (Traits::kPaged && !Traits::kKvFp8) {
        if (tma_arg.page_box_rows == 0 || key_begin + (t + 1) * KEYS > w.kv_len) fa3::fence_async_shared();
      }
    };
    // This warp is done with a slot's K or V (its products waited for).
    auto release = [&](uint32_t empty) {
      __syncwarp();
      if (lane == 0) tma::mbar_arrive(empty);
    };

    // Tiles [0, count) from key_begin and seq, from a fresh state (fresh_state()).
    auto run_tiles = [&](int count) {
      if constexpr (!Traits::kOverlap) {
        // Each tile in turn: S, softmax, P.V, each product waited for.
        for (int t = 0; t < count; ++t) {
          wait_full(false, t);
          float s[1][NT_S][4], factor[2];
          uint32_t pa[1][KSTEPS_PV][4];
          fa3::fence();
          issue_qk(s, t);
          fa3::wait<0>();
          fa3::fence_operands(s[0]);
          release(empty_k(seq + t));
          softmax_tile(s, pa, t, t == 0, false, factor);
          wait_full(true, t);
          fa3::fence();
          issue_pv(pa, t);
          fa3::wait<0>();
          fa3::fence_operands(o[0]);
          release(empty_v(seq + t));
        }
      } else {
        // Tile t's S = Q.K^T and tile t - 1's P.V are in flight together; the
        // softmax of S_t runs while P.V_{t-1} is still on the tensor cores, and O
        // takes its rescale once that lands. P alternates between two register
        // sets (P_t is written while P_{t-1} is still being read), so the loop
        // walks two tiles per iteration with the sets swapped.
        uint32_t pa0[1][KSTEPS_PV][4], pa1[1][KSTEPS_PV][4];
        auto step = [&](int t, const uint32_t (&pa_prev)[1][KSTEPS_PV][4], uint32_t (&pa_next)[1][KSTEPS_PV][4]) {
          wait_full(false, t);
          wait_full(true, t - 1);
          float s[1][NT_S][4], factor[2];
          take_turn();
          fa3::fence();
          issue_qk(s, t);
          issue_pv(pa_prev, t - 1);
          pass_turn();
          fa3::wait<1>();
          fa3::fence_operands(s[0]);
          release(empty_k(seq + t));
          if constexpr (!Traits::kPaged) {
            softmax_tile(s, pa_next, t, true, true, factor);
            fa3::wait<0>();
            fa3::fence_operands(o[0]);
            release(empty_v(seq + t - 1));
          } else {
            // Tile t - 1's V slot goes back before the exponentials, which
            // read m_ref through the arrival's token: left free, ptxas put
            // some of them ahead of the arrival every other tile in the paged
            // kernels, so the loader refilled the slot that much later. The
            // ragged kernels release first unasked, and the token's round trip
            // only costs them. tests/test_fa3_tile_loop.py checks both; the
            // measurements: docs/fa3.md, "One CTA" (V released before the
            // exponentials).
            max_tile(s, t, true, true, factor);
            fa3::wait<0>();
            fa3::fence_operands(o[0]);
            __syncwarp();
            uint64_t token = 0;
            if (lane == 0) token = tma::mbar_arrive_state(empty_v(seq + t - 1));
#pragma unroll
            for (int r = 0; r < 2; ++r) softmax.m_ref[0][r] = fa3::after(softmax.m_ref[0][r], token);
            softmax.exp_to_p(s, pa_next, 0);
          }
          if (__any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f)) {
#pragma unroll
            for (int n = 0; n < NT_ACC; ++n)
#pragma unroll
              for (int e = 0; e < 4; ++e) o[0][n][e] *= factor[e >> 1];
          }
        };
        if (count > 0) {
          wait_full(false, 0);
          {
            float s[1][NT_S][4], factor[2];
            take_turn();
            fa3::fence();
            issue_qk(s, 0);
            pass_turn();
            fa3::wait<0>();
            fa3::fence_operands(s[0]);
            release(empty_k(seq));
            softmax_tile(s, pa0, 0, true, false, factor);
          }
          int t = 1;
          for (; t + 1 < count; t += 2) {
            step(t, pa0, pa1);
            step(t + 1, pa1, pa0);
          }
          const bool last_in_pa1 = t < count;
          if (last_in_pa1) step(t, pa0, pa1);
          wait_full(true, count - 1);
          take_turn();
          fa3::fence();
          if (last_in_pa1) {
            issue_pv(pa1, count - 1);
          } else {
            issue_pv(pa0, count - 1);
          }
          pass_turn();
          fa3::wait<0>();
          fa3::fence_operands(o[0]);
          release(empty_v(seq + count - 1));
        }
      }
    };

    // An FP8 cache's v_scale (values are codes x v_scale) on the tiles' O, which is linear in V.
    // (Its head dims are whole blocks: O's accumulator is the output's columns.)
    static_assert(!Traits::kKvFp8 || NT_ACC == NT_O, "an FP8 cache at head dims of whole 64-column blocks");
    auto scale_values = [&] {
      if constexpr (Traits::kKvFp8) {
        const float v_scale = kv_scale_value(p.v_scale_ptr, p.v_scale);
#pragma unroll
        for (int n = 0; n < NT_ACC; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[0][n][e] *= v_scale;
      }
    };

    // The kChunkFold kernel (batch-invariant mode, a launch whose CTAs may span
    // several chunks: invariant_chunk in attention_params.cuh): the keys are
    // cut at multiples of the chunk from key 0. Each chunk's tiles run from a
    // fresh state, as a CTA given that chunk alone would run them, and every
    // chunk but the last folds into the running merge (fa2::ChunkMerge) at its
    // end, in this CTA's slot of partial_o (the grid is persistent: one slot
    // per CTA). Other kernels run every tile as one chunk. (Carrying the
    // pipeline across a boundary instead, the new chunk's softmax beside the
    // old one's last P.V, slowed the rows with no boundary at all and gained
    // nothing measurable on the others.)
    // Each chunk is run_tiles from tile 0 with key_begin and seq moved on, and
    // the slot and the chunk are read where the fold uses them: with the chunk's
    // first tile a variable and the slot live across the tile loop, ptxas
    // scheduled d256's loop so that every other tile gave its V slot back only
    // after the softmax's exponentials, and d256 ran slower than normal mode
    // with no boundary crossed (tests/test_fa3_tile_loop.py checks the order;
    // docs/numerics.md#batch-invariant-mode, "Cost").
    if constexpr (Traits::kChunkFold) {
      constexpr int kConsumerThreads = Traits::kConsumerWarps * 32;
      using Merge = fa2::ChunkMerge<Traits>;
      static_assert(kConsumerThreads * (NT_O + 1) * 4 == ROWS * Merge::kFloatsPerRow, "a CTA's scratch slot");
      // The last fold leaves the merge in the output's columns (out.last(o)).
      fa3::OutputColumns<NT_O, NT_ACC> out;
      auto fold = [&](bool folded, bool keep, float (&inv)[1][2], float (&lse)[1][2]) {
        float* const slot = p.partial_o + size_t(blockIdx.x) * ROWS * Merge::kFloatsPerRow;
        Merge::template fold<kConsumerThreads>(out.of(o), softmax.m, softmax.l, softmax.scale, slot, tid - 128,
                                               folded, keep, inv, lse);
      };
      int left = num_tiles, folded = 0;  // tiles not yet run, chunks folded
      int tiles = min(left, ((key_begin / p.invariant_chunk + 1) * p.invariant_chunk - key_begin) / KEYS);
      while (true) {
        run_tiles(tiles);
        key_begin += tiles * KEYS;
        seq += tiles;
        left -= tiles;
        if (left == 0) break;
        float inv[1][2], lse[1][2];
        fold(folded > 0, true, inv, lse);
        ++folded;
        fresh_state();
        tiles = min(left, p.invariant_chunk / KEYS);
      }
      if (folded > 0) {  // uniform across the CTA: the output is the merge of its chunks
        float inv[1][2], lse[1][2];
        fold(true, false, inv, lse);
        scale_values();  // the merge is linear in each chunk's O: once, after it
        fa2::write_rows<Traits>(p, w, out.last(o), inv, lse, stage(round), warp_row0, rows_total);
      } else {
        scale_values();
        fa2::store_rows<Traits>(p, w, out.of(o), softmax.m, softmax.l, stage(round), warp_row0,
                                rows_total, softmax.scale);
      }
      continue;  // seq is past the position's tiles already
    } else {
      run_tiles(num_tiles);
      scale_values();
    }
    // Rows past rows_total (a whole warpgroup's, past the request) are not stored.
    fa3::OutputColumns<NT_O, NT_ACC> out;
    fa2::store_rows<Traits>(p, w, out.of(o), softmax.m, softmax.l, stage(round), warp_row0, rows_total,
                            softmax.scale);
    seq += num_tiles;
  }
}

}  // namespace flashjit
