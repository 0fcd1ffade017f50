// Compile-time shape of one fa3 attention kernel (fa3_attention.cuh): its
// tiling (rendered from flashjit/kernels/fa3.py's Fa3Tiling), the variant
// flags, and the shared-memory layout derived from them.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <type_traits>
#include "flashjit/fa2/fa2_primitives.cuh"

namespace flashjit {

template <class DType_, int kHeadDim_, int kKeysPerTile_, int kStages_, bool kOverlap_, bool kPersistent_,
          bool kPaged_, bool kCausal_, bool kWindow_, bool kSoftCap_, bool kLse_, int kConsumerWarpgroups_ = 2,
          bool kChunkFold_ = false, int kHeadDimVo_ = kHeadDim_>
struct Fa3Traits {
  using DType = DType_;
  // K/V of DType; an FP8 cache derives Fa3Fp8Traits (fa3_fp8.cuh) from these.
  using KvType = DType_;
  static constexpr bool kKvFp8 = false;
  static constexpr int kHeadDim = kHeadDim_;
  // V's and O's width: kHeadDim, or narrower (192/128, DeepSeek's prefill;
  // ragged and single prefill only, whose K/V come by whole-tensor TMA maps).
  static constexpr int kHeadDimVo = kHeadDimVo_;
  static constexpr int kKeysPerTile = kKeysPerTile_;
  static constexpr int kStages = kStages_;
  // A consumer issues tile t's Q.K^T together with tile t - 1's P.V and runs
  // the softmax of t while P.V still runs: two sets of P registers, and a
  // slot's V is held one tile longer than its K.
  static constexpr bool kOverlap = kOverlap_;
  // One CTA per SM walks the launch positions in turn, so that the loader
  // starts the next position's tiles while the consumers finish the last
  // one's (fa3_launch.cuh; otherwise one CTA per position).
  static constexpr bool kPersistent = kPersistent_;
  // K/V from a paged cache (pages in any order, any page size): whole tiles by
  // TMA page boxes where the page size allows, else gathered by the loader
  // warpgroup's cp.async.
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kWindow = kWindow_;
  static constexpr bool kSoftCap = kSoftCap_;
  static constexpr bool kLse = kLse_;
  // Batch-invariant mode's kernel (p.invariant_chunk > 0, fa3_launch.cuh): a
  // CTA folds the states of the chunks its keys span (fa3_attention.cuh). A
  // kernel of its own, so that normal mode's carries none of that code.
  static constexpr bool kChunkFold = kChunkFold_;
  using WithChunkFold = Fa3Traits<DType_, kHeadDim_, kKeysPerTile_, kStages_, kOverlap_, kPersistent_, kPaged_,
                                  kCausal_, kWindow_, kSoftCap_, kLse_, kConsumerWarpgroups_, true, kHeadDimVo_>;

  // Warpgroup 0 loads K/V (one thread issues the TMA copies); warpgroups 1 and
  // 2 each own 64 rows of the CTA's 128 and run their matrix products and
  // softmax independently, so that one's softmax overlaps the other's wgmma.
  // Decode takes one consumer (64 rows): a KV head's query heads fill a few of
  // them, and a second warpgroup would double the products for rows of padding.
  static constexpr int kConsumerWarpgroups = kConsumerWarpgroups_;
  static_assert(kConsumerWarpgroups == 1 || kConsumerWarpgroups == 2, "one or two consumer warpgroups");
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kRowsPerWarpgroup = 64;
  static constexpr int kRowsPerCta = kRowsPerWarpgroup * kConsumerWarpgroups;
  static constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;
  // Registers per thread after setmaxnreg: the loader gives its share to the
  // consumers, whose S (kKeysPerTile / 2), O (kHeadDim / 2) and P registers
  // need it. 128 * (40 + 2 * 232) = 64512 of the SM's 65536. A paged loader
  // keeps each thread's copy addresses and row pages: 56, the consumers 224.
  // With a lone consumer (decode) there is room for 56 and 240: at 40 and 224
  // ptxas spilled 4-12 bytes.
  static constexpr int kLoaderThreads = 128;
  static constexpr int kLoaderRegs = kPaged || kConsumerWarpgroups == 1 ? 56 : 40;
  static constexpr int kConsumerRegs = kConsumerWarpgroups == 1 ? 240 : kPaged ? 224 : 232;
  static_assert(kLoaderThreads * (kLoaderRegs + kConsumerWarpgroups * kConsumerRegs) <= 65536, "the SM's registers");

  // What fa2::WarpSoftmax and fa2::store_rows read: each warp of a consumer
  // warpgroup holds one m16 fragment of rows (the wgmma accumulator layout),
  // and a tile is one softmax step.
  static constexpr int kFragsM = 1;
  static constexpr int kRowsPerWarp = 16;
  static constexpr int kKeysPerStep = kKeysPerTile;
  static constexpr bool kSplitKeys = false;
  // Q, K and V as TMA's 128-byte swizzle writes them: 64-column blocks of
  // 128-byte rows, the layout the wgmma descriptors (fa3_wgmma.cuh) describe.
  // A head dim that is not whole blocks (96) takes a last block that is only
  // partly data: Q.K^T stops at the data's last k-step, P.V runs on the whole
  // block (an MN-major operand with the 128-byte swizzle spans 64 columns) and
  // the output columns past the data are never stored, so what the padding
  // holds (zeros from TMA, or stale bytes) reaches no stored value.
  static constexpr int kTileCols = (kHeadDim + 63) / 64 * 64;
  static constexpr int kVoTileCols = (kHeadDimVo + 63) / 64 * 64;
  static constexpr int kPitchBytes = kTileCols * 2;
  static constexpr int kVoPitchBytes = kVoTileCols * 2;
  using QLayout = fa2::RowMajorTile<kPitchBytes>;  // the output staging of fa2::store_rows
  using QTile = fa2::BlockedTile<kRowsPerWarpgroup>;
  using KvLayout = fa2::BlockedTile<kKeysPerTile>;
  // What each copy of a row moves (fa2::TileRows): 128-byte lines, or where a
  // row is not whole lines, the whole row (Q) or 64-byte halves (the paged
  // gather, whose threads hold a page per row they copy: 4 threads a row
  // instead of 16 keep the loader's 56 registers clear of spills).
  static constexpr bool kWholeLines = kHeadDim * 2 % 128 == 0;
  static constexpr int kCopySpan = kWholeLines ? 128 : kHeadDim * 2;
  static constexpr int kGatherSpan = kWholeLines ? 128 : 64;

  static_assert(std::is_same<DType, __half>::value || std::is_same<DType, __nv_bfloat16>::value,
                "fa3 attention takes __half or __nv_bfloat16");
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "fa3 head_dim: 64, 96, 128, 192 or 256");
  static_assert(kHeadDimVo == kHeadDim || (kHeadDim == 192 && kHeadDimVo == 128 && !kPaged),
                "fa3 head_dim_vo: head_dim, or 128 beside 192 (not paged)");
  static_assert(kKeysPerTile == 64 || kKeysPerTile == 128, "fa3 keys per tile: 64 or 128 (S's wgmma N)");
  static_assert(kStages >= 2, "at least a 2-stage K/V pipeline");

  // Shared memory, in bytes, from a 1024-byte boundary (the swizzle's period):
  // [stage 0: K, V | stage 1: K, V | ... | Q of warpgroup 1, 2 | mbarriers].
  // A slot's V starts kKTileBytes after its K.
  static constexpr int kKTileBytes = kKeysPerTile * kPitchBytes;
  static constexpr int kVTileBytes = kKeysPerTile * kVoPitchBytes;
  static constexpr int kStageBytes = kKTileBytes + kVTileBytes;
  static constexpr int kQOffset = kStages * kStageBytes;
  static constexpr int kQWarpgroupBytes = kRowsPerWarpgroup * kPitchBytes;
  // Q buffers a consumer warpgroup cycles through (Fa3QPrefetchTraits: 2).
  static constexpr int kQBuffers = 1;
  // The consumers take turns issuing their products (Fa3PingPongTraits).
  static constexpr bool kPingPong = false;
  static constexpr int kBarOffset = kQOffset + kConsumerWarpgroups * kQWarpgroupBytes;
  // Per stage, for K and V each: "full" (its tile landed) and "empty" (every
  // consumer warp is done with it).
  static constexpr size_t kSmemBytes = 1024 + size_t(kBarOffset) + 32 * kStages;
  // fa2::store_rows stages a warp's output rows at smem + warp * 16 rows: the
  // consumer warps (4 .. 11) land on their own warpgroup's Q rows from this base.
  static constexpr int kStoreBase = kQOffset - 4 * kRowsPerWarp * kPitchBytes;
  static_assert(kStoreBase >= 0, "the output staging base lies inside shared memory");
};

// A persistent grid's consumers with a second Q buffer each: a position's Q is
// copied while the position before it runs (fa3_attention.cuh), so the copy's
// latency leaves each position's start. One more Q's worth of shared memory
// before the mbarriers (Fa3Tiling.q_buffers mirrors it).
template <class Base>
struct Fa3QPrefetchTraits : Base {
  static constexpr int kQBuffers = 2;
  static constexpr int kBarOffset = Base::kQOffset + kQBuffers * Base::kConsumerWarpgroups * Base::kQWarpgroupBytes;
  static constexpr size_t kSmemBytes = 1024 + size_t(kBarOffset) + 32 * Base::kStages;
  using WithChunkFold = Fa3QPrefetchTraits<typename Base::WithChunkFold>;
  static_assert(Base::kPersistent && !Base::kKvFp8, "a second Q buffer: persistent grids of 16-bit K/V");
};

// The two consumer warpgroups take turns issuing their products, each turn
// handed over by a named barrier (fa3_attention.cuh), so that one's softmax
// runs while the other's products hold the tensor cores, instead of both
// drifting freely. Ragged and single prefill only: in the paged kernels ptxas
// then serialized every wgmma (C7520, the gathered tiles' proxy fence before
// the turn), so they keep the free-running consumers.
template <class Base>
struct Fa3PingPongTraits : Base {
  static constexpr bool kPingPong = !Base::kPaged;
  using WithChunkFold = Fa3PingPongTraits<typename Base::WithChunkFold>;
  static_assert(Base::kOverlap && Base::kConsumerWarpgroups == 2, "turns: two overlapped consumer warpgroups");
};

}  // namespace flashjit
