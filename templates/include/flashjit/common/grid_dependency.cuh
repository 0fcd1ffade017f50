// Programmatic dependent launch (sm_90 and newer): a grid is launched while
// the grid before it in the stream is still running, so that its launch
// latency (a few microseconds, as much as a tiny attention call's own work)
// overlaps that grid instead of following it.
//  - Every attention CTA allows dependents as it starts, and then waits for the
//    grid before it (if one of ours: it allowed dependents too) to complete
//    with its memory writes visible, before it reads an input or writes
//    anything; only the plan's own arrays (work items, indptr), which the plan
//    copied in and no grid writes, are read ahead of the wait (decode_work). A
//    dependent grid is scheduled once every CTA of the one before has started,
//    taking SM slots only as they free up; what overlaps is its launch and its
//    reads of the plan's arrays, never a read of an input or a write.
//  - The split-KV merge pass is such a dependent of its attention grid: it
//    allows dependents as it starts (the next call's attention grid) and waits
//    likewise before it reads a partial state; only the plan's own arrays,
//    written before the attention grid ran, are read ahead of the wait. A grid
//    that never allows dependents (a torch kernel, a copy) releases the next at
//    its end.
// Older GPUs launch in plain stream order; the instructions compile to nothing
// there.
#pragma once
#include <cuda_runtime.h>
#include <utility>

namespace flashjit {

__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches `kernel` on `stream` (smem_bytes of dynamic shared memory),
// overlapping the kernel before it where the current device supports
// programmatic dependent launch (compute capability 9+). The kernel must call
// wait_for_primary_grid() before its first global memory access.
template <class... Params, class... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                             Args&&... args) {
  constexpr int kMaxDevices = 64;
  static int major[kMaxDevices] = {};  // 0: not queried yet
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int cc = 0;
  if (device >= 0 && device < kMaxDevices && major[device] != 0) {
    cc = major[device];
  } else {
    err = cudaDeviceGetAttribute(&cc, cudaDevAttrComputeCapabilityMajor, device);
    if (err != cudaSuccess) return err;
    if (device >= 0 && device < kMaxDevices) major[device] = cc;
  }
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = cc >= 9 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flashjit
