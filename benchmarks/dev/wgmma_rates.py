"""How fast the fa3 MLA kernel's products run on their own, in SM cycles: a
stand-alone CUDA program (nvcc, sm_90a; flashjit's fa3_wgmma.cuh forms, no
torch) that times wgmma loops on operands in shared memory laid out as the MLA
kernel's (fa3_mla.cuh: Q and a [ckv | kpe] tile of 64 rows x 9 swizzled
64-column blocks), one CTA of two warpgroups per SM:

- s64: one warpgroup, S = Q.K^T as the kernel issues it (36 k-steps of
  m64n64k16, one accumulator);
- s32x2: the same as two m64n32k16 accumulators (keys 0-31, 32-63);
- s64x2: the same as two m64n64k16 accumulators (even and odd k-steps);
- pv: one warpgroup, O += P.V as one consumer issues it (4 k-steps of
  m64n256k16, P and V from shared memory);
- s64+pv: one warpgroup's S beside the other's P.V, each in its own loop;
- s64+s64: both warpgroups' S, each in its own loop.

Each warpgroup's loop is timed with clock64 from a barrier both pass; a row
gives the median over the SMs of cycles per loop iteration (one S or one P.V)
and per k-step, and the bytes read from shared memory a cycle by that
warpgroup (A and B operands: a 64x16 and an Nx16 slice a k-step).

Usage: python benchmarks/dev/wgmma_rates.py [--iters 2000] [--build-only] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import build_cuda_program  # noqa: E402

from flashjit.render import templates_dir  # noqa: E402

MODES = ["s64", "s32x2", "s64x2", "pv", "s64+pv", "s64+s64"]

SOURCE = r"""
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cuda_runtime.h>
#include "flashjit/fa3/fa3_wgmma.cuh"

using T = __nv_bfloat16;
namespace fa3 = flashjit::fa3;
constexpr int kBlock = 64 * 128;           // one 64-column block of 64 rows
constexpr int kTile = 9 * kBlock;          // [ckv | kpe] rows: 72 KB
constexpr int kSmem = 2 * kTile + 1024;    // Q, the tile, alignment

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// What one warpgroup loops on: 0 idle, 1 S (one accumulator), 2 S as two n32
// accumulators, 3 S as two n64 accumulators, 4 P.V. Each kind keeps its own
// accumulators in its own function: none is live across the warpgroups'
// branch, which ptxas would otherwise take as divergent and serialize (C7520).
template <int kKind>
__device__ __forceinline__ long long loop(uint32_t q, uint32_t k, int iters, float* sink) {
  float s[8][4] = {}, s2[8][4] = {}, o[kKind == 4 ? 32 : 1][4] = {};
  const uint64_t q_desc = fa3::smem_desc(q, 16, 1024), k_desc = fa3::smem_desc(k, 16, 1024);
  const uint64_t p_desc = fa3::smem_desc(k + 8 * kBlock, 16, 1024), v_desc = fa3::smem_desc(k, kBlock, 1024);
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    fa3::fence();
    if constexpr (kKind == 1 || kKind == 3) {
#pragma unroll
      for (int kk = 0; kk < 36; ++kk) {
        const uint32_t at = (kk / 4) * kBlock + (kk % 4) * 32;
        if (kKind == 3 && kk % 2) fa3::mma_ss<T, 64>(s2, fa3::advance(q_desc, at), fa3::advance(k_desc, at), kk > 1);
        else fa3::mma_ss<T, 64>(s, fa3::advance(q_desc, at), fa3::advance(k_desc, at), kk > 1);
      }
    } else if constexpr (kKind == 2) {
#pragma unroll
      for (int kk = 0; kk < 36; ++kk) {
        const uint32_t at = (kk / 4) * kBlock + (kk % 4) * 32;
        fa3::mma_ss<T, 32>(*reinterpret_cast<float(*)[4][4]>(&s[0][0]), fa3::advance(q_desc, at),
                           fa3::advance(k_desc, at), kk > 0);
        fa3::mma_ss<T, 32>(*reinterpret_cast<float(*)[4][4]>(&s[4][0]), fa3::advance(q_desc, at),
                           fa3::advance(k_desc, at + 32 * 128), kk > 0);
      }
    } else if constexpr (kKind == 4) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        fa3::mma_ss_vt<T, 256>(o, fa3::advance(p_desc, kk * 32), fa3::advance(v_desc, kk * 16 * 128), 1);
    }
    fa3::commit();
    fa3::wait<0>();
    fa3::fence_operands(s);
    fa3::fence_operands(s2);
    fa3::fence_operands(o);
  }
  const long long t1 = clock64();
  *sink = s[0][0] + s2[1][1] + o[0][2];
  return t1 - t0;
}

template <int kKind0, int kKind1>
__global__ void __launch_bounds__(256, 1) rates(long long* out, float* sink, int iters) {
  extern __shared__ __align__(1024) unsigned char raw[];
  const uint32_t r = smem_addr(raw);
  unsigned char* smem = raw + (((r + 1023u) & ~1023u) - r);
  for (int i = threadIdx.x; i < 2 * kTile / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const uint32_t q = smem_addr(smem), k = q + kTile;
  const int wg = threadIdx.x / 128;
  long long cycles = 0;
  if (wg == 0) {
    if constexpr (kKind0 != 0) cycles = loop<kKind0>(q, k, iters, sink + threadIdx.x);
  } else {
    if constexpr (kKind1 != 0) cycles = loop<kKind1>(q, k, iters, sink + threadIdx.x);
  }
  if (threadIdx.x % 128 == 0) out[2 * blockIdx.x + wg] = cycles;
}

template <int kKind0, int kKind1>
int run(int iters) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* out;
  float* sink;
  cudaMalloc(&out, 2 * sms * sizeof(long long));
  cudaMalloc(&sink, 256 * sizeof(float));
  cudaFuncSetAttribute(rates<kKind0, kKind1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  rates<kKind0, kKind1><<<sms, 256, kSmem>>>(out, sink, 10);  // warm-up
  rates<kKind0, kKind1><<<sms, 256, kSmem>>>(out, sink, iters);
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) { printf("error %s\n", cudaGetErrorString(err)); return 2; }
  long long* host = new long long[2 * sms];
  cudaMemcpy(host, out, 2 * sms * sizeof(long long), cudaMemcpyDeviceToHost);
  for (int i = 0; i < 2 * sms; ++i) printf("%lld%c", host[i], i + 1 < 2 * sms ? ' ' : '\n');
  return 0;
}

int main(int argc, char** argv) {
  const int kind0 = atoi(argv[1]), kind1 = atoi(argv[2]), iters = atoi(argv[3]);
  if (kind0 == 1 && kind1 == 0) return run<1, 0>(iters);
  if (kind0 == 2 && kind1 == 0) return run<2, 0>(iters);
  if (kind0 == 3 && kind1 == 0) return run<3, 0>(iters);
  if (kind0 == 4 && kind1 == 0) return run<4, 0>(iters);
  if (kind0 == 1 && kind1 == 4) return run<1, 4>(iters);
  if (kind0 == 1 && kind1 == 1) return run<1, 1>(iters);
  printf("no such pair\n");
  return 2;
}
"""

# mode -> (warpgroup 0's loop, warpgroup 1's): 0 idle, 1 S, 2 S as n32 x 2, 3 S as n64 x 2, 4 P.V
KINDS = {"s64": (1, 0), "s32x2": (2, 0), "s64x2": (3, 0), "pv": (4, 0), "s64+pv": (1, 4), "s64+s64": (1, 1)}
# per loop iteration: (k-steps, bytes read from shared memory)
SHAPE = {1: (36, 36 * (2048 + 2048)), 2: (72, 72 * (2048 + 1024)), 3: (36, 36 * (2048 + 2048)),
         4: (4, 4 * (2048 + 8192))}


def build(folder: Path) -> Path:
    return build_cuda_program("wgmma_rates", SOURCE, folder, ["-std=c++17", "-I", str(templates_dir() / "include")])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--build-only", action="store_true", help="compile, run nothing (no GPU needed)")
    parser.add_argument("--out", type=Path, help="folder for the program (default: a temporary one)")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="wgmma-rates-"))
    folder.mkdir(parents=True, exist_ok=True)
    exe = build(folder)
    if args.build_only:
        print(f"built {exe}")
        return 0
    print("| mode | warpgroup | loop | cycles an iteration | cycles a k-step | shared-memory bytes a cycle |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        kinds = KINDS[mode]
        run = subprocess.run([str(exe), str(kinds[0]), str(kinds[1]), str(args.iters)], capture_output=True,
                             text=True, check=True)
        cycles = [int(x) for x in run.stdout.split()]
        for wg, kind in enumerate(kinds):
            if not kind:
                continue
            per_iter = statistics.median(cycles[wg::2]) / args.iters
            steps, nbytes = SHAPE[kind]
            name = {1: "S (1 accumulator)", 2: "S (2 x n32)", 3: "S (2 x n64)", 4: "P.V (n256)"}[kind]
            print(f"| {mode} | {wg} | {name} | {per_iter:.0f} | {per_iter / steps:.1f} | {nbytes / per_iter:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
