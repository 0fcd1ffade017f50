// Combines partial attention states (normalised output, base-2 LSE) computed
// over disjoint key ranges into the final output and LSE:
//   M = max_s lse_s,  w_s = 2^(lse_s - M),  o = sum_s w_s o_s / sum_s w_s,
//   lse = M + log2(sum_s w_s).
// A row whose every state is empty (lse -inf) gets output 0 and LSE -inf.
// Lanes own dims lane, lane + 32, ... of a row (or of a warp's slice of it);
// where the dims are not a multiple of 32 per warp (head dims 48, 80, ...),
// some lanes have no dim in their last slot (MergeDims). Each dim's sums run
// in the same order whichever lane holds it.
#pragma once
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/chunk_fold.cuh"
#include "flashjit/common/grid_dependency.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/sink_fold.cuh"

namespace flashjit {

// The dims of a row split into kSlices slices of kPerLane 32-dim columns
// (lane-strided within a slice); MergeDims<D, 1> is one warp's whole row.
template <int kHeadDim, int kSlices = 1>
struct MergeDims {
  static constexpr int kPerLane = (kHeadDim + 32 * kSlices - 1) / (32 * kSlices);
  static constexpr int kSliceDims = 32 * kPerLane;
  // Every lane has a dim in every slot of every slice.
  static constexpr bool kFull = kHeadDim % (32 * kSlices) == 0;
  // Whether dim, a slice's dim0 + 32 i, is one of the row's (with one slice,
  // only the last i can fall past them).
  static __device__ __forceinline__ bool has(int i, int dim) {
    return kFull || (kSlices == 1 && i + 1 < kPerLane) || dim < kHeadDim;
  }
};

// The most warps (4, 2 or 1) that can share a row's dims with none left
// without any (MergeDims slices): 4 from 112 dims on, 2 from 48.
constexpr int merge_split_warps(int head_dim) {
  for (int warps = 4; warps > 1; warps /= 2) {
    const int per_lane = (head_dim + 32 * warps - 1) / (32 * warps);
    if ((warps - 1) * 32 * per_lane < head_dim) return warps;
  }
  return 1;
}

// The partial rows [first, first + count) of (token, head) `row` (see
// partial_row in work.cuh); count 0: the attention CTA wrote the row directly.
__device__ __forceinline__ void partial_rows_of(const FlashjitAttentionParams& p, int token, int64_t& first,
                                                int& count) {
  if (p.merge_indptr != nullptr) {
    first = p.merge_indptr[token];
    count = p.merge_indptr[token + 1] - p.merge_indptr[token];
  } else {
    first = int64_t(token) * p.num_splits;
    count = p.num_splits;
  }
}

// Writes the merged output row (sum of weighted partials `acc`, weights summing
// to `sum`, maximum LSE m) and its LSE, with the head's sink where the call has
// sinks (sink_fold.cuh); lane-strided dims.
template <class DTypeO, int kHeadDim, int kDimsPerLane>
__device__ __forceinline__ void store_merged(const FlashjitAttentionParams& p, int token, int head, int lane,
                                             const float (&acc)[kDimsPerLane], float sum, float m) {
  using Dims = MergeDims<kHeadDim>;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  float lse = sum > 0.f ? m + log2f(sum) : -CUDART_INF_F;
  const float factor = fold_sink(p.sinks, head, lse);
  DTypeO* out = static_cast<DTypeO*>(p.o) + token * p.o_stride_n + head * p.o_stride_h;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const float y = acc[i] * inv;
    if (Dims::has(i, lane + 32 * i)) out[lane + 32 * i] = from_float<DTypeO>(p.sinks != nullptr ? __fmul_rn(y, factor) : y);
  }
  if (p.lse != nullptr && lane == 0) p.lse[token * p.lse_stride_n + head] = lse;
}

// Both merge kernels below sum in one order, so that a row's bits do not
// depend on which of them the row count picks: state s goes to partial sum
// s % kMergeWays, each partial sum is a chain of fmaf in state order from 0,
// and the partial sums are added to 0 in order. (Batch-invariant mode folds
// instead: merge_fold_states_kernel.)
constexpr int kMergeWays = 4;

// One CTA per (token, head). A long context leaves dozens of partial rows per
// head and only a few heads to merge, so the warps split the partial rows
// (loads of several in flight each) and combine through shared memory; one
// warp walking all of them serially costs microseconds of latency.
template <class DTypeO, int kHeadDim>
__global__ void __launch_bounds__(128) merge_split_states_kernel(const __grid_constant__ FlashjitAttentionParams p) {
  allow_dependent_grids();  // the next call's grid launches while this one merges (grid_dependency.cuh)
  using Dims = MergeDims<kHeadDim>;
  constexpr int kWarps = kMergeWays, kDimsPerLane = Dims::kPerLane;
  __shared__ float s_max[kWarps], s_sum[kWarps], s_acc[kWarps][Dims::kSliceDims];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = blockIdx.x;  // token * heads + head
  const int token = row / p.num_qo_heads, head = row % p.num_qo_heads;
  int64_t first;
  int count;
  partial_rows_of(p, token, first, count);  // written by the plan, before the attention grid ran
  wait_for_primary_grid();  // partial states come from the attention grid
  if (count == 0) return;  // uniform across the CTA
  auto lse_of = [&](int s) { return p.partial_lse[(first + s) * p.num_qo_heads + head]; };

  float m = -CUDART_INF_F;
  for (int s = threadIdx.x; s < count; s += 32 * kWarps) m = fmaxf(m, lse_of(s));
  m = warp_max(m);
  if (lane == 0) s_max[warp] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = fmaxf(m, s_max[w]);

  float acc[kDimsPerLane] = {};
  float sum = 0.f;
#pragma unroll 4
  for (int s = warp; s < count; s += kWarps) {
    const float w = exp2_diff(lse_of(s), m);
    sum += w;
    const float* src = p.partial_o + ((first + s) * p.num_qo_heads + head) * kHeadDim;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i)
      if (Dims::has(i, lane + 32 * i)) acc[i] = fmaf(w, src[lane + 32 * i], acc[i]);
  }
  if (lane == 0) s_sum[warp] = sum;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) s_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  if (warp != 0) return;

  sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) sum += s_sum[w];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    acc[i] = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) acc[i] += s_acc[w][lane + 32 * i];
  }
  store_merged<DTypeO, kHeadDim>(p, token, head, lane, acc, sum, m);
}

// One warp per (token, head), four per CTA: many rows with a few partial rows
// each (a batch whose requests were cut in two or three), where the CTA per
// row above spends its time in two barriers and three idle warps.
template <class DTypeO, int kHeadDim>
__global__ void __launch_bounds__(128) merge_split_states_warp_kernel(const __grid_constant__ FlashjitAttentionParams p,
                                                                     int rows) {
  allow_dependent_grids();  // the next call's grid launches while this one merges (grid_dependency.cuh)
  using Dims = MergeDims<kHeadDim>;
  constexpr int kDimsPerLane = Dims::kPerLane;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * 4 + threadIdx.x / 32;
  if (row >= rows) return;
  const int token = row / p.num_qo_heads, head = row % p.num_qo_heads;
  int64_t first;
  int count;
  partial_rows_of(p, token, first, count);  // written by the plan, before the attention grid ran
  wait_for_primary_grid();  // partial states come from the attention grid
  if (count == 0) return;
  auto lse_of = [&](int s) { return p.partial_lse[(first + s) * p.num_qo_heads + head]; };
  float m = -CUDART_INF_F;
  for (int s = lane; s < count; s += 32) m = fmaxf(m, lse_of(s));
  m = warp_max(m);
  // The per-way sums of merge_split_states_kernel's warps, kept in registers.
  float way_acc[kMergeWays][kDimsPerLane] = {};
  float way_sum[kMergeWays] = {};
  for (int s0 = 0; s0 < count; s0 += kMergeWays) {
#pragma unroll
    for (int j = 0; j < kMergeWays; ++j) {
      const int s = s0 + j;
      if (s < count) {
        const float w = exp2_diff(lse_of(s), m);
        way_sum[j] += w;
        const float* src = p.partial_o + ((first + s) * p.num_qo_heads + head) * kHeadDim;
#pragma unroll
        for (int i = 0; i < kDimsPerLane; ++i)
          if (Dims::has(i, lane + 32 * i)) way_acc[j][i] = fmaf(w, src[lane + 32 * i], way_acc[j][i]);
      }
    }
  }
  float acc[kDimsPerLane], sum = 0.f;
#pragma unroll
  for (int j = 0; j < kMergeWays; ++j) sum += way_sum[j];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    acc[i] = 0.f;
#pragma unroll
    for (int j = 0; j < kMergeWays; ++j) acc[i] += way_acc[j][i];
  }
  store_merged<DTypeO, kHeadDim>(p, token, head, lane, acc, sum, m);
}

// A global load issued where the code places it: the compiler sinks a plain
// one to its first use, behind the block's prefix maximum (SASS).
__device__ __forceinline__ float load_issued_here(const float* src) {
  float v;
  asm volatile("ld.global.f32 %0, [%1];\n" : "=f"(v) : "l"(src));
  return v;
}

// Batch-invariant mode (p.invariant_chunk != 0): each (token, head) row folds
// its chunk states in chunk order (chunk_fold.cuh), exactly as an fa3 CTA that
// walks a row's chunks itself, so that a row's bits do not depend on whether
// its chunks were split across CTAs. Only the accumulator and the weight sum
// are chains: for 32 states at a time, lane j reads state j's LSE, a prefix
// maximum across the lanes gives each state's running maxima before and after
// it (maxima are exact: the sequential fold's values), and lane j its weights;
// the chains then take them by shuffle, one FMA pair per state and element,
// on outputs loaded kAhead states at a time. kWarpsPerRow warps take a row's
// dims apart (a long context over few rows: 128k keys are 64 states).
// The kernel is the tail of a call, so its memory round trips are counted in
// latency: the plan's indptr is read before the wait for the attention grid,
// the next block's LSEs while this block folds, and (few rows) a block's first
// outputs go out with its LSEs, ahead of the prefix maximum.
template <class DTypeO, int kHeadDim, int kWarpsPerRow>
__global__ void __launch_bounds__(128) merge_fold_states_kernel(const __grid_constant__ FlashjitAttentionParams p,
                                                                int rows) {
  allow_dependent_grids();  // the next call's grid launches while this one folds (grid_dependency.cuh)
  static_assert(4 % kWarpsPerRow == 0, "whole rows per CTA");
  using Dims = MergeDims<kHeadDim, kWarpsPerRow>;
  constexpr int kDimsPerLane = Dims::kPerLane;
  constexpr int kAhead = kDimsPerLane >= 3 ? 8 : 32 / kDimsPerLane;  // states whose outputs load together
  // Few rows (several warps a row): a block's first outputs load before its
  // prefix maximum, the call's tail being a chain of round trips. Many rows: at
  // their use, as registers live across the maximum would halve the CTAs an SM
  // holds (62 -> 128 registers at d64), and the rows' CTAs hide the latency.
  constexpr bool kLoadsFirst = kWarpsPerRow > 1;
  const float kNegInf = -CUDART_INF_F;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = blockIdx.x * (4 / kWarpsPerRow) + warp / kWarpsPerRow;
  if (row >= rows) return;
  const int dim0 = (warp % kWarpsPerRow) * Dims::kSliceDims + lane;
  const int token = row / p.num_qo_heads, head = row % p.num_qo_heads;
  int64_t first;
  int count;
  partial_rows_of(p, token, first, count);  // written by the plan, before the attention grid ran
  wait_for_primary_grid();  // partial states come from the attention grid
  if (count == 0) return;
  ChunkFold fold;
  fold.reset();
  float acc[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) acc[i] = 0.f;
  auto row_of = [&](int s) { return (first + s) * p.num_qo_heads + head; };
  float o[kAhead][kDimsPerLane];
  auto load_outputs = [&](int s) {
#pragma unroll
    for (int j = 0; j < kAhead; ++j)
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const bool dim = Dims::has(i, dim0 + 32 * i);
        if constexpr (kLoadsFirst) {  // only the row's states
          o[j][i] = s + j < count && dim ? load_issued_here(p.partial_o + row_of(s + j) * kHeadDim + dim0 + 32 * i)
                                         : 0.f;
        } else {  // past the row: its last state again, an L1 hit (fewer registers than a predicate)
          o[j][i] = dim ? p.partial_o[row_of(min(s + j, count - 1)) * kHeadDim + dim0 + 32 * i] : 0.f;
        }
      }
  };
  auto lse_at = [&](int s) { return s < count ? load_issued_here(p.partial_lse + row_of(s)) : kNegInf; };
  float lse_next = lse_at(lane);
  for (int s0 = 0; s0 < count; s0 += 32) {
    const int n = min(32, count - s0);
    const float lse = lse_next;
    if constexpr (kLoadsFirst) load_outputs(s0);
    lse_next = lse_at(s0 + 32 + lane);
    float m_after = lse;  // inclusive prefix maximum over this block's lanes, then the earlier blocks'
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const float other = __shfl_up_sync(0xffffffffu, m_after, d);
      if (lane >= d) m_after = fmaxf(m_after, other);
    }
    m_after = fmaxf(fold.m, m_after);
    float m_before = __shfl_up_sync(0xffffffffu, m_after, 1);
    if (lane == 0) m_before = fold.m;
    float a_lane, b_lane;
    ChunkFold::weights(m_before, m_after, lse, a_lane, b_lane);
    for (int j0 = 0; j0 < n; j0 += kAhead) {
      if (!kLoadsFirst || j0 > 0) load_outputs(s0 + j0);
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        const float a = __shfl_sync(0xffffffffu, a_lane, (j0 + j) & 31);
        const float b = __shfl_sync(0xffffffffu, b_lane, (j0 + j) & 31);
        if (j0 + j < n) {
          fold.add_weights(a, b);
#pragma unroll
          for (int i = 0; i < kDimsPerLane; ++i) acc[i] = ChunkFold::fold(acc[i], a, b, o[j][i]);
        }
      }
    }
    fold.m = __shfl_sync(0xffffffffu, m_after, n - 1);
  }
  const float inv = fold.inv_sum();
  float lse = fold.lse();
  const float factor = fold_sink(p.sinks, head, lse);  // 1 without sinks: the product below is exact
  DTypeO* out = static_cast<DTypeO*>(p.o) + token * p.o_stride_n + head * p.o_stride_h;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i)
    if (Dims::has(i, dim0 + 32 * i)) out[dim0 + 32 * i] = from_float<DTypeO>(__fmul_rn(__fmul_rn(acc[i], inv), factor));
  if (p.lse != nullptr && dim0 == 0) p.lse[token * p.lse_stride_n + head] = lse;
}

// Rows from which the merge takes a warp per row (256 CTAs of four warps).
constexpr int kWarpMergeRows = 1024;

// Runs after the attention kernel when any CTA wrote partial state.
template <class DTypeO, int kHeadDim>
int launch_merge_split_states(const FlashjitAttentionParams& p, bool write_lse, cudaStream_t stream) {
  const int rows = p.qo_len * p.num_qo_heads;
  if (rows == 0) return cudaSuccess;
  FlashjitAttentionParams merged = p;
  if (!write_lse) merged.lse = nullptr;
  if (p.invariant_chunk != 0) {
    // Few rows (long contexts in small batches): up to four warps per row.
    constexpr int kSplitWarps = merge_split_warps(kHeadDim);
    if (rows >= kWarpMergeRows) {
      return launch_dependent(merge_fold_states_kernel<DTypeO, kHeadDim, 1>, dim3((rows + 3) / 4), dim3(128), 0,
                              stream, merged, rows);
    }
    return launch_dependent(merge_fold_states_kernel<DTypeO, kHeadDim, kSplitWarps>,
                            dim3((rows * kSplitWarps + 3) / 4), dim3(128), 0, stream, merged, rows);
  }
  // Rows enough to fill the GPU four to a CTA: a warp per row. Else (a long
  // context cut into many chunks over few rows) a CTA per row.
  if (rows >= kWarpMergeRows) {
    return launch_dependent(merge_split_states_warp_kernel<DTypeO, kHeadDim>, dim3((rows + 3) / 4), dim3(128), 0, stream,
                            merged, rows);
  }
  return launch_dependent(merge_split_states_kernel<DTypeO, kHeadDim>, dim3(rows), dim3(128), 0, stream, merged);
}

// True when the attention launch leaves partial states for the merge pass.
__host__ __forceinline__ bool has_partial_states(const FlashjitAttentionParams& p) {
  return p.merge_indptr != nullptr || (p.qo_indptr == nullptr && p.num_splits > 1);
}

}  // namespace flashjit
