// Two groups of warps in one CTA that take turns on the tensor cores
// (Fa2Traits::kGroups == 2). Each group is a whole worker of its own: its own
// work item, Q tile, K/V ring and tile barrier. Without an order, the two
// warps that share a scheduler (one per group, as with two CTAs per SM) drift
// in and out of phase: while both run their softmax the tensor pipe idles,
// while both run mma's they queue behind each other. With turns, a group's
// mma's (P.V of one tile and Q.K^T of the next: its turn) run while the other
// group runs its softmax, so each scheduler always has one warp issuing mma's
// and one issuing the softmax into the gaps between them.
//
// Named barriers: 1 + g is group g's tile barrier (kGroupThreads threads); 3 + g
// opens group g's turn (2 * kGroupThreads: the other group arrives on it when
// its own turn ends, group g waits on it). Turns strictly alternate, group 0
// first; both groups take the same number of turns, the one with fewer tiles
// padding with empty ones, so that every arrival meets its wait.
#pragma once

namespace flashjit {
namespace fa2 {

// Named barriers with immediate ids (the group is a template argument, see
// fa2_attention_group). They may be reached from different code: each group
// runs its own instantiation.
template <int kId, int kThreads>
__device__ __forceinline__ void barrier_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ __forceinline__ void barrier_arrive() {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

// kOrder: 0 no order; 1 a turn is the group's mma's (P.V of a tile, the top of
// the next and its Q.K^T); 2 a turn is its softmax.
template <int kGroups, int kGroup, int kGroupThreads, int kOrder>
struct Turns {
  static_assert(kGroups == 1 || (kGroups == 2 && kGroup < 2), "one group, or two that take turns");
  static constexpr int kPair = 2 * kGroupThreads;
  static constexpr bool kOn = kGroups == 2 && kOrder != 0;

  // The barrier that makes a landed K/V tile visible to the group's threads.
  __device__ __forceinline__ void group_barrier() const {
    if constexpr (kGroups == 1) {
      __syncthreads();
    } else {
      barrier_sync<1 + kGroup, kGroupThreads>();
    }
  }
  // Both groups (with two).
  __device__ __forceinline__ void cta_barrier() const {
    if constexpr (kGroups == 2) barrier_sync<0, kPair>();
  }
  __device__ __forceinline__ void begin() const {
    if constexpr (kOn) barrier_sync<3 + kGroup, kPair>();
  }
  __device__ __forceinline__ void end() const {
    if constexpr (kOn) barrier_arrive<4 - kGroup, kPair>();
  }
  __device__ __forceinline__ void begin_gemm() const { if constexpr (kOrder == 1) begin(); }
  __device__ __forceinline__ void end_gemm() const { if constexpr (kOrder == 1) end(); }
  __device__ __forceinline__ void begin_softmax() const { if constexpr (kOrder == 2) begin(); }
  __device__ __forceinline__ void end_softmax() const { if constexpr (kOrder == 2) end(); }
  // Group 1 opens group 0's first turn.
  __device__ __forceinline__ void start() const {
    if constexpr (kOn) {
      if (kGroup == 1) end();
    }
  }
  // After the group's own turns, `begun` of them begun and `ended` ended:
  // ends the open one (before the epilogue, so that the other group's next turn
  // does not wait for it) ...
  __device__ __forceinline__ void end_own(int begun, int ended) const {
    if constexpr (kOn) {
      if (begun > ended) end();
    }
  }
  // ... and after it takes empty turns up to `total` (the CTA's count); group
  // 0 then takes group 1's last arrival, which opens no turn.
  __device__ __forceinline__ void pad(int begun, int total) const {
    if constexpr (kOn) {
      for (int i = begun + 1; i <= total; ++i) {
        begin();
        end();
      }
      if (kGroup == 0) begin();
    }
  }
};

}  // namespace fa2
}  // namespace flashjit
