// Warpgroup matrix multiply-accumulate (wgmma, sm_90a) for the fa3 kernel:
// shared-memory matrix descriptors and the m64nNk16 forms it issues, with fp32
// accumulators laid out as d[N / 8][4]: per warp of the warpgroup (rows 16w ..
// 16w + 15), d[j][e] is row g + 8 * (e / 2), column 8j + 2 * tq + e % 2 (g =
// lane / 4, tq = lane % 4) -- the C layout of mma.sync m16n8, so the fa2 online
// softmax and epilogue read it as they read their own fragments, and P rounded
// to 16 bits is the register A operand of the next product as it stands.
//
// Operands in shared memory are tiles of 128-byte rows in blocks of 64 16-bit
// columns with the 128-byte swizzle, the layout TMA writes (fa2::BlockedTile):
// - K-major (Q as A and K as B of S = Q.K^T): rows of the M or N dimension are
//   the 128-byte lines; 8-row groups 1024 bytes apart (the stride byte
//   offset); a k16 step is 32 bytes into the line, the next 64 columns a whole
//   block further.
// - MN-major (V as B of O += P.V, "transposed"): the N dimension (head dims)
//   runs along the line, 64 of them per block, blocks `block_bytes` apart (the
//   leading byte offset); the K dimension (keys) down the lines, 8-key groups
//   1024 bytes apart (the stride byte offset); a k16 step is 16 lines on.
//
// The forms below are the shapes the fa3 kernels use: S with N = keys per tile
// (64, 128; 32 in MLA, per warpgroup), O += P.V with N = head_dim (64, 128, 256;
// 256 in MLA, per warpgroup, with P from shared memory). Each is one
// FLASHJIT_WGMMA_SS / _RS statement, whose macros spell the operand lists.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>

namespace flashjit {
namespace fa3 {

// Descriptor of a 128-byte-swizzled operand at shared address `addr` (a
// multiple of 16; its 1024-byte swizzle period is aligned by the caller).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  uint64_t desc = (addr & 0x3FFFFu) >> 4;
  desc |= uint64_t((leading_bytes >> 4) & 0x3FFFu) << 16;
  desc |= uint64_t((stride_bytes >> 4) & 0x3FFFu) << 32;
  desc |= uint64_t(1) << 62;  // 128-byte swizzle
  return desc;
}

// The descriptor of the operand `bytes` further on (within the 256 KB the
// 14-bit address field spans, so the add never carries out of it).
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// `value`, opaque to the optimizer: keeps a loop-invariant descriptor from
// being expanded into one live register pair per use ahead of the loop.
__device__ __forceinline__ uint64_t fresh(uint64_t value) {
  asm volatile("" : "+l"(value));
  return value;
}

// Orders this thread's register writes (accumulators, P) before the
// warpgroup's next wgmma reads them.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's committed groups are pending.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accesses of accumulators across a wgmma's
// issue and its wait: they are written asynchronously.
template <int NT>
__device__ __forceinline__ void fence_operands(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// The forms' operand lists, spelled once. A form's PTX names its accumulators
// %0 .. %(R - 1) (R = N / 2 fp32 registers a thread), then its other operands
// in order: for mma_ss / mma_ss_vt the descriptors a, b and `accumulate`; for
// mma_rs a's four registers, b and `accumulate`. FLASHJIT_WGMMA_R<R> is the
// register list in PTX, FLASHJIT_WGMMA_D<R> the matching read-write operands
// d[0][0] .. d[N / 8 - 1][3]. The macros are undefined at the end of the file.
#define FLASHJIT_WGMMA_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define FLASHJIT_WGMMA_R32 FLASHJIT_WGMMA_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FLASHJIT_WGMMA_R64                                                                          \
  FLASHJIT_WGMMA_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
                     ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define FLASHJIT_WGMMA_R96                                                                    \
  FLASHJIT_WGMMA_R64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79" \
                     ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define FLASHJIT_WGMMA_R128                                                                                     \
  FLASHJIT_WGMMA_R64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"         \
                     ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"         \
                     ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111" \
                     ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

#define FLASHJIT_WGMMA_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define FLASHJIT_WGMMA_D16 FLASHJIT_WGMMA_D4(0), FLASHJIT_WGMMA_D4(1), FLASHJIT_WGMMA_D4(2), FLASHJIT_WGMMA_D4(3)
#define FLASHJIT_WGMMA_D32 \
  FLASHJIT_WGMMA_D16, FLASHJIT_WGMMA_D4(4), FLASHJIT_WGMMA_D4(5), FLASHJIT_WGMMA_D4(6), FLASHJIT_WGMMA_D4(7)
#define FLASHJIT_WGMMA_D64                                                                                 \
  FLASHJIT_WGMMA_D32, FLASHJIT_WGMMA_D4(8), FLASHJIT_WGMMA_D4(9), FLASHJIT_WGMMA_D4(10), FLASHJIT_WGMMA_D4(11), \
      FLASHJIT_WGMMA_D4(12), FLASHJIT_WGMMA_D4(13), FLASHJIT_WGMMA_D4(14), FLASHJIT_WGMMA_D4(15)
#define FLASHJIT_WGMMA_D96                                                                                     \
  FLASHJIT_WGMMA_D64, FLASHJIT_WGMMA_D4(16), FLASHJIT_WGMMA_D4(17), FLASHJIT_WGMMA_D4(18), FLASHJIT_WGMMA_D4(19), \
      FLASHJIT_WGMMA_D4(20), FLASHJIT_WGMMA_D4(21), FLASHJIT_WGMMA_D4(22), FLASHJIT_WGMMA_D4(23)
#define FLASHJIT_WGMMA_D128                                                                                    \
  FLASHJIT_WGMMA_D64, FLASHJIT_WGMMA_D4(16), FLASHJIT_WGMMA_D4(17), FLASHJIT_WGMMA_D4(18), FLASHJIT_WGMMA_D4(19), \
      FLASHJIT_WGMMA_D4(20), FLASHJIT_WGMMA_D4(21), FLASHJIT_WGMMA_D4(22), FLASHJIT_WGMMA_D4(23),                 \
      FLASHJIT_WGMMA_D4(24), FLASHJIT_WGMMA_D4(25), FLASHJIT_WGMMA_D4(26), FLASHJIT_WGMMA_D4(27),                 \
      FLASHJIT_WGMMA_D4(28), FLASHJIT_WGMMA_D4(29), FLASHJIT_WGMMA_D4(30), FLASHJIT_WGMMA_D4(31)

// One wgmma with both operands in shared memory: m64<n>k16, inputs of `type`
// (f16 or bf16), R = n / 2 accumulator registers, the descriptors %R and
// %R+1 (ia, ib), `accumulate` %R+2 (ip) as the scale-d predicate; B transposed
// (MN-major) when tnsp_b is 1.
#define FLASHJIT_WGMMA_SS(n, type, R, ia, ib, ip, tnsp_b)                                              \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #ip ", 0;\n"                                     \
               "wgmma.mma_async.sync.aligned.m64n" #n "k16.f32." #type "." #type " {" FLASHJIT_WGMMA_R##R \
               "}, %" #ia ", %" #ib ", p, 1, 1, 0, " #tnsp_b ";\n}\n"                                  \
               : FLASHJIT_WGMMA_D##R                                                                   \
               : "l"(a), "l"(b), "r"(accumulate))

// One wgmma with A (four registers a thread, %R .. %R+3 from ia0) from
// registers and B MN-major in shared memory (%R+4, ib); `accumulate` is ip.
#define FLASHJIT_WGMMA_RS(n, type, R, ia0, ia1, ia2, ia3, ib, ip)                                          \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #ip ", 0;\n"                                         \
               "wgmma.mma_async.sync.aligned.m64n" #n "k16.f32." #type "." #type " {" FLASHJIT_WGMMA_R##R     \
               "}, {%" #ia0 ", %" #ia1 ", %" #ia2 ", %" #ia3 "}, %" #ib ", p, 1, 1, 1;\n}\n"                  \
               : FLASHJIT_WGMMA_D##R                                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate))

// d (+)= A.B^T, A and B K-major in shared memory (descriptors a, b); N columns.
template <class T, int N>
__device__ __forceinline__ void mma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "S = Q.K^T forms: N 32, 64 or 128");
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if constexpr (N == 64 && kHalf) {
    FLASHJIT_WGMMA_SS(64, f16, 32, 32, 33, 34, 0);
  } else if constexpr (N == 64) {
    FLASHJIT_WGMMA_SS(64, bf16, 32, 32, 33, 34, 0);
  }
  if constexpr (N == 128 && kHalf) {
    FLASHJIT_WGMMA_SS(128, f16, 64, 64, 65, 66, 0);
  } else if constexpr (N == 128) {
    FLASHJIT_WGMMA_SS(128, bf16, 64, 64, 65, 66, 0);
  }
  if constexpr (N == 32 && kHalf) {
    FLASHJIT_WGMMA_SS(32, f16, 16, 16, 17, 18, 0);
  } else if constexpr (N == 32) {
    FLASHJIT_WGMMA_SS(32, bf16, 16, 16, 17, 18, 0);
  }
}

// d += A.B, A (P) K-major and B (V) MN-major, both in shared memory
// (descriptors a, b); N columns. The MLA kernel's O += P.V, whose P every
// consumer warpgroup reads whole from shared memory.
template <class T, int N>
__device__ __forceinline__ void mma_ss_vt(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 256, "O += P.V forms with P in shared memory: N 256");
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if constexpr (N == 256 && kHalf) {
    FLASHJIT_WGMMA_SS(256, f16, 128, 128, 129, 130, 1);
  } else if constexpr (N == 256) {
    FLASHJIT_WGMMA_SS(256, bf16, 128, 128, 129, 130, 1);
  }
}

// d += A.B, A (P) from registers in the m16k16 A layout of each warp's rows, B
// (V) MN-major in shared memory (descriptor b); N columns.
template <class T, int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  static_assert(N == 64 || N == 128 || N == 192 || N == 256, "O += P.V forms: N 64, 128, 192 or 256");
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if constexpr (N == 64 && kHalf) {
    FLASHJIT_WGMMA_RS(64, f16, 32, 32, 33, 34, 35, 36, 37);
  } else if constexpr (N == 64) {
    FLASHJIT_WGMMA_RS(64, bf16, 32, 32, 33, 34, 35, 36, 37);
  }
  if constexpr (N == 128 && kHalf) {
    FLASHJIT_WGMMA_RS(128, f16, 64, 64, 65, 66, 67, 68, 69);
  } else if constexpr (N == 128) {
    FLASHJIT_WGMMA_RS(128, bf16, 64, 64, 65, 66, 67, 68, 69);
  }
  if constexpr (N == 192 && kHalf) {
    FLASHJIT_WGMMA_RS(192, f16, 96, 96, 97, 98, 99, 100, 101);
  } else if constexpr (N == 192) {
    FLASHJIT_WGMMA_RS(192, bf16, 96, 96, 97, 98, 99, 100, 101);
  }
  if constexpr (N == 256 && kHalf) {
    FLASHJIT_WGMMA_RS(256, f16, 128, 128, 129, 130, 131, 132, 133);
  } else if constexpr (N == 256) {
    FLASHJIT_WGMMA_RS(256, bf16, 128, 128, 129, 130, 131, 132, 133);
  }
}

#undef FLASHJIT_WGMMA_RS
#undef FLASHJIT_WGMMA_SS
#undef FLASHJIT_WGMMA_D128
#undef FLASHJIT_WGMMA_D96
#undef FLASHJIT_WGMMA_D64
#undef FLASHJIT_WGMMA_D32
#undef FLASHJIT_WGMMA_D16
#undef FLASHJIT_WGMMA_D4
#undef FLASHJIT_WGMMA_R128
#undef FLASHJIT_WGMMA_R96
#undef FLASHJIT_WGMMA_R64
#undef FLASHJIT_WGMMA_R32
#undef FLASHJIT_WGMMA_R16

}  // namespace fa3
}  // namespace flashjit
