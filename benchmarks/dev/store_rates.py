"""How fast can a CTA's output leave the SM? A stand-alone CUDA program (no
flashjit, no torch) in the shape of the fa3 MLA kernels' epilogue
(fa3/fa3_mla_store.cuh): one CTA per SM stages 64 KB in shared memory (a
64-row tile of 512 16-bit values a row), then copies it to global memory, and
thread 0 reports the clock64 cycles from the copy's start to its source read
(bulk copies) or its last store issued, the slowest CTA of the best of 17
launches, with one CTA and with one on every SM.

Modes:
  0  128 bulk copies (cp.async.bulk.global.shared::cta) of 512 B (the shipped form: a
     warpgroup's half of a row each)
  1  8 bulk copies of 8 KB
  2  2 bulk copies of 32 KB
  3  16-byte st.global by 256 threads

Usage: python benchmarks/dev/store_rates.py [--build-only] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import run_standalone  # noqa: E402

SOURCE = r"""
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// One CTA per SM (200 KB of shared memory): 64 KB staged, then copied out by `mode`.
__global__ void __launch_bounds__(256, 1) copy_out(char* out, int mode, unsigned long long* t) {
  extern __shared__ __align__(128) char sm[];
  for (int i = threadIdx.x; i < 65536 / 4; i += 256) reinterpret_cast<int*>(sm)[i] = i + blockIdx.x;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  unsigned long long t0 = clock64();
  char* dst = out + size_t(blockIdx.x) * 65536;
  if (mode == 3) {
    for (int i = threadIdx.x; i < 4096; i += 256) reinterpret_cast<int4*>(dst)[i] = reinterpret_cast<int4*>(sm)[i];
  } else {
    const int copies = mode == 0 ? 128 : mode == 1 ? 8 : 2, bytes = 65536 / copies;
    if (threadIdx.x < copies) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + threadIdx.x * bytes),
                   "r"(smem_u32(sm + threadIdx.x * bytes)), "r"(bytes) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) t[blockIdx.x] = clock64() - t0;
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  char* out; unsigned long long* t; cudaMalloc(&out, size_t(sms) * 65536 * 4); cudaMalloc(&t, sms * 8 * 4);
  cudaFuncSetAttribute(copy_out, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  unsigned long long h[1024];
  for (int mode = 0; mode < 4; ++mode) {
    for (int ctas : {sms, 1}) {
      double best = 1e30;
      for (int rep = 0; rep < 20; ++rep) {
        copy_out<<<ctas, 256, 200 * 1024>>>(out, mode, t);
        cudaMemcpy(h, t, ctas * 8, cudaMemcpyDeviceToHost);
        unsigned long long mx = 0; for (int i = 0; i < ctas; ++i) mx = h[i] > mx ? h[i] : mx;
        if (rep > 2 && mx < best) best = mx;
      }
      printf("mode %d (%s), %d CTAs: slowest CTA %.0f cycles\n", mode,
             mode == 0 ? "128 x 512 B bulk" : mode == 1 ? "8 x 8 KB bulk" : mode == 2 ? "2 x 32 KB bulk" : "16-B st.global",
             ctas, best);
    }
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
"""


if __name__ == "__main__":
    sys.exit(run_standalone("store_rates", SOURCE, __doc__))
