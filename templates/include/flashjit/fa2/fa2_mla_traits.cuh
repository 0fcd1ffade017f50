// Compile-time shapes of the fa2 MLA kernels (fa2_mla.cuh, fa2_mla_wide.cuh):
// DeepSeek-style latent attention over a paged cache of ckv (512 wide, both K
// and V) and kpe (64 wide, the rotary part of K), shared by every query head.
// Rendered from flashjit/kernels/fa2.py's MlaTiling.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <type_traits>
#include "flashjit/common/numeric.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"

namespace flashjit {

// What both fa2 MLA kernels' shapes have in common: the cache's dims, a key
// (and Q) row as one swizzled 576-wide line, and how kThreads threads split
// the copy of a tile (MlaTileCopy, copy_mla_q), so that one copy serves both.
// KvType: the cache's element type, DType or an FP8 format. An FP8 cache's
// tiles of codes land in the ring as they are (kKvRowBytes a row, unswizzled)
// and each thread widens the chunks it copied into one 16-bit tile beside the
// ring (fa2_mla_fp8.cuh), which S and P.V read as they read a ring slot.
template <class DType_, class KvType_, int kWarps_, int kRowsPerCta_, int kKeysPerTile_, int kStages_, bool kCausal_,
          bool kLse_>
struct MlaTraitsBase {
  using DType = DType_;
  using KvType = KvType_;
  static constexpr bool kKvFp8 = kIsFp8<KvType>;
  static constexpr int kCkvDim = 512, kKpeDim = 64, kQkDim = kCkvDim + kKpeDim, kVoDim = kCkvDim;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerCta = kRowsPerCta_;
  static constexpr int kKeysPerTile = kKeysPerTile_;
  static constexpr int kStages = kStages_;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kLse = kLse_;

  // A key row in shared memory is [ckv | kpe] (72 16-byte chunks); Q rows are
  // [q_nope | q_pe] the same way, so Q.K^T is one 576-wide product.
  static constexpr int kRowBytes = kQkDim * 2;
  static constexpr int kChunksPerRow = kQkDim / 8;
  static constexpr int kCkvChunks = kCkvDim / 8;
  using Layout = fa2::RowMajorTile<kRowBytes>;
  static constexpr int kQkSteps = kQkDim / 16;
  static constexpr int kVoColsPerWarp = kVoDim / kWarps;
  static constexpr int kThreadsPerKey = kThreads / kKeysPerTile;
  static constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerKey;
  static constexpr int kQBytes = kRowsPerCta * kRowBytes;
  static constexpr int kTileBytes = kKeysPerTile * kRowBytes;
  // The ring: a key row as the cache holds it (16-byte chunks of its elements),
  // a stage, and the widened tile an FP8 ring adds (none for a 16-bit cache).
  static constexpr int kKvRowBytes = kQkDim * int(sizeof(KvType));
  static constexpr int kKvChunksPerRow = kKvRowBytes / 16;
  static constexpr int kKvCkvChunks = kCkvDim * int(sizeof(KvType)) / 16;
  static constexpr int kKvChunksPerThread = kKvChunksPerRow / kThreadsPerKey;
  static constexpr int kStageBytes = kKeysPerTile * kKvRowBytes;
  static constexpr int kWidenedBytes = kKvFp8 ? kTileBytes : 0;

  static_assert(std::is_same<DType, __half>::value || std::is_same<DType, __nv_bfloat16>::value,
                "fa2 MLA takes __half or __nv_bfloat16");
  static_assert(kKeysPerTile % 16 == 0 && kThreads % kKeysPerTile == 0 && kChunksPerRow % kThreadsPerKey == 0,
                "a tile of whole k16 steps; whole chunk sets per copying thread");
  static_assert(kCkvChunks % kThreadsPerKey == 0, "a thread's chunks: ckv ones first, then kpe ones");
  static_assert(kKvChunksPerRow % kThreadsPerKey == 0 && kKvCkvChunks % kThreadsPerKey == 0,
                "whole chunk sets of the cache's rows per copying thread, ckv ones first");
  static_assert(std::is_same<KvType, DType>::value || kKvFp8, "the cache holds q's dtype or FP8 codes");
  static_assert(kStages >= 2, "at least a 2-stage K/V pipeline");
  static_assert(kTileBytes % 128 == 0 && kStageBytes % 128 == 0, "128-byte aligned stages");
};

// One m16 fragment of packed rows (query token x head) per CTA, shared by every
// warp: the warps split Q.K^T by head dims and O by columns, not the rows.
template <class DType_, class KvType_, int kWarps_, int kKeysPerTile_, int kStages_, int kMinBlocksPerSm_,
          bool kCausal_, bool kLse_>
struct MlaTraits : MlaTraitsBase<DType_, KvType_, kWarps_, 16, kKeysPerTile_, kStages_, kCausal_, kLse_> {
  using Base = MlaTraitsBase<DType_, KvType_, kWarps_, 16, kKeysPerTile_, kStages_, kCausal_, kLse_>;
  using Base::kWarps, Base::kRowsPerCta, Base::kKeysPerTile, Base::kStages, Base::kVoDim, Base::kQkSteps,
      Base::kQBytes, Base::kTileBytes, Base::kStageBytes, Base::kWidenedBytes;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;

  // Q.K^T k-steps (16 dims each): warp w takes steps w, w + 4, ..., so that
  // every step of a warp sits at the same swizzle phase (step % 4 == w) and its
  // ldmatrix addresses differ only by whole 128-byte blocks.
  static constexpr int kQkStepsPerWarp = kQkSteps / kWarps;

  // What fa2::WarpSoftmax reads: one fragment over a whole tile of keys, O as
  // wide as a warp's columns, the lazy max of rows-split prefill (every warp
  // sees the same logits, so they all take the same decisions), no soft-cap.
  struct Softmax {
    using DType = DType_;
    static constexpr int kFragsM = 1;
    static constexpr int kKeysPerStep = kKeysPerTile_;
    static constexpr int kHeadDimVo = kVoDim / kWarps_;  // the O columns of a warp
    static constexpr bool kSplitKeys = false;
    static constexpr bool kSoftCap = false;
  };

  static_assert(kWarps == 4, "the Q.K^T k-step split (step % 4 == warp) needs four warps");
  static_assert(kQkSteps % kWarps == 0 && kVoDim % (16 * kWarps) == 0, "whole k-steps and n16 blocks per warp");

  // Shared memory: [Q, later the logit exchange | stage 0 | stage 1 ... | an
  // FP8 cache's widened tile]. Q lives in registers once loaded, so its bytes
  // then hold each warp's partial logits, laid out [warp][value][lane]
  // (conflict-free).
  static constexpr int kXchgFloatsPerWarp = kRowsPerCta * kKeysPerTile;
  static constexpr int kXchgBytes = kWarps * kXchgFloatsPerWarp * 4;
  static constexpr int kHeadBytes = kQBytes > kXchgBytes ? kQBytes : kXchgBytes;
  static constexpr int kWidenedOffset = kHeadBytes + kStages * kStageBytes;
  static constexpr size_t kSmemBytes = size_t(kWidenedOffset) + kWidenedBytes;
  static_assert(kHeadBytes % 128 == 0, "128-byte aligned stages");
};

// The wide fa2 MLA kernel (fa2_mla_wide.cuh) for large head counts: 64 packed
// rows per CTA and eight warps. Warp w computes S for rows 16 (w % 4) .. + 15
// over keys 32 (w / 4) .. + 31 of a 64-key tile (the whole 576 dims, Q read
// from shared memory), the two warps of a row group meet at a named barrier
// for the row maxima, P goes through shared memory, and warp w multiplies all
// 64 rows of P by output columns [64 w, 64 w + 64) of V.
template <class DType_, class KvType_, int kKeysPerTile_, int kStages_, bool kCausal_, bool kLse_>
struct MlaWideTraits : MlaTraitsBase<DType_, KvType_, 8, 64, kKeysPerTile_, kStages_, kCausal_, kLse_> {
  using Base = MlaTraitsBase<DType_, KvType_, 8, 64, kKeysPerTile_, kStages_, kCausal_, kLse_>;
  using Base::kWarps, Base::kRowsPerCta, Base::kKeysPerTile, Base::kStages, Base::kVoColsPerWarp, Base::kQBytes,
      Base::kTileBytes, Base::kStageBytes, Base::kWidenedBytes;
  static constexpr int kRowGroups = kRowsPerCta / 16, kKeyParts = kWarps / kRowGroups;
  static constexpr int kKeysPerWarp = kKeysPerTile / kKeyParts;
  static constexpr int kMinBlocksPerSm = 1;
  using PLayout = fa2::RowMajorTile<kKeysPerTile * 2>;  // P: [rows][keys] of DType

  static_assert(kKeysPerTile == 64, "P rows are one 128-byte swizzle line (64 keys)");
  static_assert(kKeysPerWarp % 16 == 0 && kVoColsPerWarp % 16 == 0, "whole k16 / n16 blocks per warp");

  // Shared memory: [Q | stage 0 | stage 1 ... | an FP8 cache's widened tile |
  // P | row maxima of each key part (later the row sums) | rescale factors
  // (later m) | moved flags].
  static constexpr int kWidenedOffset = kQBytes + kStages * kStageBytes;
  static constexpr int kPOffset = kWidenedOffset + kWidenedBytes;
  static constexpr int kPBytes = kRowsPerCta * kKeysPerTile * 2;
  static constexpr int kMaxOffset = kPOffset + kPBytes;
  static constexpr int kScaleOffset = kMaxOffset + kKeyParts * kRowsPerCta * 4;
  static constexpr int kMovedOffset = kScaleOffset + kRowsPerCta * 4;
  static constexpr size_t kSmemBytes = size_t(kMovedOffset) + 16 * kRowGroups;
  static_assert(kQBytes % 128 == 0 && kPOffset % 128 == 0, "128-byte aligned tiles");
};

}  // namespace flashjit
