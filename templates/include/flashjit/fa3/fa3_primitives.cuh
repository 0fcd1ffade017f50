// What the fa3 kernel's warpgroups coordinate with (fa3_attention.cuh):
// register reallocation between the loader and the consumers, the proxy fence
// between plain shared-memory stores and wgmma/TMA, named barriers, the
// loader's copy of a ragged request's partial last tile, and the output's
// columns of an accumulator padded to whole blocks.
#pragma once
#include <stdint.h>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/work.cuh"

namespace flashjit {
namespace fa3 {

template <int kRegs>
__device__ __forceinline__ void set_max_registers_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void set_max_registers_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Orders this thread's generic-proxy shared-memory writes before async-proxy
// reads (wgmma, TMA) that a later barrier lets start.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Fetches the line holding `p` into L1 (a hint: nothing waits for it).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }

// A barrier among the 128 threads of one warpgroup (ids 1.. ; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_barrier(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
// The loader warpgroup's barrier (id 3; 1 and 2 are the consumer warpgroups').
__device__ __forceinline__ void loader_barrier() { warpgroup_barrier(3); }
// A barrier of `count` threads, some of which only arrive (ids 4 and 5: the
// consumers' turns, Fa3PingPongTraits). They order issue, not memory: no
// memory clobber, so that ptxas keeps its freedom with the registers (with
// one, the paged d128 kernel spilled); volatile asm keeps their place among
// the wgmma instructions.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count));
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count));
}

// The loader's first warp: a partial tile of keys k0 .. kv_len - 1 of K and V
// into ring slot `dst` (K, then V kKTileBytes on). Every copy is in flight at
// once (cp.async): a load and store at a time cost one memory round trip per
// row pair and lane, a request's whole time where it has one tile, hidden
// behind the consumers where it has many (docs/fa3.md, "One CTA", partial last
// tile).
// Only V's rows past the request are written (zeros, by plain stores): their
// probabilities are 0, but 0 times a stale NaN is NaN. K's keep whatever the
// slot held, as their logits are masked to -inf before any use (the tile is
// partial, so its mask applies). A tiny request copies few rows and zeroes the
// rest of V, not the whole tile twice.
template <class Traits>
__device__ __forceinline__ void copy_partial_tile(const FlashjitAttentionParams& p, const CtaWork& w,
                                                  unsigned char* dst, int k0, int lane) {
  using T = typename Traits::DType;
  using KvLayout = typename Traits::KvLayout;
  constexpr int KEYS = Traits::kKeysPerTile, CHUNKS = Traits::kHeadDim / 8, V_CHUNKS = Traits::kHeadDimVo / 8;
  const auto k_rows = kv_rows<T, false>(p, w, p.k, p.k_stride_n, p.k_stride_h, 0);
  const auto v_rows = kv_rows<T, false>(p, w, p.v, p.v_stride_n, p.v_stride_h, 0);
  const int rows = w.kv_len - k0;
  const uint32_t k_dst = smem_addr(dst), v_dst = k_dst + Traits::kKTileBytes;
  if constexpr (CHUNKS == V_CHUNKS) {
#pragma unroll 1
    for (int i = lane; i < rows * CHUNKS; i += 32) {
      const int r = i / CHUNKS, c = i % CHUNKS;
      const uint32_t at = KvLayout::at(r, c);
      cp_async_16(k_dst + at, k_rows.row(k0 + r) + 8 * c, true);
      cp_async_16(v_dst + at, v_rows.row(k0 + r) + 8 * c, true);
    }
  } else {  // V narrower than K: each in its own pass
#pragma unroll 1
    for (int i = lane; i < rows * CHUNKS; i += 32)
      cp_async_16(k_dst + KvLayout::at(i / CHUNKS, i % CHUNKS), k_rows.row(k0 + i / CHUNKS) + 8 * (i % CHUNKS), true);
#pragma unroll 1
    for (int i = lane; i < rows * V_CHUNKS; i += 32)
      cp_async_16(v_dst + KvLayout::at(i / V_CHUNKS, i % V_CHUNKS), v_rows.row(k0 + i / V_CHUNKS) + 8 * (i % V_CHUNKS),
                  true);
  }
  cp_async_commit();
#pragma unroll 4
  for (int i = rows * V_CHUNKS + lane; i < KEYS * V_CHUNKS; i += 32)
    st_shared_zero_16(v_dst + KvLayout::at(i / V_CHUNKS, i % V_CHUNKS));
  cp_async_wait<0>();
  fence_async_shared();
  __syncwarp();
}

// The output's kOut column fragments of an accumulator of kAcc (P.V runs on
// whole 64-column blocks, fa3_traits.cuh): of(acc) copies the first kOut and
// returns the copy, which last(acc) returns again (after an in-place merge);
// where they are all of the accumulator, both return it.
template <int kOut, int kAcc>
struct OutputColumns {
  using Out = float[1][kOut][4];
  Out o;
  __device__ __forceinline__ Out& of(const float (&acc)[1][kAcc][4]) {
#pragma unroll
    for (int n = 0; n < kOut; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[0][n][e] = acc[0][n][e];
    return o;
  }
  __device__ __forceinline__ Out& last(const float (&)[1][kAcc][4]) { return o; }
};
template <int kCols>
struct OutputColumns<kCols, kCols> {
  using Out = float[1][kCols][4];
  __device__ __forceinline__ Out& of(Out& acc) { return acc; }
  __device__ __forceinline__ Out& last(Out& acc) { return acc; }
};

// x itself, through an instruction that reads `token`, so that whatever uses
// the result is scheduled after whatever produced the token: ptxas cannot see
// through the selection (both of its values are x, but for x = -0 one is +0).
__device__ __forceinline__ float after(float x, uint64_t token) {
  float y;
  asm volatile(
      "{\n .reg .pred p;\n .reg .f32 t;\n setp.eq.u64 p, %2, 0;\n add.f32 t, %1, 0f00000000;\n"
      " selp.f32 %0, t, %1, p;\n}\n"
      : "=f"(y)
      : "f"(x), "l"(token));
  return y;
}

}  // namespace fa3

}  // namespace flashjit
