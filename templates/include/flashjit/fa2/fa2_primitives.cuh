// Building blocks of the FA2-style tensor-core kernel (fa2_attention.cuh):
// mma.sync, ldmatrix, the shared-memory swizzle and the K/V tile copies.
//
// ---------------------------------------------------------------------------
// Fragment layouts (PTX ISA, mma.m16n8k16 with .f16/.bf16 inputs). Per lane:
//   g = lane / 4 (the "group"), t = lane % 4 (thread in group).
//   A, 16x16 row-major, four .b32 registers of two 16-bit elements each, the
//   lower-numbered column in the low half:
//     a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
//     a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
//   B, 16x8 (k x n, "col": B^T is row-major), two registers:
//     b[0] = B[2t, 2t+1][g]          b[1] = B[2t+8, 2t+9][g]
//   C/D, 16x8 fp32, four registers:
//     c[0], c[1] = C[g][2t, 2t+1]    c[2], c[3] = C[g + 8][2t, 2t+1]
//
// ldmatrix.m8n8.x4: lanes 8i..8i+7 give the row addresses (16 bytes = 8
// elements each) of matrix i; register i of lane L receives matrix i's
// elements [L/4][2(L%4), 2(L%4)+1]. With .trans it receives the transposed
// pair [2(L%4)][L/4], [2(L%4)+1][L/4] instead.
//
//   "A pattern" (lane L addresses row L % 16, 8-column chunk L / 16 of a
//   16x16 block) gives matrices {rows 0-7 | 8-15} x {cols 0-7 | 8-15} in the
//   order (0-7,0-7), (8-15,0-7), (0-7,8-15), (8-15,8-15) = a[0..3] above. Used
//   for Q (rows = query rows, cols = head dims) and, with .trans, for V (rows =
//   keys, cols = head dims): there register 0 of lane L holds V[2t, 2t+1][g] of
//   keys 0-7 / dims 0-7 = b[0] of the n-tile of dims 0-7, register 1 (keys 8-15)
//   its b[1], registers 2 and 3 the same for the n-tile of dims 8-15.
//
//   "B pattern" (lane L addresses row 8*(L/16) + L%8, chunk (L/8)%2) gives the
//   matrices (keys 0-7, dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 0-7),
//   (keys 8-15, dims 8-15) of K (row-major [key][dim] = B^T of S = Q.K^T), so
//   registers 0, 1 are b[0], b[1] of the n-tile of keys 0-7 and registers 2, 3
//   those of keys 8-15.
//
// P as the A operand: S n-tile j (keys 8j..8j+7) has c[0..1] on row g and c[2..3]
// on row g+8 at keys 8j+2t, +1, exactly the A layout's columns 2t, 2t+1 (tile
// 2kk) and 2t+8, 2t+9 (tile 2kk+1) of k-step kk, so
//   pa[kk] = { pack(S[2kk][0..1]), pack(S[2kk][2..3]), pack(S[2kk+1][0..1]), pack(S[2kk+1][2..3]) }.
//
// Shared memory swizzle (SwizzledTile): every tile is D elements (D/8 16-byte
// chunks, at least 8) per row, stored as 128-byte column blocks (chunks 8b ..
// 8b + 7 of a row, block b); within a block, logical chunk c of row r lives at
// physical chunk c ^ (r % 8). Two arrangements of the blocks:
//   * row-major (RowMajorTile): a row's blocks are adjacent, the row pitch is
//     D * 2 bytes;
//   * blocked (BlockedTile): block b of every row of the tile, then block b + 1,
//     each a [rows][128 B] array; this is what a TMA load with the 128-byte
//     swizzle writes (one load per block, the tile at a 1024-byte boundary).
// The row pitch is a multiple of 128 bytes either way, so the 8 rows one 8x8
// ldmatrix phase reads (8 consecutive rows, one logical chunk) fall on 8
// distinct chunks of a 128-byte line = all 32 banks, conflict-free. cp.async
// stores (8 consecutive chunks of a row per 8 lanes) and the epilogue's 4-byte
// stores (row g, chunk j ^ g, word t) are conflict-free too.
// Since the XOR only touches the low 3 bits of the chunk index and the lanes'
// chunk offset is 0 or 1 added to an even 2*kk, chunk (2kk + b) of a row with
// r % 8 = r7 sits at block kk / 4, byte 16*((2*(kk%4) + b) ^ r7) of it: a
// per-lane offset plus a compile-time XOR and immediate (SwizzledTile::pair).
// (A padded layout, pitch D * 2 + 16 and no XOR, needs one register per pattern
// instead of four but made cp.async split every 128-byte line it stored, and
// was slower; docs/fa2.md, "Measured and not kept".)
// ---------------------------------------------------------------------------
#pragma once
#include <math_constants.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/numeric.cuh"
#include "flashjit/common/work.cuh"

namespace flashjit {

namespace fa2 {

// 2^x in one MUFU.EX2 (at most 2 ulp, like exp2f, whose extra instructions
// only rescue subnormal results: here those are weights below 2^-126, which
// flush to 0 at an absolute cost the error model's floor already covers).
// 2^0 is exactly 1 and 2^-inf exactly 0.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// op over s[j][2r] and s[j][2r + 1] of the NT n8 tiles (one row of a lane's
// S fragment): a pairwise tree, depth log2(2 NT) instead of a chain of 2 NT
// dependent operations.
template <int NT, class Op>
__device__ __forceinline__ float row_reduce(const float (&s)[NT][4], int r, Op op) {
  float v[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) v[j] = op(s[j][2 * r], s[j][2 * r + 1]);
#pragma unroll
  for (int width = 1; width < NT; width *= 2)
#pragma unroll
    for (int j = 0; j + width < NT; j += 2 * width) v[j] = op(v[j], v[j + width]);
  return v[0];
}

// The max is exact, so the order does not change it.
template <int NT>
__device__ __forceinline__ float row_max(const float (&s)[NT][4], int r) {
  return row_reduce(s, r, [](float a, float b) { return fmaxf(a, b); });
}

// fp32 sum in a pairwise order: the error model's accumulation term holds for
// any order, and the tree is 4 dependent adds deep where a running sum is 16.
template <int NT>
__device__ __forceinline__ float row_sum(const float (&s)[NT][4], int r) {
  return row_reduce(s, r, [](float a, float b) { return a + b; });
}

// Row r of a lane's S fragment made P = 2^(s * scale - ref) in place, one FFMA
// and one MUFU.EX2 a value (ref: the row's max in log2 units, 0 while it has
// seen no key, so that a masked -inf gives 0 and never -inf - -inf).
template <int NT>
__device__ __forceinline__ void exp2_row(float (&s)[NT][4], int r, float scale, float ref) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    s[j][2 * r] = exp2_fast(fmaf(s[j][2 * r], scale, -ref));
    s[j][2 * r + 1] = exp2_fast(fmaf(s[j][2 * r + 1], scale, -ref));
  }
}

// A lane's two row values (rows g and g + 8 of a fragment) maxed over the four
// lanes of its quad, which hold the rest of those rows; the two rows' chains
// are interleaved so that their shuffle latencies overlap.
__device__ __forceinline__ void quad_max(float (&x)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) x[r] = fmaxf(x[r], __shfl_xor_sync(0xffffffffu, x[r], 1));
#pragma unroll
  for (int r = 0; r < 2; ++r) x[r] = fmaxf(x[r], __shfl_xor_sync(0xffffffffu, x[r], 2));
}

// Register-pressure aids for kernels at the 255-register cap. ptxas keeps a
// loop-invariant value in a register across a loop; these change what it can
// prove, so that it keeps less there.
// The lane's index, read from %laneid where it is used (a masked step), rather
// than one derived from threadIdx at the top and held across the loop.
__device__ __forceinline__ int lane_id() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}
// x from lane 0: ptxas then treats x as warp-uniform and keeps what derives
// from it (a warp's rows, their key bounds) in uniform registers.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }
// x, hidden from the compiler's algebra: an address formed from it per tile
// stays per tile instead of being rewritten into hoisted variants.
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm("" : "+r"(x));
  return x;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a.b, m16n8k16, fp32 accumulation.
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to T (round to nearest even), `lo` in the low 16 bits.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same<T, __half>::value) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// Where 16-byte chunk `chunk` of row `row` of a swizzled tile lives (see the
// header comment): kPitch bytes between rows, kBlockBytes between the 128-byte
// column blocks of a row.
template <int kPitch_, int kBlockBytes_>
struct SwizzledTile {
  static constexpr int kPitch = kPitch_;
  static constexpr int kBlockBytes = kBlockBytes_;
  static constexpr bool kSwizzled = true;

  __device__ __forceinline__ static uint32_t at(int row, int chunk) { return at(row, chunk, row & 7); }
  // The same, given row % 8 where the caller has it in a simpler form.
  __device__ __forceinline__ static uint32_t at(int row, int chunk, int row_mod8) {
    if constexpr (kBlockBytes == 128) {  // the XOR leaves the block bits of `chunk` alone
      return static_cast<uint32_t>(row * kPitch + ((chunk ^ row_mod8) << 4));
    } else {
      return static_cast<uint32_t>(row * kPitch + (chunk / 8) * kBlockBytes + (((chunk % 8) ^ row_mod8) << 4));
    }
  }
  // Chunk pair i (chunks 2i + b) of a row, from the offset of its chunk b (b < 2).
  __device__ __forceinline__ static uint32_t pair(uint32_t off0, int i) {
    return (off0 ^ (uint32_t(i % 4) << 5)) + (i / 4) * kBlockBytes;
  }
  // Offset of 128-byte block b of a row from block 0 (a multiple of 128 bytes).
  __host__ __device__ static constexpr int block(int b) { return b * kBlockBytes; }
};
template <int kRowBytes>
using RowMajorTile = SwizzledTile<kRowBytes, 128>;
template <int kRows>
using BlockedTile = SwizzledTile<128, kRows * 128>;

// An unswizzled tile of kPitch-byte rows: FP8 code tiles, which are read back
// once, a 16-byte chunk per thread in row order (fa2_fp8.cuh), never by ldmatrix.
template <int kPitch_>
struct PlainTile {
  static constexpr int kPitch = kPitch_;
  static constexpr bool kSwizzled = false;
  __device__ __forceinline__ static uint32_t at(int row, int chunk) { return static_cast<uint32_t>(row * kPitch + chunk * 16); }
  __device__ __forceinline__ static uint32_t at(int row, int chunk, int) { return at(row, chunk); }
  __host__ __device__ static constexpr int block(int b) { return b * 128; }
};

// Rows of a kRows-key tile that thread `tid` copies: row tid / kChunks + i *
// kRowsPerPass, and of each row chunk tid % kChunks of every kSpanBytes-byte
// span (kSpans of them), so that a warp's copies read whole spans (coalesced).
// The spans of one row sit kSpanBytes apart in global and, in shared memory,
// kSpanBytes / 128 blocks apart (the swizzle XORs only the low three chunk
// bits, and a span is a whole number of blocks): one address per row, its
// spans at immediate offsets (span_off).
//
// A span of a whole row whose chunk count is not a power of two (head dims
// 80, 96, 112, 144, ...) takes the next power of two of threads, and the
// threads past the row's chunks copy nothing (active()). Spans of 64 bytes
// (half lines: 4 threads a row, e.g. fa3's paged loader at head dim 96, whose
// 16 threads a row would hold 16 rows' pages each) go into swizzled tiles only:
// see span_at.
template <int kRows, int kDim, int kThreads, int kSpanBytes>
struct TileRows {
  static constexpr int kDataChunks = kSpanBytes / 16;  // 16-byte chunks of a span
  static constexpr int kChunks = pow2_at_least(kDataChunks);
  static constexpr int kSpans = kDim * 2 / kSpanBytes;
  static constexpr int kRowsPerPass = kThreads / kChunks;
  // One pass may cover more rows than the tile has (16 decode rows of head
  // dim 32): the threads past them copy nothing.
  static constexpr int kPerThread = kRows >= kRowsPerPass ? kRows / kRowsPerPass : 1;
  // Whole 128-byte lines, or one span of a whole row (e.g. 64-byte rows of
  // FP8 codes at head_dim 64, into a PlainTile; 160-byte rows at head_dim 80).
  static_assert((kSpanBytes % 128 == 0 || kSpanBytes == kDim * 2 || kSpanBytes == 64) && kDim * 2 % kSpanBytes == 0 &&
                    kSpanBytes % 16 == 0 && kThreads % kChunks == 0 &&
                    (kRows % kRowsPerPass == 0 || kRowsPerPass % kRows == 0),
                "whole 16-byte chunks, spans and passes");
  // Whether the thread copying chunk `chunk` of each span of rows row0,
  // row0 + kRowsPerPass, ... has data to copy.
  __device__ __forceinline__ static bool active(int chunk, int row0) {
    return (kChunks == kDataChunks || chunk < kDataChunks) && (kRowsPerPass <= kRows || row0 < kRows);
  }
  // Shared-memory offset of span j of a row from span 0, in a tile of layout L.
  template <class L>
  __host__ __device__ static constexpr int span_off(int j) {
    static_assert(kSpanBytes % 128 == 0 || kSpans == 1, "64-byte spans: span_at");
    return L::block(j * kSpanBytes / 128);
  }
  // Offset of span j of a row whose span 0 is at `off`. A 64-byte span's
  // chunks (c < 4, + 4 for an odd span) differ from span 0's in chunk bit 2,
  // which the swizzle XORs and no row or block offset sets: an XOR of byte
  // bit 6, then whole blocks.
  template <class L>
  __device__ __forceinline__ static uint32_t span_at(uint32_t off, int j) {
    if constexpr (kSpanBytes % 128 == 0 || kSpans == 1) {
      return off + span_off<L>(j);
    } else {
      static_assert(L::kSwizzled && L::kPitch % 128 == 0, "64-byte spans into 128-byte swizzled lines");
      return (off ^ uint32_t((j & 1) << 6)) + L::block(j / 2);
    }
  }
};

// Every thread's cp.async of the CTA's Q tile (kRows packed rows of q_base
// from w.row_begin, layout L at q_smem): a span of kCopySpan bytes of a row
// per chunk, rows walked by adds (CtaWork::PackedRows::walk). Rows past the
// request (rows_total) are zero-filled, their address a mapped fallback.
template <class L, int kRows, int kDim, int kThreads, int kCopySpan, class T>
__device__ __forceinline__ void copy_q_tile(const FlashjitAttentionParams& p, const CtaWork& w, const T* q_base,
                                            uint32_t q_smem, int rows_total, int tid) {
  using R = TileRows<kRows, kDim, kThreads, kCopySpan>;
  constexpr int kSpanElems = kCopySpan / int(sizeof(T));
  const int chunk = tid % R::kChunks, r0 = tid / R::kChunks;
  auto rows = w.packed_rows().walk<R::kRowsPerPass>(w.row_begin + r0, p.q_stride_n, p.q_stride_h);
#pragma unroll
  for (int i = 0; i < R::kPerThread; ++i) {
    const int r = r0 + i * R::kRowsPerPass;
    const bool ok = w.row_begin + r < rows_total;
    const T* src = ok ? q_base + rows.offset + chunk * 8 : q_base;
    if (R::active(chunk, r0)) {
#pragma unroll
      for (int j = 0; j < R::kSpans; ++j)
        cp_async_16(q_smem + L::at(r, chunk) + R::template span_off<L>(j), src + (ok ? j * kSpanElems : 0), ok);
    }
    rows.next();
  }
}

// Byte offset, in a tile of layout L, of the first span of the i-th row a
// thread copies (see TileRows): compile-time steps from one per-thread base when
// a copy pass covers a multiple of 8 rows (the swizzle repeats every 8 rows).
template <class R, class L>
__device__ __forceinline__ uint32_t tile_row_off(int row0, int chunk, int i) {
  if constexpr (R::kRowsPerPass % 8 == 0) {
    return L::at(row0, chunk) + i * R::kRowsPerPass * L::kPitch;
  } else {
    return L::at(row0 + i * R::kRowsPerPass, chunk);
  }
}

// 16-byte global->shared copy of a row known to be in range (no src-size
// operand: nothing to zero-fill).
__device__ __forceinline__ void cp_async_16_full(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// The copies of one thread into ragged (not paged) K or V tiles, with the
// address arithmetic done once per CTA instead of once per row and tile (a
// 64-bit address rebuilt per row costs about 20 instructions per 16-byte
// copy, which the main loop issues between the barrier and the first mma).
// Here a tile costs one 64-bit multiply-add, then one 64-bit add per row.
template <class T, class L, int kRows, int kDim, int kThreads, int kSpanBytes>
struct RaggedTileCopy {
  using R = TileRows<kRows, kDim, kThreads, kSpanBytes>;
  // src: with whole rows per pass, the request's key 0 (the same for the whole
  // CTA, which the compiler can keep in uniform registers), the thread's row and
  // chunk added per tile; with one chunk of each 128-byte line, this thread's
  // row and chunk at key 0. On the d128 wide tiling, at the register cap, the
  // first form saves two registers, which non-causal prefill needs, and the
  // second keeps plain causal prefill, which copies lines, from spilling.
  static constexpr bool kCtaBase = R::kSpans == 1;
  const T* src;
  int64_t stride_n;  // between keys, in elements
  int chunk;         // this thread's 16-byte chunk of each row
  int row0;          // this thread's first row of a tile

  template <class Rows>
  __device__ __forceinline__ RaggedTileCopy(const Rows& rows, int tid) {
    chunk = tid % R::kChunks;
    row0 = tid / R::kChunks;
    stride_n = rows.stride_n;
    src = kCtaBase ? rows.base : rows.base + int64_t(row0) * stride_n + chunk * 8;
  }

  __device__ __forceinline__ uint32_t row_off(int i) const { return tile_row_off<R, L>(row0, chunk, i); }

  // Copies keys first .. first + kRows - 1 into the tile at `dst`; rows at or
  // past `valid` are zero-filled, reading nothing (`fallback`: a mapped address).
  __device__ __forceinline__ void issue(uint32_t dst, int first, int valid, const T* fallback) const {
    const T* s = kCtaBase ? src + int64_t(first + row0) * stride_n + chunk * 8 : src + int64_t(first) * stride_n;
    const int64_t step = int64_t(R::kRowsPerPass) * stride_n;
    constexpr int kSpanElems = kSpanBytes / sizeof(T);
    if (!R::active(chunk, row0)) return;
    if (valid >= kRows) {
#pragma unroll
      for (int i = 0; i < R::kPerThread; ++i)
#pragma unroll
        for (int j = 0; j < R::kSpans; ++j)
          cp_async_16_full(dst + row_off(i) + R::template span_off<L>(j), s + i * step + j * kSpanElems);
    } else {
#pragma unroll
      for (int i = 0; i < R::kPerThread; ++i) {
        const bool ok = row0 + i * R::kRowsPerPass < valid;
#pragma unroll
        for (int j = 0; j < R::kSpans; ++j)
          cp_async_16(dst + row_off(i) + R::template span_off<L>(j), ok ? s + i * step + j * kSpanElems : fallback, ok);
      }
    }
  }
};

// The copies of one thread into paged K or V tiles. Each row's page is looked
// up a tile ahead (lookup), then its address costs a multiply-shift division
// by the page size, one wide multiply-add and an add: byte strides are 32-bit
// (the host keeps strides below 2 GiB and a page's tokens below 4 GiB).
template <class T, class L, int kRows, int kDim, int kThreads, int kSpanBytes>
struct PagedTileCopy {
  using R = TileRows<kRows, kDim, kThreads, kSpanBytes>;
  const char* base;     // the KV head and this thread's chunk applied
  uint32_t page_bytes;  // between pages
  uint32_t row_bytes;   // between tokens within a page
  const int32_t* pages;
  FastDivmod page_div;
  int chunk, row0;

  __device__ __forceinline__ PagedTileCopy(const KvRows<T, true>& rows, int tid) : page_div(rows.page_div) {
    chunk = tid % R::kChunks;
    row0 = tid / R::kChunks;
    base = reinterpret_cast<const char*>(rows.base + chunk * 8);
    page_bytes = uint32_t(rows.stride_page * int64_t(sizeof(T)));
    row_bytes = uint32_t(rows.stride_n * int64_t(sizeof(T)));
    pages = rows.pages;
  }

  // Pages of this thread's rows of the tile at key `first` (0 past `valid`).
  __device__ __forceinline__ void lookup(int (&page)[R::kPerThread], int first, int valid) const {
#pragma unroll
    for (int i = 0; i < R::kPerThread; ++i) {
      const int row = row0 + i * R::kRowsPerPass;
      page[i] = row < valid ? pages[page_div.div(first + row)] : 0;
    }
  }

  // Copies keys first .. first + kRows - 1 (their pages from lookup) into the
  // tile at `dst`; rows at or past `valid` are zero-filled, reading nothing.
  __device__ __forceinline__ void issue(uint32_t dst, const int (&page)[R::kPerThread], int first, int valid) const {
    if (!R::active(chunk, row0)) return;
#pragma unroll
    for (int i = 0; i < R::kPerThread; ++i) {
      const int row = row0 + i * R::kRowsPerPass, key = first + row;
      const bool ok = row < valid;
      const uint32_t slot = uint32_t(page_div.mod(key, page_div.div(key)));
      const char* src = base + (uint64_t(uint32_t(page[i])) * page_bytes + slot * row_bytes);
#pragma unroll
      for (int j = 0; j < R::kSpans; ++j)
        cp_async_16(dst + R::template span_at<L>(tile_row_off<R, L>(row0, chunk, i), j),
                    ok ? src + j * kSpanBytes : base, ok);
    }
  }
};

}  // namespace fa2

}  // namespace flashjit
