// How the fa3 MLA kernels (fa3_mla.cuh, fa3_mla_pairs.cuh) write their output:
// staged through Q's shared memory, which no product reads any more, and
// copied out a row at a time by the bulk copy engine.
//
// Why: written straight from the accumulators, each lane stores 4 bytes at a
// time, and a warp's store touches 8 rows at once; a CTA's 64 rows took that
// way as long as one and a half steps of the main loop on the 128-head row,
// once for each of the row's two waves (benchmarks/dev/mla_pairs_trace.py
// stamps it; docs/mla.md, "Output by bulk copies"). Staging writes shared
// memory conflict-free (rows kStagedRowBytes
// apart, 16 bytes past 1 KB, put the 8 rows of a warp's store in 8 different
// bank quads), and each warpgroup's 512 bytes of a row leave by one bulk copy.
// The copies take what the SMs' write rate allows when a wave ends, which 8 KB
// copies and 16-byte stores reach alike.
//
// Every output row starts 16-byte aligned, as the bulk copy needs: the MLA
// wrapper takes only outputs whose base and strides allow 16-byte vectors
// (ops._checks.check_vector_aligned). Split-KV chunks (fp32 partial rows) keep
// the direct stores (fa2::store_mla_rows).
#pragma once
#include <stdint.h>
#include "flashjit/common/attention_params.cuh"
#include "flashjit/common/tma.cuh"
#include "flashjit/common/work.cuh"
#include "flashjit/fa2/fa2_epilogue.cuh"
#include "flashjit/fa2/fa2_primitives.cuh"
#include "flashjit/fa3/fa3_primitives.cuh"

namespace flashjit {
namespace fa3 {

// Bytes between staged rows: a row of kVoDim values and 16 more.
template <class T, int kVoDim>
constexpr int kStagedRowBytes = kVoDim * int(sizeof(T)) + 16;

// A warpgroup's share of an MLA CTA's kRows output rows (those below
// rows_total): its lanes' rows row_in_cta[r], columns col0 + 8n + 2 tq, of O /
// sum (fa2::store_mla_rows's values and LSE), through `stage` (shared memory
// at `stage_addr`, kRows * kStagedRowBytes, read by no product any more). The
// staging threads meet at named barrier `barrier_id` of `barrier_threads`
// (the warpgroup's own, or one of every warpgroup that stores); then thread
// wg_tid (0 .. 127) of the warpgroup copies its columns of row wg_tid.
// Whether a CTA stages (not a split chunk) is uniform across it, so every
// thread of the barrier takes the same branch.
template <class T, int kVoDim, bool kLse, int kRows, int NT>
__device__ __forceinline__ void store_mla_rows_staged(const FlashjitAttentionParams& p, const CtaWork& w,
                                                      const float (&o)[NT][4], const float (&sum)[2],
                                                      const float (&m_ref)[2], const int (&row_in_cta)[2],
                                                      int rows_total, int col0, int tq, bool writes_lse,
                                                      unsigned char* stage, uint32_t stage_addr, int barrier_id,
                                                      int barrier_threads, int wg_tid) {
  if (w.split >= 0) {
    fa2::store_mla_rows<T, kVoDim, kLse>(p, w, o, sum, m_ref, row_in_cta, rows_total, col0 + 2 * tq, writes_lse);
    return;
  }
  constexpr int kRowBytes = kStagedRowBytes<T, kVoDim>;
  float inv_l[2], lse[2];
  fa2::mla_row_norms(sum, m_ref, inv_l, lse);
  const auto packed = w.packed_rows();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    unsigned char* row = stage + row_in_cta[r] * kRowBytes + (col0 + 2 * tq) * int(sizeof(T));
#pragma unroll
    for (int n = 0; n < NT; ++n)
      *reinterpret_cast<uint32_t*>(row + 16 * n) = fa2::pack2<T>(o[n][2 * r] * inv_l[r], o[n][2 * r + 1] * inv_l[r]);
    const int out_row = w.row_begin + row_in_cta[r];
    if (kLse && writes_lse && out_row < rows_total) {
      int token, head;
      packed.locate(out_row, token, head);
      fa2::store_mla_lse(p, token, head, lse[r]);
    }
  }
  fence_async_shared();  // the bulk copies read what these stores wrote
  asm volatile("bar.sync %0, %1;\n" ::"r"(barrier_id), "r"(barrier_threads) : "memory");
  constexpr uint32_t kBytes = NT * 8 * sizeof(T);
  for (int r = wg_tid; r < kRows; r += 128) {
    const int out_row = w.row_begin + r;
    if (out_row >= rows_total) break;
    int token, head;
    packed.locate(out_row, token, head);
    T* dst = static_cast<T*>(p.o) + int64_t(token) * p.o_stride_n + int64_t(head) * p.o_stride_h + col0;
    tma::store_bulk(dst, stage_addr + r * kRowBytes + col0 * int(sizeof(T)), kBytes);
  }
  tma::store_commit();
  tma::store_wait_read();  // shared memory is freed at the CTA's exit
}

}  // namespace fa3
}  // namespace flashjit
