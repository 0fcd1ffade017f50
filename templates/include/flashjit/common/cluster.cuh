// Thread-block clusters (sm_90): the CTA's place in its cluster, the cluster
// barrier, and arrivals on a peer CTA's mbarrier. A grid launched without a
// cluster dimension runs clusters of one CTA, where these still hold.
#pragma once
#include <stdint.h>

namespace flashjit {
namespace cluster {

__device__ __forceinline__ uint32_t cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

__device__ __forceinline__ uint32_t num_ctas() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
}

// Every thread of every CTA of the cluster arrives and waits for the others
// (a thread that has exited counts as arrived). Relaxed: it orders no memory
// by itself (mbarrier initialisation is published by fence_mbar_init).
__device__ __forceinline__ void sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// One arrival on the mbarrier at `bar` (a shared::cta address of this CTA's
// layout) in CTA `rank` of the cluster. CTA-scope release, as a local
// arrival's: what it hands back is shared memory the caller's wgmma have
// finished reading, which the peer's TMA then overwrites.
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

}  // namespace cluster
}  // namespace flashjit
