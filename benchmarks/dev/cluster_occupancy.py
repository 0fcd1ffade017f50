"""How many clusters of one-CTA-per-SM CTAs can run at once? A stand-alone
CUDA program (no flashjit, no torch) asks cudaOccupancyMaxActiveClusters for a
kernel of the fa3 MLA kernels' shape (384 threads, 227 KB of dynamic shared
memory: one CTA per SM) in clusters of 1, 2, 4, 8 and 16 CTAs. A plan whose
clusters do not all fit runs a second wave: e.g. the page-1 row of
benchmarks/mla.py splits 32 requests into 4 chunks each, 32 clusters of 4 if a
request's chunks were to merge through distributed shared memory.

Usage: python benchmarks/dev/cluster_occupancy.py [--build-only] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import run_standalone  # noqa: E402

SOURCE = r"""
#include <cstdio>
#include <cuda_runtime.h>
__global__ void one_per_sm(int* x) {
  extern __shared__ int s[];
  if (x) x[0] = s[threadIdx.x];
}
int main() {
  const int smem = 227 * 1024;
  if (cudaFuncSetAttribute(one_per_sm, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
      cudaFuncSetAttribute(one_per_sm, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    printf("cudaFuncSetAttribute failed\n");
    return 1;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s, %d SMs; 384 threads, %d B of shared memory a CTA\n", prop.name, prop.multiProcessorCount, smem);
  printf("| cluster size | clusters at once | CTAs at once |\n|---|---|---|\n");
  for (int size : {1, 2, 4, 8, 16}) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(size * 64);
    cfg.blockDim = dim3(384);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = size;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = -1;
    const cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, one_per_sm, &cfg);
    if (err != cudaSuccess) {
      printf("cluster size %d: %s\n", size, cudaGetErrorString(err));
      return 1;
    }
    printf("| %d | %d | %d |\n", size, clusters, clusters * size);
  }
  return 0;
}
"""


if __name__ == "__main__":
    sys.exit(run_standalone("cluster_occupancy", SOURCE, __doc__))
