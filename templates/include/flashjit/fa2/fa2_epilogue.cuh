// The end of an fa2 CTA (fa2_attention.cuh): in split-keys mode warp 0 takes
// over the other warps' softmax states; then every warp normalises its rows of
// O and writes them with their LSE, or, for a split-KV chunk, the fp32 partial
// state that the merge pass (merge_states.cuh) combines.
#pragma once
#include <stdint.h>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/chunk_fold.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/sink_fold.cuh"
#include "flashjit/common/work.cuh"

namespace flashjit {
namespace fa2 {

// Per lane of a warp: O accumulators o[f][n][e] (row 16f + g + 8 * (e / 2) of
// the warp, head dims 8n + 2 * tq + e % 2), the running max m[f][r] in logit
// units before `scale`, and this lane's partial row sum l[f][r].
template <class Traits>
using WarpO = float[Traits::kFragsM][Traits::kHeadDimVo / 8][4];
template <class Traits>
using WarpRows = float[Traits::kFragsM][2];

// Split keys: the warps share the rows, so warp 0 merges the others' states
// (m, per-lane partial l, O) lane by lane, each at its own positions, through
// the stage buffers, laid out [warp][value][lane] (conflict-free). Returns
// whether this warp goes on to write the rows (warp 0 only).
template <class Traits>
__device__ __forceinline__ bool merge_warp_states(WarpO<Traits>& o, WarpRows<Traits>& m, WarpRows<Traits>& l,
                                                  unsigned char* smem, float scale) {
  constexpr int FM = Traits::kFragsM, NT_O = Traits::kHeadDimVo / 8, V = Traits::kMergeValues;
  const float kNegInf = -CUDART_INF_F;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  cp_async_wait<0>();  // only empty groups can still be pending
  __syncthreads();     // every warp is done reading the stages
  float* xchg = reinterpret_cast<float*>(smem + Traits::kQBytes);
  if (warp > 0) {
    float* mine = xchg + (warp * V) * 32 + lane;
#pragma unroll
    for (int f = 0; f < FM; ++f) {
#pragma unroll
      for (int n = 0; n < NT_O; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine[((f * NT_O + n) * 4 + e) * 32] = o[f][n][e];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mine[(FM * NT_O * 4 + f * 4 + r) * 32] = m[f][r];
        mine[(FM * NT_O * 4 + f * 4 + 2 + r) * 32] = l[f][r];
      }
    }
  }
  __syncthreads();
  if (warp > 0) return false;
  for (int other = 1; other < Traits::kWarps; ++other) {
    const float* theirs = xchg + (other * V) * 32 + lane;
#pragma unroll
    for (int f = 0; f < FM; ++f)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_other = theirs[(FM * NT_O * 4 + f * 4 + r) * 32];
        const float l_other = theirs[(FM * NT_O * 4 + f * 4 + 2 + r) * 32];
        const float m_new = fmaxf(m[f][r], m_other);
        // A state that has seen no key (m = -inf) weighs 0, without a NaN.
        const float a = m[f][r] == kNegInf ? 0.f : exp2_fast((m[f][r] - m_new) * scale);
        const float b = m_other == kNegInf ? 0.f : exp2_fast((m_other - m_new) * scale);
        m[f][r] = m_new;
        l[f][r] = l[f][r] * a + l_other * b;
#pragma unroll
        for (int n = 0; n < NT_O; ++n)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e)
            o[f][n][e] = o[f][n][e] * a + theirs[((f * NT_O + n) * 4 + e) * 32] * b;
      }
  }
  return true;
}

// Per row of this lane: the full row sum (l quad-reduced in place), the
// output factor 1/l and the base-2 LSE m * scale + log2(l); a row that saw no
// key (kv_len 0, or fully masked) gets 0 and -inf. Its roundings are spelled
// out, as in fa2_softmax.cuh, so that no row's is fused: the factors of a
// chunk's state must be the same bits wherever it is computed (chunk_fold.cuh).
template <class Traits>
__device__ __forceinline__ void row_factors(const WarpRows<Traits>& m, WarpRows<Traits>& l, float scale,
                                            float (&inv_l)[Traits::kFragsM][2], float (&lse)[Traits::kFragsM][2]) {
#pragma unroll
  for (int f = 0; f < Traits::kFragsM; ++f)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[f][r] += __shfl_xor_sync(0xffffffffu, l[f][r], 1);
      l[f][r] += __shfl_xor_sync(0xffffffffu, l[f][r], 2);
      inv_l[f][r] = l[f][r] > 0.f ? 1.f / l[f][r] : 0.f;
      lse[f][r] = l[f][r] > 0.f ? __fadd_rn(__fmul_rn(m[f][r], scale), log2f(l[f][r])) : -CUDART_INF_F;
    }
}

// O times each row's factor inv_l, then either the fp32 partial state of a
// split-KV chunk, or O staged through this warp's own Q rows of shared memory
// (same swizzle) and written in 16-byte vectors, and the LSE. Rows at or past
// rows_total are padding and write nothing.
template <class Traits>
__device__ __forceinline__ void write_rows(const FlashjitAttentionParams& p, const CtaWork& w, const WarpO<Traits>& o,
                                           const float (&inv_l)[Traits::kFragsM][2],
                                           const float (&lse)[Traits::kFragsM][2], unsigned char* smem,
                                           int warp_row0, int rows_total) {
  using T = typename Traits::DType;
  constexpr int D = Traits::kHeadDimVo, FM = Traits::kFragsM, NT_O = D / 8;
  constexpr int WROWS = Traits::kRowsPerWarp, PITCH = Traits::QLayout::kPitch;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, tq = lane % 4;
  const auto packed = w.packed_rows();
  if (w.split >= 0) {
    // Split-KV chunk: fp32 normalised output and LSE as partial state; the
    // merge pass rounds once to T.
#pragma unroll
    for (int f = 0; f < FM; ++f)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + 16 * f + g + 8 * r;
        if (row >= rows_total) continue;
        int token, head;
        packed.locate(row, token, head);
        const int64_t idx = partial_row(p, token, w.split) * p.num_qo_heads + head;
        float* dst = p.partial_o + idx * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < NT_O; ++n)
          *reinterpret_cast<float2*>(dst + 8 * n) =
              make_float2(o[f][n][2 * r] * inv_l[f][r], o[f][n][2 * r + 1] * inv_l[f][r]);
        if (tq == 0) p.partial_lse[idx] = lse[f][r];
      }
    return;
  }
  // Attention sinks (sink_fold.cuh): each row's output factor and its LSE with the sink.
  const bool has_sinks = p.sinks != nullptr;
  float sink_factor[FM][2], lse_out[FM][2];
#pragma unroll
  for (int f = 0; f < FM; ++f)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lse_out[f][r] = lse[f][r];
      sink_factor[f][r] = 1.f;
      const int row = warp_row0 + 16 * f + g + 8 * r;
      if (has_sinks && row < rows_total) {
        int token, head;
        packed.locate(row, token, head);
        sink_factor[f][r] = fold_sink(p.sinks, head, lse_out[f][r]);
      }
    }
  auto out = [&](float x, int f, int r) {
    const float y = x * inv_l[f][r];
    return has_sinks ? __fmul_rn(y, sink_factor[f][r]) : y;
  };
  unsigned char* stage = smem + warp * WROWS * PITCH;
  __syncwarp();  // all lanes' last reads of the warp's Q rows are done
#pragma unroll
  for (int f = 0; f < FM; ++f)
#pragma unroll
    for (int n = 0; n < NT_O; ++n) {
      // Row 16f + g (and + 8), logical chunk n, word tq; (16f + g + 8) % 8 == g.
      const int at = (16 * f + g) * PITCH + ((n ^ g) << 4) + tq * 4;
      *reinterpret_cast<uint32_t*>(stage + at) = pack2<T>(out(o[f][n][0], f, 0), out(o[f][n][1], f, 0));
      *reinterpret_cast<uint32_t*>(stage + at + 8 * PITCH) = pack2<T>(out(o[f][n][2], f, 1), out(o[f][n][3], f, 1));
    }
  __syncwarp();
  {
    // Lane l stores chunk l % kLanes of rows l / kLanes + kRowStep * i: a
    // row's D / 8 chunks, rounded up to a power of two of lanes (the lanes
    // past them store nothing at head dims 48, 80, 96, ...).
    constexpr int kChunks = D / 8, kLanes = pow2_at_least(kChunks);
    constexpr int kRowStep = 32 / kLanes;
    static_assert(kLanes <= 32 && WROWS % kRowStep == 0, "a warp covers whole rows of the output");
    T* o_base = static_cast<T*>(p.o);
    const int rr0 = lane / kLanes, c = lane % kLanes;
    auto rows = packed.template walk<kRowStep>(warp_row0 + rr0, p.o_stride_n, p.o_stride_h);
#pragma unroll
    for (int i = 0; i < WROWS / kRowStep; ++i) {
      const int rr = rr0 + i * kRowStep;
      if (c < kChunks && warp_row0 + rr < rows_total) {
        const uint4 val = *reinterpret_cast<const uint4*>(stage + Traits::QLayout::at(rr, c));
        *reinterpret_cast<uint4*>(o_base + rows.offset + c * 8) = val;
      }
      rows.next();
    }
  }
  if (Traits::kLse && p.lse != nullptr && tq == 0) {
#pragma unroll
    for (int f = 0; f < FM; ++f)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + 16 * f + g + 8 * r;
        if (row < rows_total) {
          int token, head;
          packed.locate(row, token, head);
          p.lse[int64_t(token) * p.lse_stride_n + head] = lse_out[f][r];
        }
      }
  }
}

// The end of a CTA that wrote its rows from one state (m, l, O).
template <class Traits>
__device__ __forceinline__ void store_rows(const FlashjitAttentionParams& p, const CtaWork& w, WarpO<Traits>& o,
                                           WarpRows<Traits>& m, WarpRows<Traits>& l, unsigned char* smem,
                                           int warp_row0, int rows_total, float scale) {
  float inv_l[Traits::kFragsM][2], lse[Traits::kFragsM][2];
  row_factors<Traits>(m, l, scale, inv_l, lse);
  write_rows<Traits>(p, w, o, inv_l, lse, smem, warp_row0, rows_total);
}

// Batch-invariant mode in a CTA whose keys span several chunks (see
// invariant_chunk in attention_params.cuh): at each chunk boundary the chunk's
// state (m, l, O) folds into the running merge of its rows (chunk_fold.cuh).
// The merge waits in the CTA's slot of global scratch, not in registers, which
// the main loop has none to spare for (fa3 d256: O alone is 128 per thread):
// per thread, its accumulator as float4 columns [n][thread] (a warp's accesses
// are whole lines), then its rows' running (m, sum) pairs [f][thread].
template <class Traits>
struct ChunkMerge {
  static constexpr int FM = Traits::kFragsM, NT_O = Traits::kHeadDimVo / 8;

  // The slot's loads and stores ask L2 to keep its lines (evict_last): a
  // persistent CTA reuses one slot at every boundary, and the K/V streaming
  // past would otherwise evict it to device memory between two boundaries.
  static __device__ __forceinline__ uint64_t keep_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    return policy;
  }
  static __device__ __forceinline__ float4 load(const float4* at, uint64_t policy) {
    float4 v;
    asm volatile("ld.global.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(at), "l"(policy));
    return v;
  }
  static __device__ __forceinline__ void store(float4* at, float4 v, uint64_t policy) {
    asm volatile("st.global.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(at), "f"(v.x), "f"(v.y),
                 "f"(v.z), "f"(v.w), "l"(policy)
                 : "memory");
  }
  // Floats of scratch per CTA row: its accumulator, and the (m, sum) of its
  // pair of rows that each of the four lanes of its quad keeps (8 floats):
  // 2 * rows / FM threads of FM * NT_O + FM float4s each.
  static constexpr int kFloatsPerRow = Traits::kHeadDimVo + 8;

  // Folds the chunk state (m, l, O) in after `folded` earlier chunks (0: the
  // scratch holds nothing yet): into the scratch (keep), or, for the last
  // chunk, into O, which then holds the merged accumulator, and the rows'
  // output factor and LSE into inv / lse. slot: the CTA's scratch; thread,
  // threads: this thread's index among the `threads` that share it.
  template <int kThreads>
  static __device__ __forceinline__ void fold(WarpO<Traits>& o, const WarpRows<Traits>& m, WarpRows<Traits>& l,
                                              float scale, float* slot, int thread, bool folded, bool keep,
                                              float (&inv)[FM][2], float (&lse)[FM][2]) {
    float4* acc_at = reinterpret_cast<float4*>(slot) + thread;
    float4* rows_at = acc_at + FM * NT_O * kThreads;
    const uint64_t policy = keep_policy();
    float inv_l[FM][2], lse_c[FM][2], a[FM][2], b[FM][2];
    row_factors<Traits>(m, l, scale, inv_l, lse_c);
#pragma unroll
    for (int f = 0; f < FM; ++f) {
      ChunkFold rows[2];
      if (folded) {
        const float4 saved = load(rows_at + f * kThreads, policy);
        rows[0] = {saved.x, saved.y};
        rows[1] = {saved.z, saved.w};
      } else {
        rows[0].reset();
        rows[1].reset();
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        rows[r].add(lse_c[f][r], a[f][r], b[f][r]);
        inv[f][r] = rows[r].inv_sum();
        lse[f][r] = rows[r].lse();
      }
      if (keep) store(rows_at + f * kThreads, make_float4(rows[0].m, rows[0].sum, rows[1].m, rows[1].sum), policy);
    }
#pragma unroll
    for (int f = 0; f < FM; ++f)
#pragma unroll
      for (int n = 0; n < NT_O; ++n) {
        float4* at = acc_at + (f * NT_O + n) * kThreads;
        const float4 acc = folded ? load(at, policy) : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 v = make_float4(ChunkFold::fold(acc.x, a[f][0], b[f][0], o[f][n][0] * inv_l[f][0]),
                                     ChunkFold::fold(acc.y, a[f][0], b[f][0], o[f][n][1] * inv_l[f][0]),
                                     ChunkFold::fold(acc.z, a[f][1], b[f][1], o[f][n][2] * inv_l[f][1]),
                                     ChunkFold::fold(acc.w, a[f][1], b[f][1], o[f][n][3] * inv_l[f][1]));
        if (keep) {
          store(at, v, policy);
        } else {
          o[f][n][0] = v.x;
          o[f][n][1] = v.y;
          o[f][n][2] = v.z;
          o[f][n][3] = v.w;
        }
      }
  }
};

// The LSE of output row (token, head), where the call asked for it.
__device__ __forceinline__ void store_mla_lse(const FlashjitAttentionParams& p, int token, int head, float lse) {
  if (p.lse != nullptr) p.lse[int64_t(token) * p.lse_stride_n + head] = lse;
}

// One packed row of an MLA CTA (fa2_mla.cuh, fa3/fa3_mla.cuh): this lane's
// columns col0 + 8n, col0 + 8n + 1 of O (o[n][2r], o[n][2r + 1]) times inv_l,
// rounded into the output, or, for a split-KV chunk, as fp32 partial state;
// with `writes_lse`, this lane also writes the row's LSE.
template <class T, int kVoDim, bool kLse, int NT>
__device__ __forceinline__ void store_mla_row(const FlashjitAttentionParams& p, const CtaWork& w, int token, int head,
                                              const float (&o)[NT][4], int r, float inv_l, float lse, int col0,
                                              bool writes_lse) {
  if (w.split >= 0) {
    // Split-KV chunk: fp32 normalised output and LSE; the merge pass rounds once.
    const int64_t idx = partial_row(p, token, w.split) * p.num_qo_heads + head;
    float* dst = p.partial_o + idx * kVoDim + col0;
#pragma unroll
    for (int n = 0; n < NT; ++n)
      *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[n][2 * r] * inv_l, o[n][2 * r + 1] * inv_l);
    if (writes_lse) p.partial_lse[idx] = lse;
  } else {
    T* dst = static_cast<T*>(p.o) + int64_t(token) * p.o_stride_n + int64_t(head) * p.o_stride_h + col0;
#pragma unroll
    for (int n = 0; n < NT; ++n)
      *reinterpret_cast<uint32_t*>(dst + 8 * n) = pack2<T>(o[n][2 * r] * inv_l, o[n][2 * r + 1] * inv_l);
    if (kLse && writes_lse) store_mla_lse(p, token, head, lse);
  }
}

// A lane's two rows' 1 / sum and LSE (m_ref + log2(sum)); a row that saw no
// key (kv_len 0, or fully masked: sum 0) outputs 0, LSE -inf.
__device__ __forceinline__ void mla_row_norms(const float (&sum)[2], const float (&m_ref)[2], float (&inv_l)[2],
                                              float (&lse)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    inv_l[r] = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
    lse[r] = sum[r] > 0.f ? m_ref[r] + log2f(sum[r]) : -CUDART_INF_F;
  }
}

// A warpgroup's two rows of an MLA CTA's output (rows row_in_cta[r] from
// w.row_begin, those below rows_total): O / sum, and the LSE m_ref + log2(sum)
// where writes_lse (mla_row_norms).
template <class T, int kVoDim, bool kLse, int NT>
__device__ __forceinline__ void store_mla_rows(const FlashjitAttentionParams& p, const CtaWork& w,
                                               const float (&o)[NT][4], const float (&sum)[2],
                                               const float (&m_ref)[2], const int (&row_in_cta)[2], int rows_total,
                                               int col0, bool writes_lse) {
  float inv_l[2], lse[2];
  mla_row_norms(sum, m_ref, inv_l, lse);
  const auto packed = w.packed_rows();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = w.row_begin + row_in_cta[r];
    if (row >= rows_total) continue;
    int token, head;
    packed.locate(row, token, head);
    store_mla_row<T, kVoDim, kLse>(p, w, token, head, o, r, inv_l[r], lse[r], col0, writes_lse);
  }
}

}  // namespace fa2
}  // namespace flashjit
