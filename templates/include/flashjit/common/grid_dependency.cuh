// Programmatic dependent launch (sm_90 and newer): the split-KV merge pass is
// launched while the attention grid is still running, so that its launch
// latency (a few microseconds, a tenth of a short decode step) overlaps the
// attention grid's last wave instead of following it.
//  - Every attention CTA allows dependents as it starts: the merge grid may then
//    be scheduled once every attention CTA has started, taking SM slots only
//    as attention CTAs leave them.
//  - The merge kernels wait for the attention grid to complete, its memory
//    writes visible, before they read a partial state.
// Older GPUs launch the merge in plain stream order; the instructions compile
// to nothing there.
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

// Launches `kernel` on `stream`, overlapping the kernel before it where the
// current device supports programmatic dependent launch (compute capability 9+).
template <class... Params, class... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
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
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = cc >= 9 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flashjit
