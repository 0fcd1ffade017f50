// Asynchronous global->shared copies (cp.async, SM80+): a thread issues many
// 16-byte copies without holding the data in registers, so a tile's loads are
// all in flight at once.
#pragma once
#include <stdint.h>

namespace flashjit {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global->shared copy; when !valid nothing is read and the 16 bytes
// are zero-filled (src-size 0). `src` must still be a mapped address.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// 8-byte global->shared copy (cp.async.ca: .cg takes 16 bytes only); zero-filled when !valid.
__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// 16 zero bytes to shared memory by address (a plain store: the generic proxy).
__device__ __forceinline__ void st_shared_zero_16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}
// One 16-byte shared-memory store by address.
__device__ __forceinline__ void st_shared_16(uint32_t addr, const uint4& v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// One 16-byte shared-memory load by address (of data this thread copied).
__device__ __forceinline__ uint4 ld_shared_16(uint32_t addr) {
  uint4 raw;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
               : "r"(addr));
  return raw;
}
// One 8-byte shared-memory load by address (of data this thread copied).
__device__ __forceinline__ uint2 ld_shared_8(uint32_t addr) {
  uint2 raw;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(raw.x), "=r"(raw.y) : "r"(addr));
  return raw;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// An arrival on mbarrier `bar` once every cp.async this thread has issued so
// far has landed. noinc: the arrival counts against the barrier's expected
// count (set at init), so each copying thread arrives exactly once per phase.
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Waits until at most N of this thread's most recent commit groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace flashjit
