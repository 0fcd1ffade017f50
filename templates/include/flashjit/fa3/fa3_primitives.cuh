// What the fa3 kernel's warpgroups coordinate with (fa3_attention.cuh):
// register reallocation between the loader and the consumers, the proxy fence
// between plain shared-memory stores and wgmma/TMA, named barriers, and the
// loader's copy of a ragged request's partial last tile.
#pragma once
#include <stdint.h>
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

// A barrier among the 128 threads of one warpgroup (ids 1.. ; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_barrier(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
// The loader warpgroup's barrier (id 3; 1 and 2 are the consumer warpgroups').
__device__ __forceinline__ void loader_barrier() { warpgroup_barrier(3); }

// The loader's first warp: a partial tile of keys k0 .. kv_len - 1 of K and V
// into ring slot `dst` (K, then V kKvTileBytes on), rows past the request zero.
template <class Traits>
__device__ __forceinline__ void copy_partial_tile(const FlashjitAttentionParams& p, const CtaWork& w,
                                                  unsigned char* dst, int k0, int lane) {
  using T = typename Traits::DType;
  using KvLayout = typename Traits::KvLayout;
  constexpr int KEYS = Traits::kKeysPerTile, CHUNKS = Traits::kHeadDim / 8;
  const auto k_rows = kv_rows<T, false>(p, w, p.k, p.k_stride_n, p.k_stride_h, 0);
  const auto v_rows = kv_rows<T, false>(p, w, p.v, p.v_stride_n, p.v_stride_h, 0);
  const int rows = w.kv_len - k0;
  for (int i = lane; i < KEYS * CHUNKS; i += 32) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    uint4 kv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    if (r < rows) {
      kv[0] = *reinterpret_cast<const uint4*>(k_rows.row(k0 + r) + 8 * c);
      kv[1] = *reinterpret_cast<const uint4*>(v_rows.row(k0 + r) + 8 * c);
    }
    const uint32_t at = KvLayout::at(r, c);
    *reinterpret_cast<uint4*>(dst + at) = kv[0];
    *reinterpret_cast<uint4*>(dst + Traits::kKvTileBytes + at) = kv[1];
  }
  fence_async_shared();
  __syncwarp();
}

}  // namespace fa3

}  // namespace flashjit
