// Per-device kernel setup shared by the launchers: the dynamic shared memory
// limit (a per-device attribute, raised once per device) and the occupancy
// that the host planner sizes its grids by.
#pragma once
#include <cuda_runtime.h>

namespace flashjit {

constexpr int kMaxDevices = 64;

template <auto kKernel>
cudaError_t ensure_smem_limit(int smem_bytes) {
  static bool configured[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool known = device >= 0 && device < kMaxDevices;
  if (known && configured[device]) return cudaSuccess;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err == cudaSuccess && known) configured[device] = true;
  return err;
}

// CTAs of the kernel that fit on one SM of the current device (0 on error).
template <auto kKernel>
int ctas_per_sm(int threads, int smem_bytes) {
  int count = 0;
  if (ensure_smem_limit<kKernel>(smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kKernel, threads, smem_bytes) != cudaSuccess)
    return 0;
  return count;
}

}  // namespace flashjit
