// MLA on warpgroup MMA (sm_90a) in tile pairs: the fa3 MLA kernel for caches
// whose pages hold a multiple of 64 keys, where every tile of 64 keys lies in
// one page and comes by TMA. With Fa3MlaTiling.pairs, fa3_mla.cuh's launch
// picks it there for more than 64 heads (docs/mla.md, "The pairs kernel").
//
// Why a second schedule: in fa3_mla.cuh one consumer computes every tile's S
// and softmax, and the tensor pipe idles through each softmax (docs/mla.md,
// "What limits it").
// Here two computing warpgroups take the tiles in pairs: warpgroup 0 the even
// tiles (slot 0), warpgroup 1 the odd ones (slot 1). Each computes S = Q.K^T of
// its own tile (wgmma 64x64, 36 k-steps) and its softmax; each owns half of O's
// 512 columns and multiplies both tiles' P by its half of both tiles' V. Their
// softmaxes are staggered by one exchange of row maxima, so that one runs while
// the other's products fill the pipe. The same idea runs DeepSeek's FlashMLA.
// A third, producer warpgroup issues every refill: issuing a tile's boxes holds
// the issuing thread about 75 cycles a box, and in a computing warpgroup that
// time held its warp and the hand-offs behind it (docs/mla.md, "The pairs
// kernel", why a producer).
//
// One step (tiles a = 2i and b = a + 1; "->" is a hand-off one warpgroup
// arrives on and the other waits on; "let go" arrives on a refill's mbarrier,
// on which the producer waits before it issues the refill's boxes):
//   warpgroup 0: max of S_a against m; -> scale0 (m0, f0); P_a; O_L *= f0;
//     O_L += P_a.V_a[L] (P from registers); when landed, let go of slot 0's
//     blocks 0-3; <- scale1 (m1, f1); P_a * f1 rounded into slot 0's kpe block
//     -> p0; <- p1; O_L *= f1; O_L += P_b.V_b[L]; S of tile a + 2 on blocks
//     0-3; when P_b.V_b[L] landed, let go of slot 1's blocks 0-3 and 8; S on
//     blocks 4-8.
//   warpgroup 1: <- scale0; max of S_b against m0 -> scale1 (m1, f1); P_b;
//     O_R *= f0 f1; P_b into slot 1's kpe block; O_R += P_b.V_b[R] (registers)
//     -> p1; <- p0; O_R += P_a.V_a[R]; when P_b.V_b[R] landed, let go of slot
//     1's blocks 4-7; when P_a.V_a[R] landed, of slot 0's blocks 4-8; S of
//     tile b + 2 on blocks 4-7, 0-3, 8 (in the order they were refilled).
//   producer: looks up tiles a + 2 and a + 3's pages, then refills slot 0's
//     blocks 0-3, slot 1's 4-7, slot 0's 4-8 and slot 1's 0-3 and 8, each once
//     let go of (the order in which the computing warpgroups let go).
// Each 64-column block of a slot has its own full mbarrier. Both halves of O end
// a step relative to m1 with P rounded once each (the fa2 family's error model,
// one rescale step per tile: Fa3MlaTiling.rescales); each warpgroup sums its
// own tiles' P and the two sums meet at the end.
//
// Rows past a partial last tile are whatever the page holds there: their
// logits are masked, and the owning warpgroup zeroes their V rows once they
// land (0 * NaN would poison the products).
#pragma once
#include <math_constants.h>
#include <stdint.h>
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_epilogue.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa2/fa2_mla_primitives.cuh"
#include "flashjit/fa3/fa3_mla_store.cuh"
#include "flashjit/fa3/fa3_mla_traits.cuh"
#include "flashjit/fa3/fa3_primitives.cuh"
#include "flashjit/fa3/fa3_wgmma.cuh"

namespace flashjit {
namespace fa3 {

// The hand-offs between the two warpgroups, each an mbarrier that every
// thread of the handing warpgroup arrives on and the other waits on, one phase
// a step. Every thread arrives for its own writes: compute-sanitizer's
// racecheck reads an arrival by another thread (a warp's first lane after
// __syncwarp, or a named barrier's bar.arrive) as no ordering at all, though
// the hardware orders it (docs/mla.md, "The pairs kernel", hand-offs).
enum MlaPairHandoff : int { kScale0, kScale1, kP0, kP1, kSums, kHandoffs };
// The refills of a step, each an mbarrier that the warpgroup reading its blocks
// last arrives on (one thread, past its wgmma wait) and the producer waits on:
// slot 0's blocks 0-3 and 4-8, slot 1's blocks 4-7 and 0-3 with 8.
enum MlaPairRefill : int { kRefill0Low, kRefill0High, kRefill1High, kRefill1Low, kRefills };
constexpr int kOwnWarpgroup0 = 1;  // each warpgroup's own named barrier, 1 + warpgroup

// S (+)= Q.K^T over 64-column blocks kFirst .. kEnd - 1 of the tile at
// `k_smem`, each once its mbarrier (bars + 8 b) completes phase `parity`, each
// block's four k-steps committed as a group of their own; kStart is the block S
// begins with (its first k-step overwrites s). Each block's wgmma.fence follows
// its wait.
template <class T, int kFirst, int kEnd, int kStart, class Tile>
__device__ __forceinline__ void mla_s_blocks(float (&s)[8][4], uint32_t q_smem, uint32_t k_smem, uint32_t bars,
                                             uint32_t parity) {
  const uint64_t q_desc = fresh(smem_desc(q_smem, 16, 1024));
  const uint64_t k_desc = smem_desc(k_smem, 16, 1024);
#pragma unroll
  for (int b = kFirst; b < kEnd; ++b) {
    tma::mbar_wait(bars + 8 * b, parity);
    fence();  // past the wait's loop: ptxas serializes every wgmma where it must insert this itself (C7520)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t at = Tile::block(b) + kk * 32;
      mma_ss<T, 64>(s, advance(q_desc, at), advance(k_desc, at), b != kStart || kk > 0);
    }
    commit();
  }
}

// Zeroes rows valid .. 63 of ckv blocks 0-7 of a 64-key tile (128-byte rows,
// kBlockBytes apart), 16 bytes a store, from the warpgroup's 128 threads.
template <class Tile>
__device__ __forceinline__ void zero_key_rows(unsigned char* tile, int valid, int ctid) {
  const int chunks = (64 - valid) * 8 * 8;  // rows x blocks x 16-byte chunks
  for (int i = ctid; i < chunks; i += 128) {
    const int row = valid + i / 64, block = (i / 8) % 8, chunk = i % 8;
    *reinterpret_cast<uint4*>(tile + Tile::block(block) + row * 128 + chunk * 16) = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace fa3

template <class Traits>
__global__ void __launch_bounds__(Traits::kPairThreads, 1)
    fa3_mla_pairs_kernel(const __grid_constant__ FlashjitAttentionParams p,
                         const __grid_constant__ KvMapsPagedArg tma_arg) {
  using T = typename Traits::DType;
  using Tile = typename Traits::Tile;
  constexpr int KEYS = Traits::kKeysPerTile, ROWS = Traits::kRowsPerCta, BLOCKS = Traits::kBlocks;
  constexpr int WG_COLS = Traits::kColsPerWarpgroup, NT_S = KEYS / 8, NT_O = WG_COLS / 8, KSTEPS_PV = KEYS / 16;
  constexpr float kLog2e = 1.4426950408889634f, kLazyLog2 = 8.f;
  constexpr uint32_t kBlockTx = KEYS * 128;
  const float kNegInf = -CUDART_INF_F;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const uint32_t base = smem_addr(smem);
  const uint32_t q_smem = base + Traits::kQOffset;
  auto slot = [&](int x) { return base + Traits::kKvOffset + x * Traits::kTileBytes; };
  const uint32_t bars = base + Traits::kPairBarOffset;
  auto block_bars = [&](int x) { return bars + 8 * BLOCKS * x; };
  auto handoff_bar = [&](int k) { return bars + 8 * (2 * BLOCKS + k); };
  auto refill_bar = [&](int r) { return bars + 8 * (2 * BLOCKS + fa3::kHandoffs + r); };
  // Per warpgroup x: the row maxima and factors it last published, and its
  // final row sums.
  float* max_of = reinterpret_cast<float*>(smem + Traits::kPairStateOffset);
  float* factor_of = max_of + 2 * ROWS;
  float* sum_of = factor_of + 2 * ROWS;

  const int tid = threadIdx.x, wg = tid / 128, ctid = tid % 128, lane = tid % 32, wq = ctid / 32;
  const int g = lane / 4, tq = lane % 4;
  const CtaWork w = decode_work<true>(p, ROWS);
  const int rows_total = w.qo_len * w.group;
  if (!w.valid || w.row_begin >= rows_total) return;  // uniform across the CTA
  const fa2::MlaCtaKeys<Traits::kCausal, ROWS, KEYS> keys(w, rows_total);
  const int key_begin = keys.key_begin, num_tiles = keys.num_tiles;

  if (tid == 0) {
    for (int i = 0; i < 2 * BLOCKS; ++i) tma::mbar_init(bars + 8 * i, 1);
    for (int k = 0; k < fa3::kSums; ++k) tma::mbar_init(bars + 8 * (2 * BLOCKS + k), 128);
    tma::mbar_init(bars + 8 * (2 * BLOCKS + fa3::kSums), 256);  // both warpgroups' row sums
    for (int r = 0; r < fa3::kRefills; ++r) tma::mbar_init(refill_bar(r), 1);
    tma::fence_mbar_init();
  }
  __syncthreads();

  // Tile t's page and its first key's slot in it (key_begin is a multiple of
  // the tile, pages of whole tiles: a tile never crosses a page).
  const int32_t* pages = p.kv_page_indices + w.kv_start;
  auto locate = [&](int t, int& page, int& page_slot) {
    const int k0 = key_begin + t * KEYS;
    page = pages[k0 / p.page_size];
    page_slot = k0 % p.page_size;
  };
  // Blocks kFirst .. kEnd - 1 of a tile into slot x (one thread), each on its own mbarrier.
  auto load_blocks = [&](int x, int page, int page_slot, int first, int end) {
    for (int b = first; b < end; ++b) {
      const bool kpe = b + 1 == BLOCKS;
      tma::mbar_arrive_expect_tx(block_bars(x) + 8 * b, kBlockTx);
      tma::load_4d(slot(x) + Tile::block(b), kpe ? &tma_arg.maps.v : &tma_arg.maps.k, kpe ? 0 : 64 * b, 0,
                   page_slot, page, block_bars(x) + 8 * b);
    }
  };
  if (tid == 0) {
    for (int t = 0; t < 2 && t < num_tiles; ++t) {
      int page, page_slot;
      locate(t, page, page_slot);
      load_blocks(t, page, page_slot, 0, BLOCKS);
    }
  }
  fa2::copy_mla_q<Traits, Tile, Traits::kPairThreads, 2>(p, w, q_smem, rows_total, tid);
  cp_async_commit();
  cp_async_wait<0>();
  fa3::fence_async_shared();
  __syncthreads();

  auto parity = [](int t) { return uint32_t((t / 2) & 1); };
  if (wg == 2) {
    // ---- Producer: one thread issues every refill once its blocks' last
    // reader has let go of them, in the order the warpgroups let go.
    fa3::set_max_registers_dec<Traits::kPairProducerRegs>();
    if (ctid == 0) {
      for (int a = 0; a + 2 < num_tiles; a += 2) {  // the steps with a refill: tile a + 2 exists
        const bool next_b = a + 3 < num_tiles;
        int page_a, slot_a, page_b = 0, slot_b = 0;
        locate(a + 2, page_a, slot_a);
        if (next_b) locate(a + 3, page_b, slot_b);
        tma::mbar_wait(refill_bar(fa3::kRefill0Low), parity(a));
        load_blocks(0, page_a, slot_a, 0, 4);
        if (next_b) {
          tma::mbar_wait(refill_bar(fa3::kRefill1High), parity(a));
          load_blocks(1, page_b, slot_b, 4, BLOCKS - 1);
        }
        tma::mbar_wait(refill_bar(fa3::kRefill0High), parity(a));
        load_blocks(0, page_a, slot_a, 4, BLOCKS);
        if (next_b) {
          tma::mbar_wait(refill_bar(fa3::kRefill1Low), parity(a));
          load_blocks(1, page_b, slot_b, 0, 4);
          load_blocks(1, page_b, slot_b, BLOCKS - 1, BLOCKS);
        }
      }
    }
    return;
  }
  fa3::set_max_registers_inc<Traits::kPairComputeRegs>();

  const int row_in_cta[2] = {16 * wq + g, 16 * wq + g + 8};
  const float scale = p.sm_scale * kLog2e;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  float o[NT_O][4];
#pragma unroll
  for (int n = 0; n < NT_O; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float s[NT_S][4];
  uint32_t pa[KSTEPS_PV][4];  // this warpgroup's P rounded to T, the A operand of its own P.V

  auto mask = [&](int t) { keys.mask(s, key_begin + t * KEYS, KEYS, w, rows_total, row_in_cta, tq); };
  // A partial last tile: its V rows past the request zeroed for both
  // warpgroups' products (the other reads them past a later hand-off).
  auto zero_tail = [&](int t, int x) {
    const int valid = w.kv_len - (key_begin + t * KEYS);
    if (valid < KEYS) {
      fa3::zero_key_rows<Tile>(smem + Traits::kKvOffset + x * Traits::kTileBytes, valid, ctid);
      fa3::fence_async_shared();
      fa3::warpgroup_barrier(fa3::kOwnWarpgroup0 + wg);
    }
  };
  // The lazy max of the fa2 family (fa2_softmax.cuh) against reference `ref_m`:
  // a row moves only once it has grown by more than kLazyLog2 in log2 units;
  // (-inf) - (-inf) = NaN compares false, so a row that sees no key yet never
  // moves, and a first visible key always does (factor 2^-inf = 0).
  auto new_max = [&](const float (&ref_m)[2], float (&next)[2], float (&factor)[2]) {
    float mx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = fmaxf(ref_m[r], fa2::row_max<NT_S>(s, r));
    fa2::quad_max(mx);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool moves = (mx[r] - ref_m[r]) * scale > kLazyLog2;
      factor[r] = moves ? fa2::exp2_fast(ref_m[r] * scale - mx[r] * scale) : 1.f;
      next[r] = moves ? mx[r] : ref_m[r];  // last: next may be ref_m
    }
  };
  auto publish = [&](const float (&mx)[2], const float (&factor)[2]) {
    if (tq == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        max_of[wg * ROWS + row_in_cta[r]] = mx[r];
        factor_of[wg * ROWS + row_in_cta[r]] = factor[r];
      }
    }
  };
  // P = 2^(s * scale - m * scale) in place (fp32, summed into l), and rounded to T in pa.
  auto exp_to_p = [&]() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      fa2::exp2_row<NT_S>(s, r, scale, m[r] == kNegInf ? 0.f : m[r] * scale);
      l[r] += fa2::row_sum<NT_S>(s, r);
    }
#pragma unroll
    for (int kk = 0; kk < KSTEPS_PV; ++kk) {
      pa[kk][0] = fa2::pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = fa2::pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = fa2::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = fa2::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };
  // 16-bit P of two lanes' keys into slot x's kpe block (64 x 64, chunk j of
  // row r at j ^ (r % 8); rows r and r + 8 share r % 8 = g).
  auto store_p = [&](int x, int r, int j, uint32_t packed) {
    unsigned char* p_tile = smem + Traits::kKvOffset + x * Traits::kTileBytes + Tile::block(BLOCKS - 1);
    *reinterpret_cast<uint32_t*>(p_tile + row_in_cta[r] * 128 + ((j ^ g) << 4) + 4 * tq) = packed;
  };
  auto rescale = [&](const float (&factor)[2]) {
    if (__any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < NT_O; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] *= factor[e >> 1];
#pragma unroll
      for (int r = 0; r < 2; ++r) l[r] *= factor[r];
    }
  };
  // This warpgroup's half of V in slot x (MN-major, its four 64-column blocks).
  auto v_desc = [&](int x) {
    return fa3::smem_desc(slot(x) + Tile::block(wg * (WG_COLS / 64)), Tile::kBlockBytes, 1024);
  };
  auto pv_own = [&](int x) {
    fa3::fence();
    const uint64_t v = v_desc(x);
#pragma unroll
    for (int kk = 0; kk < KSTEPS_PV; ++kk) fa3::mma_rs<T, WG_COLS>(o, pa[kk], fa3::advance(v, kk * 16 * 128), 1);
    fa3::commit();
  };
  auto pv_other = [&](int x) {  // P from slot x's kpe block
    fa3::fence();
    const uint64_t pd = fa3::smem_desc(slot(x) + Tile::block(BLOCKS - 1), 16, 1024);
    const uint64_t v = v_desc(x);
#pragma unroll
    for (int kk = 0; kk < KSTEPS_PV; ++kk)
      fa3::mma_ss_vt<T, WG_COLS>(o, fa3::advance(pd, kk * 32), fa3::advance(v, kk * 16 * 128), 1);
    fa3::commit();
  };
  // The step of tile a (paired or not) refills its slots with tiles a + 2 and
  // a + 3 where they exist.
  struct Refills {
    bool a, b;
  };
  auto refills = [&](int a, bool pair) { return Refills{pair && a + 2 < num_tiles, pair && a + 3 < num_tiles}; };
  auto let_go = [&](int r) { tma::mbar_arrive(refill_bar(r)); };
  // Hand-off k of the step of tile a: this warpgroup's writes before it go to
  // the other (hand), or the other's to this one (take).
  auto hand = [&](int k) { tma::mbar_arrive(handoff_bar(k)); };
  auto take = [&](int k, int a) { tma::mbar_wait(handoff_bar(k), parity(a)); };

  if (wg == 0) {
    if (num_tiles > 0) {
      fa3::mla_s_blocks<T, 0, BLOCKS, 0, Tile>(s, q_smem, slot(0), block_bars(0), 0);
      fa3::wait<0>();
      fa3::fence_operands(s);
    }
    // Tile a, and tile a + 1 where kPair.
    auto step = [&](int a, auto pair) {
      constexpr bool kPair = decltype(pair)::value;
      const auto [next_a, next_b] = refills(a, kPair);
      zero_tail(a, 0);
      mask(a);
      float f0[2], f1[2] = {1.f, 1.f};
      new_max(m, m, f0);
      publish(m, f0);
      hand(fa3::kScale0);
      rescale(f0);
      exp_to_p();
      pv_own(0);
      fa3::wait<0>();
      fa3::fence_operands(o);
      if (next_a && ctid == 0) let_go(fa3::kRefill0Low);
      if constexpr (kPair) {
        take(fa3::kScale1, a);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          m[r] = max_of[ROWS + row_in_cta[r]];
          f1[r] = factor_of[ROWS + row_in_cta[r]];
        }
      }
      // P_a for the other warpgroup, relative to its max: rounded once, from fp32.
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < NT_S; ++j) store_p(0, r, j, fa2::pack2<T>(s[j][2 * r] * f1[r], s[j][2 * r + 1] * f1[r]));
      fa3::fence_async_shared();
      hand(fa3::kP0);
      if constexpr (kPair) {
        take(fa3::kP1, a);
        rescale(f1);
        pv_other(1);
        if (next_a) {
          fa3::mla_s_blocks<T, 0, 4, 0, Tile>(s, q_smem, slot(0), block_bars(0), parity(a + 2));
          fa3::wait<4>();
        } else {
          fa3::wait<0>();
        }
        fa3::fence_operands(o);
        if (next_b && ctid == 0) let_go(fa3::kRefill1Low);
        if (next_a) fa3::mla_s_blocks<T, 4, BLOCKS, 0, Tile>(s, q_smem, slot(0), block_bars(0), parity(a + 2));
        fa3::wait<0>();
        fa3::fence_operands(s);
        fa3::fence_operands(o);
      }
    };
    int a = 0;
    for (; a + 1 < num_tiles; a += 2) step(a, std::true_type{});
    if (a < num_tiles) step(a, std::false_type{});
  } else {
    if (num_tiles > 1) {
      fa3::mla_s_blocks<T, 0, BLOCKS, 0, Tile>(s, q_smem, slot(1), block_bars(1), 0);
      fa3::wait<0>();
      fa3::fence_operands(s);
    }
    auto step = [&](int a, auto pair) {
      constexpr bool kPair = decltype(pair)::value;
      const int b = a + 1;
      const auto [next_a, next_b] = refills(a, kPair);
      if constexpr (kPair) {
        zero_tail(b, 1);
        mask(b);
      }
      take(fa3::kScale0, a);
      float m0[2], f0[2], f1[2] = {1.f, 1.f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m0[r] = max_of[row_in_cta[r]];
        f0[r] = factor_of[row_in_cta[r]];
      }
      if constexpr (kPair) {
        new_max(m0, m, f1);
        publish(m, f1);
        hand(fa3::kScale1);
      } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) m[r] = m0[r];
      }
      const float f[2] = {f0[0] * f1[0], f0[1] * f1[1]};
      rescale(f);
      if constexpr (kPair) {
        exp_to_p();
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) store_p(1, r, j, pa[j / 2][2 * (j % 2) + r]);
        pv_own(1);
        fa3::fence_async_shared();
        hand(fa3::kP1);
      }
      take(fa3::kP0, a);
      pv_other(0);
      if constexpr (kPair) {
        fa3::wait<1>();
        if (next_b && ctid == 0) let_go(fa3::kRefill1High);
      }
      fa3::wait<0>();
      fa3::fence_operands(o);
      if (next_a && ctid == 0) let_go(fa3::kRefill0High);
      if (next_b) {
        fa3::mla_s_blocks<T, 4, BLOCKS - 1, 4, Tile>(s, q_smem, slot(1), block_bars(1), parity(b + 2));
        fa3::mla_s_blocks<T, 0, 4, 4, Tile>(s, q_smem, slot(1), block_bars(1), parity(b + 2));
        fa3::mla_s_blocks<T, BLOCKS - 1, BLOCKS, 4, Tile>(s, q_smem, slot(1), block_bars(1), parity(b + 2));
      }
      fa3::wait<0>();
      fa3::fence_operands(s);
    };
    int a = 0;
    for (; a + 1 < num_tiles; a += 2) step(a, std::true_type{});
    if (a < num_tiles) step(a, std::false_type{});
  }

  // Each warpgroup summed its own tiles' P; the two sums meet here.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    if (tq == 0) sum_of[wg * ROWS + row_in_cta[r]] = l[r];
  }
  // Every thread of both arrives, then all wait: racecheck reads this as
  // ordered, and reported the same exchange across __syncthreads() as a race.
  hand(fa3::kSums);
  take(fa3::kSums, 0);
  float sum[2], m_ref[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sum[r] = sum_of[row_in_cta[r]] + sum_of[ROWS + row_in_cta[r]];
    m_ref[r] = m[r] == kNegInf ? 0.f : m[r] * scale;
  }
  fa3::store_mla_rows_staged<T, Traits::kVoDim, Traits::kLse, ROWS>(
      p, w, o, sum, m_ref, row_in_cta, rows_total, wg * WG_COLS, tq, wg == 1 && tq == 0, smem + Traits::kQOffset,
      q_smem, fa3::kOwnWarpgroup0 + wg, 128, ctid);
}

}  // namespace flashjit
