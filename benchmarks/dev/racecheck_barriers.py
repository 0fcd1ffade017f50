"""Does compute-sanitizer's racecheck report hazards on a named-barrier hand-off
that is free of races? A stand-alone CUDA program (no flashjit, no torch) in the
shape of the fa3 MLA kernel with key groups (fa3_mla.cuh): a loader warpgroup
copies tiles into two slots by cp.async in three commit groups and, as each
group lands, arrives at a named barrier per slot and group (bar.arrive); one
consumer warpgroup waits there (bar.sync) and reads the group; it hands each
slot back by another named barrier. At the end that consumer stores row sums,
both consumer warpgroups meet at a 256-thread barrier (id 1) and read them.

Run with `--handoff 0` (the row-sum exchange alone) and `--handoff 1`, each
under racecheck: a hazard reported on the exchange in the second run alone is
the tool's reading of the hand-off, not a race (every value is also checked).
The program exits 1 when a value read is wrong.

Usage: python benchmarks/dev/racecheck_barriers.py [--build-only] [--tiles 6] [--out DIR]
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

constexpr int kGroups = 3, kStages = 2, kChunk = 4;  // floats per thread per group (16 bytes)

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ int group_bar(int t, int g) { return 6 + (t % kStages) * kGroups + g; }
__device__ __forceinline__ int slot_bar(int t) { return 12 + t % kStages; }

template <int N>
__device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__global__ void __launch_bounds__(384, 1) exchange(const float* src, float* out, int tiles, int handoff) {
  __shared__ __align__(16) float buf[kStages][kGroups][128 * kChunk];
  __shared__ float row_sums[128];
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 128;
  if (wg == 0) {
    for (int t = 0; handoff && t < tiles; ++t) {
      if (t >= kStages) bar_sync(slot_bar(t));  // the consumer has read the slot's tile t - 2
      for (int g = 0; g < kGroups; ++g) {
        const float* from = src + ((size_t(t) * kGroups + g) * 128 + lane) * kChunk;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(&buf[t % kStages][g][lane * kChunk])),
                     "l"(from) : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
      }
      wait_group<2>(); bar_arrive(group_bar(t, 0));
      wait_group<1>(); bar_arrive(group_bar(t, 1));
      wait_group<0>(); bar_arrive(group_bar(t, 2));
    }
    return;
  }
  if (wg == 2) {
    float sum = 0.f;
    for (int t = 0; handoff && t < tiles; ++t) {
      for (int g = 0; g < kGroups; ++g) {
        bar_sync(group_bar(t, g));
        for (int i = 0; i < 128 * kChunk; i += 128) sum += buf[t % kStages][g][i + lane];
      }
      if (t + kStages < tiles) bar_arrive(slot_bar(t));
    }
    row_sums[lane] = sum + float(lane);
  }
  bar_sync(1);
  out[tid - 128] = row_sums[(lane + 37) % 128];
}

int main(int argc, char** argv) {
  const int tiles = argc > 1 ? atoi(argv[1]) : 6, handoff = argc > 2 ? atoi(argv[2]) : 1;
  const size_t n = size_t(tiles) * kGroups * 128 * kChunk;
  float *src, *out;
  if (cudaMalloc(&src, n * sizeof(float)) != cudaSuccess || cudaMalloc(&out, 256 * sizeof(float)) != cudaSuccess) return 2;
  float* host = new float[n];
  for (size_t i = 0; i < n; ++i) host[i] = float((i * 2654435761u) % 1000) / 1000.f;
  cudaMemcpy(src, host, n * sizeof(float), cudaMemcpyHostToDevice);
  cudaMemset(out, 0xff, 256 * sizeof(float));  // NaN: every value must be written
  exchange<<<1, 384>>>(src, out, tiles, handoff);
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) { printf("launch: %s\n", cudaGetErrorString(err)); return 2; }
  float got[256];
  cudaMemcpy(got, out, sizeof(got), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int tid = 0; tid < 256; ++tid) {
    const int row = (tid % 128 + 37) % 128;
    double want = row;
    for (int t = 0; handoff && t < tiles; ++t)
      for (int g = 0; g < kGroups; ++g)
        for (int i = 0; i < 128 * kChunk; i += 128)
          want += host[(size_t(t) * kGroups + g) * 128 * kChunk + i + row];
    if (!(got[tid] == got[tid]) || (got[tid] - want > 1e-3 * (1 + want)) || (want - got[tid] > 1e-3 * (1 + want))) ++wrong;
  }
  printf("handoff %d, tiles %d: %d of 256 values wrong\n", handoff, tiles, wrong);
  return wrong ? 1 : 0;
}
"""


def main() -> int:
    return run_racecheck("racecheck_barriers", SOURCE, __doc__,
                         lambda parser: parser.add_argument("--tiles", type=int, default=6),
                         lambda args: [(f"handoff{h}", [args.tiles, h]) for h in (0, 1)])


if __name__ == "__main__":
    sys.exit(main())
