// Compile-time shape of the fa3 MLA kernel (fa3_mla.cuh): DeepSeek-style latent
// attention on warpgroup MMA over a paged cache of ckv (512 wide, both K and V)
// and kpe (64 wide, the rotary part of K). Rendered from flashjit/kernels/fa3.py's
// Fa3MlaTiling.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <type_traits>
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa3/fa3_mla_store.cuh"

namespace flashjit {

template <class DType_, class KvType_, int kStages_, bool kCausal_, bool kLse_, int kKeyGroups_ = 1,
          bool kEarlyRelease_ = false, bool kTma_ = false, bool kPairs_ = false>
struct Fa3MlaTraits {
  using DType = DType_;
  // The cache's element type: DType, or an FP8 format whose codes the loader
  // widens into the 16-bit slots (fa3_mla_fp8.cuh; the loader kernel only).
  using KvType = KvType_;
  static constexpr bool kKvFp8 = kIsFp8<KvType>;
  static constexpr int kCkvDim = 512, kKpeDim = 64, kQkDim = kCkvDim + kKpeDim, kVoDim = kCkvDim;
  // 64-column blocks of a [ckv | kpe] row: 8 of ckv, then the one of kpe.
  static constexpr int kBlocks = kQkDim / 64;
  static constexpr int kStages = kStages_;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kLse = kLse_;
  // What S waits for before its k-steps over a tile's keys: 1, the whole tile
  // (the slot's full mbarrier); more, each group of kBlocks / kKeyGroups
  // blocks as it lands, so that S starts on the first blocks while the rest
  // fly. A group's wait is a named barrier the loader warpgroup arrives at
  // (ids kGroupBarrier0 .., one per slot and group): an mbarrier's try-wait
  // loop between one S's wgmma makes ptxas serialize every wgmma (C7515).
  static constexpr int kKeyGroups = kKeyGroups_;
  static constexpr int kBlocksPerGroup = kBlocks / kKeyGroups;
  // When the softmax consumer gives tile t's slot back: once its P.V of the
  // tile has landed (early), or once the next tile's S, issued behind it, has
  // landed too.
  static constexpr bool kEarlyRelease = kEarlyRelease_;
  // Whole tiles that lie in one page of 64 keys or more come by TMA, a 64-row
  // box per 64-column block (nine a tile, from one thread), each key group's
  // boxes counted on an mbarrier of its own; other tiles (small pages, a
  // partial last tile) are gathered by every loader thread's cp.async.
  static constexpr bool kTma = kTma_;
  // Launches of more than 64 heads whose tiles all come by TMA run
  // fa3_mla_pairs.cuh's kernel instead: two computing warpgroups, each the S
  // and softmax of every other tile, and a producer warpgroup for the refills.
  static constexpr bool kPairs = kPairs_;
  // The kernel's K/V map argument (an empty stand-in without TMA).
  using TmaArg = std::conditional_t<kTma, KvMapsPagedArg, KvMapsArg<false>>;
  static constexpr int kGroupBarrier0 = 6;  // 0 __syncthreads, 1 the consumers, 2 and 3 a warpgroup's, 4 and 5 the hand-off

  // One wgmma M of packed rows (query token x head) per CTA, shared by both
  // consumer warpgroups: one warpgroup cannot hold 64 x 512 fp32 accumulators,
  // so each takes half of O's columns (wgmma N 256, 128 registers a thread);
  // the second also computes S = Q.K^T over the whole tile (N 64).
  static constexpr int kRowsPerCta = 64;
  static constexpr int kKeysPerTile = 64;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kColsPerWarpgroup = kVoDim / kConsumerWarpgroups;
  static constexpr int kLoaderThreads = 128;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = kLoaderThreads + kConsumerThreads;
  // After setmaxnreg: the loader keeps four rows' pages (and the next tile's);
  // the consumers hold O (128), S (32) and the softmax state.
  static constexpr int kLoaderRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static_assert(kLoaderThreads * (kLoaderRegs + kConsumerWarpgroups * kConsumerRegs) <= 65536, "the SM's registers");

  // Q, each K/V tile and P as 64-row blocked tiles ([block][row][128 B], the
  // 128-byte swizzle the wgmma descriptors describe: fa3_wgmma.cuh).
  using Tile = fa2::BlockedTile<64>;
  static constexpr int kTileBytes = kBlocks * Tile::kBlockBytes;
  // An FP8 cache's codes land in the upper half of the slot they are widened
  // into: block b's 64 rows x 64 codes (unswizzled) at kCodeOffset + b x 4 KB.
  static constexpr int kCodeBlockBytes = kKeysPerTile * 64;
  static constexpr int kCodeOffset = kTileBytes - kBlocks * kCodeBlockBytes;

  // Shared memory from a 1024-byte boundary: [Q | stage 0 | stage 1 ... | the
  // rows' rescale factors (two tiles' worth) | the final row sums | mbarriers].
  // A tile's P (64 x 64) lives in its slot's kpe block once S has read it.
  static constexpr int kQOffset = 0;
  static constexpr int kKvOffset = kTileBytes;
  static constexpr int kFactorOffset = kKvOffset + kStages * kTileBytes;
  static constexpr int kSumOffset = kFactorOffset + 2 * kRowsPerCta * 4;
  static constexpr int kBarOffset = kSumOffset + kRowsPerCta * 4;
  // Per stage: "full" (the tile landed) and "empty" (every consumer warp
  // done), then, with TMA, one per stage and key group (its boxes landed).
  static constexpr size_t kSmemBytes =
      1024 + size_t(kBarOffset) + 16 * kStages + (kTma ? 8 * kStages * kKeyGroups : 0);

  // The pairs kernel: [Q | slot 0 | slot 1 | per warpgroup, the row maxima
  // and factors it last published and its row sums | a full mbarrier per slot
  // and 64-column block, one per hand-off between the warpgroups, one per
  // refill]. Two computing warpgroups and a producer warpgroup whose one
  // thread issues the refills. The launch gives every thread 168 registers
  // (65536 / 384, rounded down to 8); setmaxnreg then moves the producer's
  // to the others, which wait until the pool holds theirs: 24 + 2 x 240.
  static constexpr int kPairThreads = 384;
  static constexpr int kPairLaunchRegs = 168;
  static constexpr int kPairProducerRegs = 24;
  static constexpr int kPairComputeRegs = 240;
  static_assert(kPairProducerRegs + 2 * kPairComputeRegs <= 3 * kPairLaunchRegs, "the CTA's register pool");
  static constexpr int kPairStateOffset = kKvOffset + 2 * kTileBytes;
  static constexpr int kPairBarOffset = kPairStateOffset + 3 * 2 * kRowsPerCta * 4;
  static constexpr size_t kPairSmemBytes = 1024 + size_t(kPairBarOffset) + 8 * (2 * kBlocks + 5 + 4);

  // Each loader thread copies 16-byte chunk `sub` of every 128-byte block of
  // its key rows: 8 threads a key row, 16 rows a pass.
  static constexpr int kLoaderRowsPerPass = kLoaderThreads / 8;
  static constexpr int kLoaderPasses = kKeysPerTile / kLoaderRowsPerPass;

  static_assert(std::is_same<DType, __half>::value || std::is_same<DType, __nv_bfloat16>::value,
                "fa3 MLA takes __half or __nv_bfloat16");
  static_assert(kStages >= 2, "at least a 2-stage K/V pipeline");
  static_assert(kKeyGroups >= 1 && kBlocks % kKeyGroups == 0, "key groups of whole 64-column blocks");
  static_assert(kKeyGroups == 1 || kGroupBarrier0 + kStages * kKeyGroups <= 16, "named barrier ids 0 .. 15");
  static_assert(kKeysPerTile * 2 == 128 && kKpeDim == 64, "P's row of keys is one 128-byte block, as a kpe row");
  static_assert(!kPairs || kTma, "the pairs kernel loads every tile by TMA");
  static_assert(std::is_same<KvType, DType>::value || kKvFp8, "the cache holds q's dtype or FP8 codes");
  static_assert(!kKvFp8 || !kPairs, "an FP8 cache runs the loader kernel at every head count (docs/mla.md)");
  static_assert(!kKvFp8 || (kCodeOffset == kTileBytes / 2 && kLoaderThreads == 128),
                "codes in the slot's upper half, four loader threads a row (fa3_mla_fp8.cuh)");
  static_assert(kRowsPerCta * fa3::kStagedRowBytes<DType, kVoDim> <= kKvOffset - kQOffset,
                "the output rows, staged in Q's shared memory (fa3_mla_store.cuh)");
};

}  // namespace flashjit
