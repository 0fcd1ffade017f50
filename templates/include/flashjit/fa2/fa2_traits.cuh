// Compile-time shape of one fa2 tensor-core attention kernel (fa2_attention.cuh):
// its tiling (rendered from flashjit/kernels/fa2.py's Fa2Tiling), the variant flags,
// and the shared-memory layout derived from them.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <type_traits>
#include "flashjit/fa2/fa2_primitives.cuh"

namespace flashjit {

template <class DType_, class KvType_, int kHeadDim_, int kHeadDimVo_, int kWarps_, int kFragsM_, int kKeysPerTile_, int kSubTiles_, int kStages_,
          bool kOneWait_, bool kFencePv_, bool kTmaKv_, bool kSlotRelease_, bool kQInRegs_, int kMinBlocksPerSm_,
          bool kSplitKeys_, bool kPaged_, bool kCausal_, bool kWindow_, bool kSoftCap_, bool kLse_,
          bool kCustomMask_>
struct Fa2Traits {
  using DType = DType_;
  // The K/V cache's element type: DType, or an FP8 format whose tiles land in
  // shared memory as codes and are widened to DType there (fa2_fp8.cuh).
  using KvType = KvType_;
  static constexpr bool kKvFp8 = !std::is_same<KvType_, DType_>::value;
  // Q and K rows (kHeadDim), V and O rows (kHeadDimVo): DeepSeek's prefill
  // runs 192 / 128; otherwise the two are equal.
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimVo = kHeadDimVo_;
  static constexpr int kWarps = kWarps_;
  // m16 row fragments per warp (1 or 2): each K / V B-fragment loaded by
  // ldmatrix feeds kFragsM mma's, so shared-memory traffic per FLOP is 1/kFragsM.
  static constexpr int kFragsM = kFragsM_;
  static constexpr int kKeysPerTile = kKeysPerTile_;
  // The math walks each tile in kSubTiles steps of kKeysPerTile / kSubTiles
  // keys (S registers for one step at a time), while copies, cp.async waits
  // and barriers stay per tile: two m16 fragments per warp fit 255 registers
  // with 32-key steps, and 64-key tiles halve the barriers per key.
  static constexpr int kSubTiles = kSubTiles_;
  static constexpr int kStages = kStages_;
  // One cp.async wait and one CTA barrier per tile, for K and V together, at the
  // top of the tile (instead of K there and V again before P.V): half the
  // barriers, and the P.V ldmatrix loads may be scheduled across the softmax.
  // V_t must then land by the top of tile t, not by the end of its softmax.
  // Rows-split mode only (split keys synchronise with __syncwarp).
  static constexpr bool kOneWait = kOneWait_ && !kSplitKeys_;
  // A __syncwarp() between the softmax and P.V, so that ptxas keeps the
  // exponentials out of the P.V mma stream: needed where the tiling sits at the
  // register cap and would otherwise spill or hold one V fragment at a time.
  static constexpr bool kFencePv = kFencePv_;
  // K/V tiles loaded by the TMA unit (sm_90a; tma.cuh) instead of every
  // thread's cp.async, into the blocked layout its 128-byte swizzle writes.
  // Ragged rows only (pages would need one load per row) and rows-split mode.
  static constexpr bool kTmaKv = kTmaKv_ && !kPaged_ && !kSplitKeys_ && !kKvFp8;
  // With TMA: each warp hands a ring slot back through the slot's "empty"
  // mbarrier once done with it, and the slot's next load waits on that, where
  // a CTA barrier per tile made every warp wait for every other one
  // (fa2_kv_tma.cuh). Eight warps of one CTA per SM (d256) gain from it; the
  // d128 wide kernel, at the register cap, loses (docs/fa2.md, "Tilings and why").
  static constexpr bool kSlotRelease = kSlotRelease_ && kTmaKv;
  // Q fragments held in registers for the whole KV loop (D/4 registers per
  // thread); else re-read from shared memory with ldmatrix every tile, which
  // D = 256 needs to stay clear of spills next to its 128 O registers.
  static constexpr bool kQInRegs = kQInRegs_;
  // Second __launch_bounds__ argument: caps registers at 64K / (kThreads * it)
  // so that this many CTAs fit on one SM (1: no cap beyond 255 per thread).
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  // The same kernel shape under another register cap.
  template <int kOtherMinBlocksPerSm>
  using WithMinBlocks = Fa2Traits<DType_, KvType_, kHeadDim_, kHeadDimVo_, kWarps_, kFragsM_, kKeysPerTile_, kSubTiles_, kStages_, kOneWait_,
                                  kFencePv_, kTmaKv_, kSlotRelease_, kQInRegs_, kOtherMinBlocksPerSm, kSplitKeys_, kPaged_, kCausal_, kWindow_, kSoftCap_,
                                  kLse_, kCustomMask_>;
  // Warps split each tile's keys instead of the rows (decode: the rows are
  // only one KV head's query heads, so one warp would do all the math while
  // the others wait at the barriers); their states merge at the end.
  static constexpr bool kSplitKeys = kSplitKeys_;
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kWindow = kWindow_;
  // A custom mask (work.cuh CustomMask): every step past the keys each query
  // sees (CustomMask::full_keys) applies the element mask, whose bits the
  // rows' queries read from global memory (L1-cached).
  static constexpr bool kCustomMask = kCustomMask_;
  static constexpr bool kSoftCap = kSoftCap_;
  static constexpr bool kLse = kLse_;

  static constexpr int kRowsPerWarp = 16 * kFragsM;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRowsPerCta = kSplitKeys ? kRowsPerWarp : kRowsPerWarp * kWarps;
  static constexpr int kKeysPerWarp = kSplitKeys ? kKeysPerTile / kWarps : kKeysPerTile;
  static constexpr int kKeysPerStep = kKeysPerWarp / kSubTiles;  // keys of one math step of a warp
  // The most rows one copy pass covers: 8 threads per row when a thread copies
  // a chunk of each 128-byte line (fa2::TileRows); a pass over whole rows
  // covers a power-of-two fraction of them.
  static constexpr int kCopyRowsPerPass = kThreads / 8;
  // A row's 16-bit data, and its pitch in the swizzled tiles: whole 128-byte
  // blocks, so that a head dim that is not a multiple of 64 (80, 96, 112, ...)
  // keeps the swizzle's conflict-free ldmatrix phases; the chunks past the
  // data are never written or read (fa2::TileRows).
  static constexpr int kRowBytes = kHeadDim * 2, kVRowBytes = kHeadDimVo * 2;
  static constexpr int kPitchBytes = (kRowBytes + 127) / 128 * 128, kVPitchBytes = (kVRowBytes + 127) / 128 * 128;
  // Shared-memory layouts (fa2_primitives.cuh): Q row-major (and O, staged in
  // the warp's Q rows on its way out); K and V blocked where the TMA unit
  // writes them.
  using QLayout = fa2::RowMajorTile<kPitchBytes>;
  using KvLayout = std::conditional_t<kTmaKv, fa2::BlockedTile<kKeysPerTile_>, fa2::RowMajorTile<kPitchBytes>>;
  using VLayout = std::conditional_t<kTmaKv, fa2::BlockedTile<kKeysPerTile_>, fa2::RowMajorTile<kVPitchBytes>>;
  // Where the K/V copies land: the ring slots themselves, or, with an FP8
  // cache, slots of codes (kHeadDim bytes a row, unswizzled) that one pass per
  // tile widens into a single K/V pair of KvLayout tiles after the ring.
  static constexpr int kKvRowBytes = kKvFp8 ? kHeadDim : kPitchBytes;
  static constexpr int kVStageRowBytes = kKvFp8 ? kHeadDimVo : kVPitchBytes;
  using KvStageLayout = std::conditional_t<kKvFp8, fa2::PlainTile<kKvRowBytes>, KvLayout>;
  using VStageLayout = std::conditional_t<kKvFp8, fa2::PlainTile<kVStageRowBytes>, VLayout>;

  static_assert(std::is_same<DType, __half>::value || std::is_same<DType, __nv_bfloat16>::value,
                "fa2 tensor-core attention takes __half or __nv_bfloat16");
  static_assert(!kKvFp8 || sizeof(KvType_) == 1, "K/V of q's dtype, or FP8 codes");
  static_assert(kHeadDim % 16 == 0 && kHeadDim >= 32 && kHeadDim <= 256, "head_dim: a multiple of 16 in [32, 256]");
  static_assert(!kTmaKv || kRowBytes % 128 == 0, "TMA K/V tiles: whole 128-byte blocks a row");
  static_assert(kHeadDimVo % 16 == 0 && kHeadDimVo >= 32 && kHeadDimVo <= kHeadDim, "head_dim_vo: [32, head_dim]");
  static_assert(kHeadDimVo == kHeadDim || (!kTmaKv_ && !kPaged_ && !kKvFp8 && !kSplitKeys_),
                "head_dim_vo != head_dim: ragged K/V of q's dtype, rows split, no TMA");
  static_assert(kKeysPerWarp % 16 == 0 && kKeysPerWarp * (kSplitKeys ? kWarps : 1) == kKeysPerTile,
                "keys per tile (per warp when warps split them): a multiple of 16");
  static_assert(kStages >= 2, "at least a 2-stage K/V pipeline");
  static_assert(kSubTiles >= 1 && kKeysPerStep % 16 == 0 && (kSubTiles == 1 || !kSplitKeys),
                "math steps: a multiple of 16 keys; split keys take whole tiles");
  static_assert(kFragsM == 1 || kFragsM == 2, "m16 fragments per warp: 1 or 2");
  static_assert(kMinBlocksPerSm >= 1, "min blocks per SM: at least 1");
  static_assert(kWarps >= 1, "at least one warp");
  static_assert(kKeysPerTile % kCopyRowsPerPass == 0 && kRowsPerCta % kCopyRowsPerPass == 0,
                "tile rows must be a multiple of the rows one copy pass covers");

  // Shared memory, in bytes: [Q | stage 0: K, V | stage 1: K, V | ...], and
  // with an FP8 cache the widened [K | V] pair after the stages; every offset
  // is a multiple of 128 bytes.
  static constexpr int kQBytes = kRowsPerCta * kPitchBytes;
  static constexpr int kKvTileBytes = kKeysPerTile * kPitchBytes;  // a K tile (and V's, head dims equal)
  static constexpr int kVTileBytes = kKeysPerTile * kVPitchBytes;
  static constexpr int kStageTileBytes = kKeysPerTile * kKvRowBytes;  // K's part of a stage; V's follows
  static constexpr int kStageBytes = kStageTileBytes + kKeysPerTile * kVStageRowBytes;
  static constexpr int kWidenedBytes = kKvFp8 ? kKvTileBytes + kVTileBytes : 0;
  // With TMA the K/V stages start at a 1024-byte boundary (the swizzle's
  // period), and 8-byte mbarriers follow them: per stage, its tile landed,
  // and with kSlotRelease every warp is done with it.
  static constexpr int kKvAlign = kTmaKv ? 1024 : 128;
  static constexpr int kStageBarriers = kTmaKv ? (kSlotRelease ? 2 : 1) : 0;
  static constexpr size_t kSmemBytes = size_t(kQBytes) + size_t(kStages) * kStageBytes + kWidenedBytes +
                                       (kTmaKv ? kKvAlign - 128 + 8 * kStageBarriers * kStages : 0);
  // Split keys: each lane's O, m and l per warp, exchanged through the stages
  // (and the widened tiles after them).
  static constexpr int kMergeValues = kFragsM * (kHeadDimVo / 8) * 4 + kFragsM * 4;
  static_assert(!kSplitKeys || size_t(kWarps) * kMergeValues * 32 * 4 <= size_t(kStages) * kStageBytes + kWidenedBytes,
                "the warps' states must fit in the K/V stages to merge");
};

}  // namespace flashjit
