// Tensor-memory-accelerator (TMA) loads of K/V tiles on sm_90a, and the
// mbarriers that tell the CTA they have landed.
//
// One thread issues a tile's loads; the TMA unit writes them into shared memory
// with the 128-byte swizzle (one [rows][128 B] block per load: the BlockedTile
// layout of fa2_primitives.cuh) and counts the bytes it wrote against the
// stage's mbarrier; every thread waits on the barrier's phase. This takes the
// per-thread address arithmetic and the 16-byte cp.async of every row off the
// warps (docs/fa2.md, "Tilings and why").
//
// The host describes K and V of one launch to the TMA unit as tensor maps
// (KvTensorMaps, encoded per call from the launch parameters) that travel with
// the kernel's parameters.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <type_traits>
#include "flashjit/common/attention_params.cuh"

namespace flashjit {

// K and V of one launch as 3-D tensors (head dims, KV heads, tokens), in
// whichever order of the two outer dimensions has the smaller stride first.
struct KvTensorMaps {
  CUtensorMap k, v;
  int32_t heads_outer_k, heads_outer_v;  // 1: dimension 1 is tokens, 2 is heads
};

// Empty stand-in for kernels that copy K/V with cp.async.
template <bool kTma>
struct KvMapsArg {};
template <>
struct KvMapsArg<true> {
  KvTensorMaps maps;
};

// The K/V argument of kernels that also read paged caches by TMA: the maps
// and, for a paged cache, the token rows of one box (one whole page, or a
// tile's worth of a larger one); 0 when the kernel gathers paged rows itself.
struct KvMapsPagedArg {
  KvTensorMaps maps;
  int32_t page_box_rows;
};

namespace tma {

__device__ __forceinline__ void mbar_init(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes initialised mbarriers visible to the TMA unit (the async proxy); a CTA
// barrier must follow before other threads use them.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Arrives on `bar` (this thread's one arrival of the phase) and adds `bytes`
// that loads must still deliver before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// The same arrival, returning the barrier's state before it (an opaque token).
__device__ __forceinline__ uint64_t mbar_arrive_state(uint32_t bar) {
  uint64_t state;
  asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(state) : "r"(bar) : "memory");
  return state;
}

__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred done;\n mbarrier.try_wait.parity.shared::cta.b64 done, [%1], %2;\n selp.u32 %0, 1, 0, done;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Waits until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Copies `bytes` (a multiple of 16) from shared memory at `src` to global
// memory at `dst`, both 16-byte aligned, by the bulk copy engine, in this
// thread's bulk group (store_commit, store_wait_read).
__device__ __forceinline__ void store_bulk(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until this thread's committed bulk stores have read their shared memory,
// which may then be written or freed (the global writes complete on their own;
// the kernel's end makes them visible to later grids).
__device__ __forceinline__ void store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// Fetches a tensor map into the TMA unit's cache ahead of its first load.
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Loads the box at (c0, c1, c2) of `map` into shared memory at `dst`; the bytes
// complete on `bar`.
__device__ __forceinline__ void load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                        uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                        uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Loads block `block` (head dims 64 * block .. + 63 for 16-bit types) of keys
// token .. token + box rows - 1 of KV head `head`.
__device__ __forceinline__ void load_kv_block(uint32_t dst, const CUtensorMap* map, int heads_outer, int block,
                                              int head, int token, uint32_t bar) {
  if (heads_outer) {
    load_3d(dst, map, 64 * block, token, head, bar);
  } else {
    load_3d(dst, map, 64 * block, head, token, bar);
  }
}

// ---- Host side ----

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, looked up once through the runtime (the
// library links no libcuda); null when the driver lacks it.
inline EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

// A launch over one request (no qo_indptr): its keys are all of K and V, so
// its maps end where they do and a partial last tile loads by TMA, zero-filled.
__host__ __device__ __forceinline__ bool single_request_maps(const FlashjitAttentionParams& p) {
  return p.qo_indptr == nullptr;
}

// Tensor map of a ragged K or V tensor ([tokens, heads, head_dim], element
// strides stride_n, stride_h) with boxes of 64 head dims x 1 head x kBoxRows
// of `tokens` tokens. A batch's maps leave the count unbounded (2^31 - 1): the
// kernel loads only whole tiles of a request's keys and copies a partial last
// tile itself. Returns a cudaError_t value.
template <int kBoxRows>
int encode_kv_map(CUtensorMap* map, int32_t* heads_outer, const void* data, CUtensorMapDataType dtype, int head_dim,
                  int heads, int64_t stride_n, int64_t stride_h, cuuint64_t tokens) {
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (heads == 1) stride_h = stride_n;  // never stepped; whatever a view left there (even 0) must not reach the map
  *heads_outer = stride_h > stride_n;   // the smaller stride first
  const cuuint64_t dims[3] = {cuuint64_t(head_dim), *heads_outer ? tokens : cuuint64_t(heads),
                              *heads_outer ? cuuint64_t(heads) : tokens};
  const cuuint64_t strides[2] = {cuuint64_t(*heads_outer ? stride_n : stride_h) * 2,
                                 cuuint64_t(*heads_outer ? stride_h : stride_n) * 2};
  const cuuint32_t box[3] = {64, *heads_outer ? cuuint32_t(kBoxRows) : 1u, *heads_outer ? 1u : cuuint32_t(kBoxRows)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult res = encode(map, dtype, 3, const_cast<void*>(data), dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Tensor map of a paged K or V cache (element strides stride_n between a
// page's slots, stride_h between heads, stride_page between pages) as 4-D
// (head dims, slots and heads in stride order, pages) with boxes of 64 head dims
// x 1 head x box_rows slots x 1 page. The page count is left unbounded: the
// kernel loads pages of the request's page table, which run() checks against
// the cache. Returns a cudaError_t value.
inline int encode_paged_kv_map(CUtensorMap* map, int32_t* heads_outer, const void* data, CUtensorMapDataType dtype,
                               int head_dim, int heads, int page_size, int64_t stride_n, int64_t stride_h,
                               int64_t stride_page, int box_rows) {
  const EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (heads == 1) stride_h = stride_n;  // as encode_kv_map
  *heads_outer = stride_h > stride_n;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(*heads_outer ? page_size : heads),
                              cuuint64_t(*heads_outer ? heads : page_size), 0x7fffffff};
  const cuuint64_t strides[3] = {cuuint64_t(*heads_outer ? stride_n : stride_h) * 2,
                                 cuuint64_t(*heads_outer ? stride_h : stride_n) * 2, cuuint64_t(stride_page) * 2};
  const cuuint32_t box[4] = {64, *heads_outer ? cuuint32_t(box_rows) : 1u, *heads_outer ? 1u : cuuint32_t(box_rows),
                             1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult res = encode(map, dtype, 4, const_cast<void*>(data), dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Both tensor maps of a launch's K and V (16-bit DType, boxes of kBoxRows
// tokens, K head_dim_k and V head_dim_v wide), from its parameters. Returns a
// cudaError_t value.
template <class DType, int kBoxRows>
int encode_kv_maps(KvTensorMaps* maps, const FlashjitAttentionParams& p, int head_dim_k, int head_dim_v) {
  constexpr CUtensorMapDataType kType =
      std::is_same<DType, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  // A single request's keys are the whole tensor: the map ends there, and a
  // box past the end reads zeros (single_request_maps). A batch's run on into
  // the next request's, so its maps are left unbounded and partial tiles copied.
  const cuuint64_t tokens = single_request_maps(p) ? cuuint64_t(p.kv_len > 0 ? p.kv_len : 1) : 0x7fffffff;
  const int err = encode_kv_map<kBoxRows>(&maps->k, &maps->heads_outer_k, p.k, kType, head_dim_k, p.num_kv_heads,
                                          p.k_stride_n, p.k_stride_h, tokens);
  if (err != cudaSuccess) return err;
  return encode_kv_map<kBoxRows>(&maps->v, &maps->heads_outer_v, p.v, kType, head_dim_v, p.num_kv_heads,
                                 p.v_stride_n, p.v_stride_h, tokens);
}

// Both maps of a paged launch's caches, K head_dim_k and V head_dim_v wide (MLA:
// ckv 512 as K, kpe 64 as V), boxes of box_rows slots. Returns a cudaError_t value.
template <class DType>
int encode_paged_kv_maps(KvTensorMaps* maps, const FlashjitAttentionParams& p, int head_dim_k, int head_dim_v,
                         int box_rows) {
  constexpr CUtensorMapDataType kType =
      std::is_same<DType, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const int err = encode_paged_kv_map(&maps->k, &maps->heads_outer_k, p.k, kType, head_dim_k, p.num_kv_heads,
                                      p.page_size, p.k_stride_n, p.k_stride_h, p.k_stride_page, box_rows);
  if (err != cudaSuccess) return err;
  return encode_paged_kv_map(&maps->v, &maps->heads_outer_v, p.v, kType, head_dim_v, p.num_kv_heads, p.page_size,
                             p.v_stride_n, p.v_stride_h, p.v_stride_page, box_rows);
}

}  // namespace tma
}  // namespace flashjit
