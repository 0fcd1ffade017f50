// The K/V ring of fa2_attention_kernel when the TMA unit loads it (sm_90a,
// Traits::kTmaKv; tma.cuh).
//
// One thread loads each tile of whole rows of the request: it arms the tile's
// ring slot's mbarrier with the tile's bytes and issues one load per 128-byte
// column block of K and of V (KvLayout = BlockedTile). The slot must be free:
// every warp done with the tile it held before. Either the kernel's CTA barrier
// at the top of each tile proves that (thread 0 then loads), or, with
// Traits::kSlotRelease, each warp arrives on the slot's "empty" mbarrier when
// done with it and the loading thread (lane 0 of warp tile % kWarps, so that
// the issue falls to each warp in turn) waits on it; the warps then share no
// CTA barrier per tile and each waits only for the data it reads.
//
// A partial last tile (rows past the request, which the TMA unit would read
// from the next request instead of zero-filling) is copied by every thread with
// zero-filling cp.async, and thread 0's plain arrival completes the slot's
// phase; a CTA barrier after the wait publishes its rows (and, with
// kSlotRelease, one before the copies frees its slot). Either way each tile
// completes one phase of its slot's barriers, so tile t waits on slot t % S
// with parity (t / S) & 1.
#pragma once
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"

namespace flashjit {
namespace fa2 {

template <class Traits>
struct TmaKvRing {
  using T = typename Traits::DType;
  using KvLayout = typename Traits::KvLayout;
  static constexpr int KEYS = Traits::kKeysPerTile, STAGES = Traits::kStages;
  static constexpr int kBlocks = Traits::kRowBytes / 128;  // TMA loads per K or V tile
  static_assert(Traits::kTmaKv, "TmaKvRing is the ring of kTmaKv kernels");

  uint32_t ring;  // stage s: K at ring + s * kStageBytes, V after it
  uint32_t bars;  // stage s's full mbarrier at bars + 8 s, its empty one 8 * STAGES after
  int first_key;  // key of tile 0 within the request
  int num_tiles;

  __device__ __forceinline__ uint32_t bar(int tile) const { return bars + 8 * (tile % STAGES); }
  __device__ __forceinline__ uint32_t empty_bar(int tile) const { return bars + 8 * (STAGES + tile % STAGES); }
  __device__ __forceinline__ uint32_t k_tile(int tile) const { return ring + (tile % STAGES) * Traits::kStageBytes; }
  __device__ __forceinline__ bool full(const CtaWork& w, int tile) const {
    return w.kv_len - (first_key + tile * KEYS) >= KEYS;
  }

  // Thread 0: the barriers, before any load or wait (a CTA barrier must follow
  // before the other threads wait).
  __device__ __forceinline__ void init() const {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      tma::mbar_init(bar(s), 1);
      if constexpr (Traits::kSlotRelease) tma::mbar_init(empty_bar(s), Traits::kWarps);
    }
    tma::fence_mbar_init();
  }

  // Thread 0: tile `tile` (whole rows of the request) by TMA.
  __device__ __forceinline__ void load(const KvTensorMaps& maps, const CtaWork& w, int tile) const {
    const uint32_t k_dst = k_tile(tile), v_dst = k_dst + Traits::kKvTileBytes, b = bar(tile);
    const int token = w.kv_start + first_key + tile * KEYS;
    tma::mbar_arrive_expect_tx(b, 2 * Traits::kKvTileBytes);
#pragma unroll
    for (int i = 0; i < kBlocks; ++i) {
      tma::load_kv_block(k_dst + KvLayout::block(i), &maps.k, maps.heads_outer_k, i, w.kv_head, token, b);
      tma::load_kv_block(v_dst + KvLayout::block(i), &maps.v, maps.heads_outer_v, i, w.kv_head, token, b);
    }
  }

  // Every thread: a partial tile by cp.async (one commit group). The copies'
  // addresses are built here, not kept across the loop for a tile that comes
  // at most once per CTA.
  template <int kCopySpan>
  __device__ __forceinline__ void copy_partial(const FlashjitAttentionParams& p, const CtaWork& w, int tile) const {
    using Copy = RaggedTileCopy<T, KvLayout, KEYS, Traits::kHeadDim, Traits::kThreads, kCopySpan>;
    const int k0 = first_key + tile * KEYS;
    const auto k_rows = kv_rows<T, false>(p, w, p.k, p.k_stride_n, p.k_stride_h, 0);
    const auto v_rows = kv_rows<T, false>(p, w, p.v, p.v_stride_n, p.v_stride_h, 0);
    Copy(k_rows, threadIdx.x).issue(k_tile(tile), k0, w.kv_len - k0, k_rows.base);
    Copy(v_rows, threadIdx.x).issue(k_tile(tile) + Traits::kKvTileBytes, k0, w.kv_len - k0, v_rows.base);
    cp_async_commit();
    if (threadIdx.x == 0) tma::mbar_arrive(bar(tile));
  }

  // Every thread: tile `tile` (STAGES - 1 ahead of the tile this thread is
  // at) into its slot, the way its rows allow. With kSlotRelease the loading
  // thread first waits until every warp is done with tile - STAGES, the slot's
  // tile before; without it the kernel's CTA barrier has shown that.
  template <int kCopySpan>
  __device__ __forceinline__ void issue(const FlashjitAttentionParams& p, const KvTensorMaps& maps, const CtaWork& w,
                                        int tile) const {
    if (tile >= num_tiles) return;
    if (full(w, tile)) {
      if constexpr (Traits::kSlotRelease) {
        if (threadIdx.x == 32 * (tile % Traits::kWarps)) {
          if (tile >= STAGES) tma::mbar_wait(empty_bar(tile), ((tile - STAGES) / STAGES) & 1);
          load(maps, w, tile);
        }
      } else if (threadIdx.x == 0) {
        load(maps, w, tile);
      }
    } else {
      if constexpr (Traits::kSlotRelease) __syncthreads();  // uniform: a request has at most one partial tile
      copy_partial<kCopySpan>(p, w, tile);
    }
  }

  // Every warp, after its last read of tile `tile`'s slot (kSlotRelease).
  __device__ __forceinline__ void release(int tile) const {
    static_assert(Traits::kSlotRelease, "only kSlotRelease rings have (initialised) empty barriers");
    __syncwarp();
    if (threadIdx.x % 32 == 0) tma::mbar_arrive(empty_bar(tile));
  }

  // Every thread: until tile `tile` has landed (for a partial tile, this
  // thread's copies of it; the kernel's CTA barrier after it covers the
  // others').
  __device__ __forceinline__ void wait(const CtaWork& w, int tile) const {
    tma::mbar_wait(bar(tile), (tile / STAGES) & 1);
    if (!full(w, tile)) cp_async_wait<0>();
  }
};

}  // namespace fa2
}  // namespace flashjit
