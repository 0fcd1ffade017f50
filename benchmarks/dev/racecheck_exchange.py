"""Which hand-off between two warpgroups does compute-sanitizer's racecheck read
as ordered? A stand-alone CUDA program (no flashjit, no torch) in the shape of
the fa3 MLA pairs kernel's exchange (fa3/fa3_mla_pairs.cuh): 256 threads, for
a number of steps warpgroup 0 writes a value a thread into shared memory and
hands it to warpgroup 1, which reads it, writes its own and hands that back;
the values are rewritten every step (read-after-write and write-after-read
both cross the hand-offs); at the end each warpgroup stores a sum, both meet at
__syncthreads() and read the other's. Every value read is also checked.

Modes (the hand-off):
  0  named barriers: the handing warpgroup bar.arrive, the other bar.sync (the pairs kernel)
  1  named barriers, both warpgroups bar.sync (a rendezvous)
  2  mbarriers, every thread of the handing warpgroup arrives (128 arrivals)
  3  mbarriers, one arrival a warp after __syncwarp (4 arrivals; the pairs kernel's mbarrier form)
  4  none, only the final __syncthreads() exchange

Usage: python benchmarks/dev/racecheck_exchange.py [--build-only] [--steps 8] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import run_racecheck  # noqa: E402

SOURCE = r"""
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void mbar_init(uint32_t bar, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}

// Hand-off k (0: warpgroup 0 to 1, 1: back) of step `step`: the handing side.
__device__ __forceinline__ void hand(int mode, int k, uint64_t* bars, int lane) {
  if (mode == 0) bar_arrive(1 + k);
  if (mode == 1) bar_sync(1 + k);
  if (mode == 2) mbar_arrive(smem_addr(&bars[k]));
  if (mode == 3) {
    __syncwarp();
    if (lane % 32 == 0) mbar_arrive(smem_addr(&bars[2 + k]));
  }
}
// The receiving side.
__device__ __forceinline__ void take(int mode, int k, uint64_t* bars, int step) {
  if (mode == 0 || mode == 1) bar_sync(1 + k);
  if (mode == 2) mbar_wait(smem_addr(&bars[k]), step & 1);
  if (mode == 3) mbar_wait(smem_addr(&bars[2 + k]), step & 1);
}

__global__ void __launch_bounds__(256, 1) exchange(float* out, int steps, int mode) {
  __shared__ float a[128], b[128], sums[256];
  __shared__ uint64_t bars[4];
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 128;
  if (tid == 0) {
    mbar_init(smem_addr(&bars[0]), 128);
    mbar_init(smem_addr(&bars[1]), 128);
    mbar_init(smem_addr(&bars[2]), 4);
    mbar_init(smem_addr(&bars[3]), 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  float acc = 0.f;
  for (int step = 0; mode != 4 && step < steps; ++step) {
    if (wg == 0) {
      a[(lane + step) % 128] = float(step * 1000 + lane);
      hand(mode, 0, bars, lane);
      take(mode, 1, bars, step);
      acc += b[(lane + 5) % 128];
    } else {
      take(mode, 0, bars, step);
      const float got = a[(lane + 11) % 128];
      acc += got;
      b[lane] = got + 0.5f;
      hand(mode, 1, bars, lane);
    }
  }
  sums[tid] = acc + float(tid);
  __syncthreads();
  out[tid] = sums[(tid + 128) % 256];
}

int main(int argc, char** argv) {
  const int steps = argc > 1 ? atoi(argv[1]) : 8, mode = argc > 2 ? atoi(argv[2]) : 0;
  float* out;
  if (cudaMalloc(&out, 256 * sizeof(float)) != cudaSuccess) return 2;
  cudaMemset(out, 0xff, 256 * sizeof(float));  // NaN: every value must be written
  exchange<<<1, 256>>>(out, steps, mode);
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) { printf("launch: %s\n", cudaGetErrorString(err)); return 2; }
  float got[256];
  cudaMemcpy(got, out, sizeof(got), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int tid = 0; tid < 256; ++tid) {
    const int src = (tid + 128) % 256, lane = src % 128;
    double want = src;
    for (int step = 0; mode != 4 && step < steps; ++step) {
      // a[(l + step) % 128] = step * 1000 + l: slot j holds l = (j - step) mod 128.
      const int j1 = (((lane + 11) % 128) - step % 128 + 128) % 128;  // the writer of a slot warpgroup 1 reads
      if (src >= 128) want += step * 1000 + j1;
      const int l2 = (lane + 5) % 128;  // warpgroup 0 reads b[l2], written by warpgroup 1's thread l2
      const int j2 = (((l2 + 11) % 128) - step % 128 + 128) % 128;
      if (src < 128) want += step * 1000 + j2 + 0.5;
    }
    if (!(got[tid] == got[tid]) || got[tid] - want > 1e-2 * (1 + want) || want - got[tid] > 1e-2 * (1 + want)) ++wrong;
  }
  printf("mode %d, steps %d: %d of 256 values wrong\n", mode, steps, wrong);
  return wrong ? 1 : 0;
}
"""


def main() -> int:
    return run_racecheck("racecheck_exchange", SOURCE, __doc__,
                         lambda parser: parser.add_argument("--steps", type=int, default=8),
                         lambda args: [(f"mode{mode}", [args.steps, mode]) for mode in range(5)])


if __name__ == "__main__":
    sys.exit(main())
