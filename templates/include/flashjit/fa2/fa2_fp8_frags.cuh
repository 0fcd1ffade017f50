// FP8 K/V codes widened straight into mma fragments (Fa2Traits::kFp8InRegs):
// the split-keys decode at head dim 128, where each warp reads only its own
// 16 keys of a tile, so a code is read by exactly one lane and the widening
// pass of fa2_fp8.cuh (codes -> a 16-bit tile -> ldmatrix) is redundant.
// Each lane loads the codes of its own fragments with 16-byte shared loads
// and converts them in registers: no 16-bit tile, no stores, no ldmatrix, no
// warp barrier between the copy and the math.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4; see
// fa2_primitives.cuh): B's b[0] holds B[k = 2t, 2t + 1][n = g], b[1] holds
// B[k = 2t + 8, 2t + 9][n = g]. Two permutations make a lane's codes adjacent:
//   * Head dims of S = Q.K^T (k): a sum over them, so any permutation applied
//     to Q and K alike is exact. K-step kk = 4h + s (h = 0, 1; s = 0 .. 3)
//     takes, in lane t's positions 2t, 2t + 1, 2t + 8, 2t + 9, the dims
//     64h + 16t + 4s + 0 .. 3: one 16-byte load of a key row at dims
//     64h + 16t gives a lane its codes of four k-steps (word s: b[0] from its
//     low pair, b[1] from its high pair). Q's A fragments are loaded once per
//     CTA in the same order (load_q).
//   * Keys within the warp's 16 (k of O += P.V, n of S): logical key
//     8j + 2t + u (u = 0, 1; S's n-tile j, column 2t + u; P's column) is row
//     4t + 2j + u of the warp's code rows (key_row), so that a lane's P.V keys
//     2t, 2t + 1, 2t + 8, 2t + 9 are rows 4t .. 4t + 3, and S's lane g of n-tile
//     j reads row key_row(8j + g). The mask and the softmax see every logit
//     with its true key (fa2_attention.cuh mask_fragment), and P's columns are
//     S's, so P.V pairs each weight with its own value row.
//   * Output dims (n of P.V): n-tile nt, column c is dim 16c + nt, so that
//     lane g reads dims 16g .. 16g + 15 of each of its four keys (one 16-byte
//     load a key) and lane t accumulates dims 32t .. 32t + 31 of its rows:
//     o[nt][e] is dim 16 * (2t + e % 2) + nt (o_dim; the epilogue writes by it).
//
// Widening stays exact (both 16-bit formats hold every code's value, NaN
// stays NaN and e5m2's infinities stay infinite): codes -> fp16 pairs by
// F2FP (cvt.rn.f16x2.e4m3x2 / e5m2x2), and for bf16 queries fp16 -> fp32 ->
// bf16 as fa2_fp8.cuh does (the upper halves of the exact fp32 values).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/fa2/fa2_fp8.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"

namespace flashjit {
namespace fa2 {

// Code tiles of 128-byte rows (head dim 128), 16-byte chunk c of row r at
// chunk c ^ swizzle(r). swizzle = 2 * ((r / 4) % 4) ^ 4 * (r % 2) keeps all
// three 16-byte accesses free of bank conflicts (each quarter warp's eight
// chunks land on eight different chunk positions of a 128-byte line):
//   * the cp.async copies: 8 lanes a row, a permutation of its chunks;
//   * K loads: lanes g = 2p, 2p + 1 (t = 0 .. 3) of a quarter warp read rows
//     4p + 2j + g % 2, chunks 4h + t -> (4h + t) ^ 2p ^ 4(g % 2): 8 distinct;
//   * V loads: lanes g = 2p, 2p + 1 read rows 4t + i, chunk g -> g ^ 2t ^
//     4(i % 2): 8 distinct.
struct Fp8FragTile {
  static constexpr int kPitch = 128;
  static constexpr bool kSwizzled = true;
  __host__ __device__ static constexpr int swizzle(int row) { return (((row >> 2) & 3) << 1) ^ ((row & 1) << 2); }
  __device__ __forceinline__ static uint32_t at(int row, int chunk) {
    return static_cast<uint32_t>(row * kPitch + ((chunk ^ swizzle(row)) << 4));
  }
  __device__ __forceinline__ static uint32_t at(int row, int chunk, int) { return at(row, chunk); }
  __host__ __device__ static constexpr int block(int b) { return b * 128; }
};

template <class KvT, class T>
struct Fp8Frags {
  static constexpr int kDim = 128, kKSteps = kDim / 16, kNtO = kDim / 8;
  using Tile = Fp8FragTile;

  // Row of the warp's 16 code rows that holds logical key `key` (0 .. 15).
  __host__ __device__ static constexpr int key_row(int key) { return 4 * ((key % 8) / 2) + 2 * (key / 8) + key % 2; }
  // Head dim of o[nt][e] for lane t (see the header comment).
  __host__ __device__ static constexpr int o_dim(int nt, int t, int e) { return 16 * (2 * t + e % 2) + nt; }

  // Q's A fragments of rows 0 .. 15 of the swizzled 16-bit Q tile of layout QL
  // at q_rows, in the permuted head-dim order: a[0], a[2] of k-step 4h + s are
  // dims 64h + 16t + 4s + 0 .. 3 of row g (one 8-byte load), a[1], a[3] those
  // of row g + 8.
  template <class QL>
  __device__ __forceinline__ static void load_q(uint32_t (&q)[kKSteps][4], uint32_t q_rows, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const int dim = 64 * (kk / 4) + 16 * t + 4 * (kk % 4);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint2 v = ld_shared_8(q_rows + QL::at(g + 8 * r, dim / 8) + (dim % 8) * 2);
        q[kk][r] = v.x;
        q[kk][2 + r] = v.y;
      }
    }
  }

  // S (n-tiles 0, 1: logical keys 0 .. 15 of the warp) = Q . K^T over the
  // warp's 16 code rows at k_rows.
  __device__ __forceinline__ static void scores(float (&s)[2][4], const uint32_t (&q)[kKSteps][4], uint32_t k_rows,
                                                int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int h = 0; h < kDim / 64; ++h)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4 c = ld_shared_16(k_rows + Tile::at(key_row(8 * j + g), 4 * h + t));
        const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (int st = 0; st < 4; ++st)
          mma_16816<T>(s[j], q[4 * h + st], widen_fp8x2<KvT, T>(w[st] & 0xffffu), widen_fp8x2<KvT, T>(w[st] >> 16));
      }
  }

  // B registers of n-tiles 4q .. 4q + 3 for one pair of keys: x, y hold dims
  // 16g + 4q + 0 .. 3 of the pair's first and second key; b[a] = (x's code a,
  // y's code a) in T.
  __device__ __forceinline__ static void key_pairs(uint32_t x, uint32_t y, uint32_t (&b)[4]) {
    if constexpr (std::is_same<T, __half>::value) {  // pair the codes, then one F2FP a pair
#pragma unroll
      for (int a = 0; a < 4; ++a) b[a] = widen_fp8x2<KvT, T>(__byte_perm(x, y, a | ((4 + a) << 4)));
    } else {  // each word's codes to exact fp32, then the pairs' upper halves (their bf16 bits)
      float fx[4], fy[4];
      unpack_fp8_word<KvT>(x, fx);
      unpack_fp8_word<KvT>(y, fy);
#pragma unroll
      for (int a = 0; a < 4; ++a) b[a] = __byte_perm(__float_as_uint(fx[a]), __float_as_uint(fy[a]), 0x7632);
    }
  }

  // O += P . V over the warp's 16 code rows at v_rows (pa: P's A fragment).
  __device__ __forceinline__ static void accumulate(float (&o)[kNtO][4], const uint32_t (&pa)[4], uint32_t v_rows,
                                                    int lane) {
    const int g = lane / 4, t = lane % 4;
    uint4 c[4];  // rows 4t + i: logical keys 2t, 2t + 1, 2t + 8, 2t + 9
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = ld_shared_16(v_rows + Tile::at(4 * t + i, g));
    const uint32_t w[4][4] = {{c[0].x, c[0].y, c[0].z, c[0].w}, {c[1].x, c[1].y, c[1].z, c[1].w},
                              {c[2].x, c[2].y, c[2].z, c[2].w}, {c[3].x, c[3].y, c[3].z, c[3].w}};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t b0[4], b1[4];
      key_pairs(w[0][q], w[1][q], b0);
      key_pairs(w[2][q], w[3][q], b1);
#pragma unroll
      for (int a = 0; a < 4; ++a) mma_16816<T>(o[4 * q + a], pa, b0[a], b1[a]);
    }
  }
};

}  // namespace fa2
}  // namespace flashjit
