// What the attention launchers share: the dynamic shared memory limit (a
// per-device attribute, raised once per device), the occupancy that the host
// planner sizes its grids by, and the launch itself with its merge pass.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include "flashjit/common/merge_states.cuh"

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

// Multiprocessors of the current device, queried once per device (-1 on error).
inline int multiprocessors() {
  static int count[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  const bool known = device >= 0 && device < kMaxDevices;
  if (known && count[device] > 0) return count[device];
  int value = 0;
  if (cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return -1;
  if (known) count[device] = value;
  return value;
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

// Launches an attention kernel over (work items x KV heads, single-request
// splits) and, when it left partial states, the merge pass that writes o/lse.
// x enumerates (work slot, KV head) pairs in the plan's bands (work.cuh).
// `extra`: kernel arguments after p.
// `max_ctas` > 0: a persistent grid of at most that many CTAs, each walking
// launch positions x + k * gridDim.x of the (work slot, KV head, split) space
// (see decode_work_at); the kernel then takes the whole space in x.
template <auto kKernel, class DTypeO, int kHeadDimVO, bool kLse, class... Extra>
int launch_attention_ctas(const FlashjitAttentionParams& p, int threads, int smem_bytes, int max_ctas,
                          cudaStream_t stream, const Extra&... extra) {
  cudaError_t err = ensure_smem_limit<kKernel>(smem_bytes);
  if (err != cudaSuccess) return err;
  if (p.num_work == 0 || p.num_kv_heads == 0) return cudaSuccess;
  const long long ctas = static_cast<long long>(p.num_work) * p.num_kv_heads;
  const int splits = p.work == nullptr && p.num_splits > 1 ? p.num_splits : 1;
  if (ctas * splits > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  dim3 grid(static_cast<unsigned>(ctas), 1, splits);
  if (max_ctas > 0) grid = dim3(static_cast<unsigned>(std::min<long long>(ctas * splits, max_ctas)), 1, 1);
  err = launch_dependent(kKernel, grid, dim3(threads), smem_bytes, stream, p, extra...);
  if (err != cudaSuccess || !has_partial_states(p)) return err;
  return launch_merge_split_states<DTypeO, kHeadDimVO>(p, kLse, stream);
}

template <auto kKernel, class DTypeO, int kHeadDimVO, bool kLse, class... Extra>
int launch_attention(const FlashjitAttentionParams& p, int threads, int smem_bytes, cudaStream_t stream,
                     const Extra&... extra) {
  return launch_attention_ctas<kKernel, DTypeO, kHeadDimVO, kLse>(p, threads, smem_bytes, 0, stream, extra...);
}

}  // namespace flashjit
