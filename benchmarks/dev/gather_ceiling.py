"""How fast can 128 CTAs read the page-1 MLA row's key rows, with nothing else
to do? A stand-alone CUDA program (no torch) that copies the keys of
benchmarks/mla.py's page-1 row (32 requests x 8192 keys, page size 1: per key a
1024-byte ckv row and a 128-byte kpe row, pages in a random order, then in
order) into shared memory as the fa3 MLA kernel's loader warpgroup does
(fa3/fa3_mla_copy.cuh MlaGather: 128 threads, 8 a key row, 16-byte cp.async of
every 128-byte block into the swizzled blocked tile, page ids looked up a tile
ahead), one CTA per (request, quarter of its keys) as the kernel's split plan
gives and one CTA an SM (at least 116 KB of shared memory each), and no
arithmetic. A landed tile is held, tiles in order as by a consumer, before its
slot is refilled, over a ring of 1, 2 or 3 slots of 72 KB (the kernel has 2
beside Q): for a number of cycles, or while its threads read the tile and a
Q-sized region of shared memory once or twice (144 or 288 KB; the kernel's
products read about 224 KB a tile). Variants of a 2-slot ring: the threads
split by slot, each half copying its own slot's tiles and waiting for those
alone ("per slot", else all copy every tile), and each row's blocks issued in
the kernel's three key groups (blocks 0-2, 3-5, 6-8 of every row in turn)
rather than a row's nine together.

A row gives the median over --reps launches of the grid's span (first CTA's
start to last CTA's end, %globaltimer) and of the period of back-to-back
launches (CUDA events over all of them, launch gaps included), as GB/s of the
key bytes (ckv and kpe, as mla.py counts them), beside the device's copy
bandwidth (cudaMemcpy of 2 GiB, read + write bytes, as mla.py's header).

Usage: python benchmarks/dev/gather_ceiling.py [--build-only] [--out DIR] [--reps 30]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import PROBE_HELPERS, run_standalone  # noqa: E402

from flashjit.render import templates_dir  # noqa: E402

SOURCE = PROBE_HELPERS + r"""
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>
#include "flashjit/common/async_copy.cuh"

constexpr int kRequests = 32, kKvLen = 8192, kChunks = 4;
constexpr int kKeys = kRequests * kKvLen, kKeysPerCta = kKvLen / kChunks, kCtas = kRequests * kChunks;
constexpr int kTileKeys = 64, kBlocks = 9, kBlockBytes = kTileKeys * 128, kTileBytes = kBlocks * kBlockBytes;
constexpr int kThreads = 128;
constexpr int kTiles = kKeysPerCta / kTileKeys;

// span[0] the earliest CTA start, span[1] the latest CTA end (ns).
// kPerSlot: the threads are split by slot, each part copying its own slot's
// tiles and waiting for them alone (else all copy every tile). kGroupMajor:
// a thread issues blocks 0-2 of its rows, then 3-5, then 6-8 (the MLA
// kernel's key groups), else each row's nine blocks together. A tile is held
// `hold` cycles once landed, or while its threads make `read_passes` passes of
// 16-byte reads over it and a Q-sized region, tiles in order (a consumer),
// then refilled.
template <int kStages, bool kPerSlot, bool kGroupMajor>
__global__ void __launch_bounds__(kThreads) gather(const char* ckv, const char* kpe, const int* pages, int hold,
                                                   int read_passes,
                                                   unsigned long long* span, float* sink) {
  constexpr int kCopyThreads = kPerSlot ? kThreads / kStages : kThreads;
  constexpr int kRows = kCopyThreads / 8, kPassesT = kTileKeys / kRows;
  extern __shared__ __align__(1024) char smem[];
  volatile int* consumed = reinterpret_cast<volatile int*>(smem + kStages * kTileBytes);
  if (threadIdx.x == 0) {
    atomicMin(&span[0], globaltimer());
    *consumed = 0;
  }
  __syncthreads();
  const int set = kPerSlot ? threadIdx.x / kCopyThreads : 0, ctid = threadIdx.x % kCopyThreads;
  const int sub = ctid % 8, row0 = ctid / 8;
  const int* my_pages = pages + blockIdx.x * kKeysPerCta;
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem));
  int next[kPassesT];
  auto lookup = [&](int t) {
#pragma unroll
    for (int i = 0; i < kPassesT; ++i) next[i] = t < kTiles ? my_pages[t * kTileKeys + row0 + i * kRows] : 0;
  };
  auto copy_blocks = [&](int t, int b0, int b1) {
#pragma unroll
    for (int i = 0; i < kPassesT; ++i) {
      const int row = row0 + i * kRows;
      const char* c = ckv + size_t(next[i]) * 1024 + sub * 16;
      const char* k = kpe + size_t(next[i]) * 128 + sub * 16;
      const uint32_t dst = base + (t % kStages) * kTileBytes + row * 128 + ((sub ^ (row % 8)) * 16);
#pragma unroll
      for (int b = b0; b < b1; ++b)
        flashjit::cp_async_16(dst + b * kBlockBytes, b + 1 < kBlocks ? c + b * 128 : k, true);
    }
  };
  auto issue = [&](int t, int ahead) {
    if (t < kTiles) {
      if (kGroupMajor) {
        copy_blocks(t, 0, 3);
        copy_blocks(t, 3, 6);
        copy_blocks(t, 6, 9);
      } else {
        copy_blocks(t, 0, kBlocks);
      }
    }
    flashjit::cp_async_commit();
    lookup(t + ahead);
  };
  auto hold_tile = [&](int t) {
    acc_sink(sink, reinterpret_cast<const float*>(smem + (t % kStages) * kTileBytes)[ctid]);
    if (read_passes > 0) {
      const uint32_t slot = base + (t % kStages) * kTileBytes, q = base + kStages * kTileBytes + 1024;
      float a = 0.f;
      for (int pass = 0; pass < read_passes; ++pass) {
#pragma unroll 4
        for (int at = ctid * 16; at < kTileBytes; at += kCopyThreads * 16) {
          const uint4 k = flashjit::ld_shared_16(slot + at), v = flashjit::ld_shared_16(q + at);
          a += __int_as_float(k.x ^ v.w);
        }
      }
      acc_sink(sink, a);
    }
    if (hold > 0) {
      const long long until = clock64() + hold;
      while (clock64() < until) {
      }
    }
  };
  if constexpr (!kPerSlot) {
    lookup(0);
#pragma unroll
    for (int s = 0; s < kStages; ++s) issue(s, 1);
    for (int t = 0; t < kTiles; ++t) {
      flashjit::cp_async_wait<kStages - 1>();
      __syncthreads();
      hold_tile(t);
      __syncthreads();
      issue(t + kStages, 1);
    }
  } else {
    auto set_barrier = [&] { asm volatile("bar.sync %0, %1;" ::"r"(1 + set), "n"(kCopyThreads) : "memory"); };
    lookup(set);
    issue(set, kStages);
    for (int t = set; t < kTiles; t += kStages) {
      flashjit::cp_async_wait<0>();
      if (ctid == 0)
        while (*consumed != t) {
        }
      set_barrier();
      hold_tile(t);
      set_barrier();
      if (ctid == 0) *consumed = t + 1;
      issue(t + kStages, kStages);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&span[1], globaltimer());
}

template <int kStages, bool kPerSlot, bool kGroupMajor>
void measure(const char* ckv, const char* kpe, const int* pages, int hold, int read_passes, int reps,
             const char* order, unsigned long long* span, float* sink, double copy_gbps) {
  auto kernel = gather<kStages, kPerSlot, kGroupMajor>;
  // At least half the SM's shared memory: one CTA an SM, as the MLA kernel.
  const int smem = std::max(kStages * kTileBytes + 1024 + (read_passes > 0 ? kTileBytes : 0), 116 * 1024);
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const double bytes = double(kKeys) * (1024 + 128);
  std::vector<double> spans;
  const unsigned long long init[2] = {~0ull, 0ull};
  for (int r = 0; r < reps + 3; ++r) {
    CHECK(cudaMemcpy(span, init, sizeof(init), cudaMemcpyHostToDevice));
    kernel<<<kCtas, kThreads, smem>>>(ckv, kpe, pages, hold, read_passes, span, sink);
    CHECK(cudaGetLastError());
    unsigned long long got[2];
    CHECK(cudaMemcpy(got, span, sizeof(got), cudaMemcpyDeviceToHost));
    if (r >= 3) spans.push_back(double(got[1] - got[0]) * 1e-3);
  }
  std::sort(spans.begin(), spans.end());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int r = 0; r < reps; ++r)
    kernel<<<kCtas, kThreads, smem>>>(ckv, kpe, pages, hold, read_passes, span, sink);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaGetLastError());
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  const double span_us = spans[spans.size() / 2], period_us = ms * 1e3 / reps;
  char held[32];
  std::snprintf(held, sizeof(held), read_passes > 0 ? "%d KB read" : "%d",
                read_passes > 0 ? read_passes * 144 : hold);
  std::printf("| %s | %d | %s | %s | %s | %.1f | %.0f | %.1f%% | %.1f | %.0f | %.1f%% |\n", order, kStages,
              kPerSlot ? "per slot" : "all", kGroupMajor ? "groups" : "rows", held, span_us,
              bytes / span_us * 1e-3, 100.0 * bytes / span_us * 1e-3 / copy_gbps, period_us, bytes / period_us * 1e-3,
              100.0 * bytes / period_us * 1e-3 / copy_gbps);
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 30;
  char *ckv, *kpe, *big_a, *big_b;
  int* pages;
  unsigned long long* span;
  float* sink;
  CHECK(cudaMalloc(&ckv, size_t(kKeys) * 1024));
  CHECK(cudaMalloc(&kpe, size_t(kKeys) * 128));
  CHECK(cudaMalloc(&pages, size_t(kKeys) * 4));
  CHECK(cudaMalloc(&span, 16));
  CHECK(cudaMalloc(&sink, kThreads * 4));
  CHECK(cudaMemset(ckv, 0x3c, size_t(kKeys) * 1024));
  CHECK(cudaMemset(kpe, 0x3c, size_t(kKeys) * 128));

  const size_t copy_bytes = size_t(2) << 30;
  CHECK(cudaMalloc(&big_a, copy_bytes));
  CHECK(cudaMalloc(&big_b, copy_bytes));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<double> copies;
  for (int r = 0; r < 12; ++r) {
    CHECK(cudaEventRecord(a));
    CHECK(cudaMemcpyAsync(big_b, big_a, copy_bytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) copies.push_back(2.0 * copy_bytes / (ms * 1e-3) * 1e-9);
  }
  std::sort(copies.begin(), copies.end());
  const double copy_gbps = copies[copies.size() / 2];
  CHECK(cudaFree(big_a));
  CHECK(cudaFree(big_b));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; copy bandwidth %.0f GB/s (2 GiB cudaMemcpy, read + write), 85%% of it %.0f GB/s\n\n",
              prop.name, prop.multiProcessorCount, copy_gbps, 0.85 * copy_gbps);
  std::printf("| page order | slots | copied by | issue order | hold (cycles, or smem read) | span us | GB/s | of copy "
              "| period us | GB/s | of copy |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");

  std::vector<int> host(kKeys);
  for (int order = 0; order < 2; ++order) {
    for (int i = 0; i < kKeys; ++i) host[i] = i;
    if (order == 0) std::shuffle(host.begin(), host.end(), std::mt19937(1234));
    CHECK(cudaMemcpy(pages, host.data(), size_t(kKeys) * 4, cudaMemcpyHostToDevice));
    const char* name = order == 0 ? "random" : "in order";
    // Held by reading the tile and a Q-sized region once or twice (144 or 288
    // KB of shared memory; the kernel's products read about 224 KB a tile).
    for (int passes : {1, 2}) {
      measure<1, false, false>(ckv, kpe, pages, 0, passes, reps, name, span, sink, copy_gbps);
      measure<2, false, false>(ckv, kpe, pages, 0, passes, reps, name, span, sink, copy_gbps);
      measure<2, true, true>(ckv, kpe, pages, 0, passes, reps, name, span, sink, copy_gbps);
    }
    for (int hold : {0, 1500, 3000, 4500}) {
      measure<1, false, false>(ckv, kpe, pages, hold, 0, reps, name, span, sink, copy_gbps);
      measure<2, false, false>(ckv, kpe, pages, hold, 0, reps, name, span, sink, copy_gbps);
      measure<2, false, true>(ckv, kpe, pages, hold, 0, reps, name, span, sink, copy_gbps);
      measure<2, true, false>(ckv, kpe, pages, hold, 0, reps, name, span, sink, copy_gbps);
      measure<2, true, true>(ckv, kpe, pages, hold, 0, reps, name, span, sink, copy_gbps);
      measure<3, false, false>(ckv, kpe, pages, hold, 0, reps, name, span, sink, copy_gbps);
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
"""


if __name__ == "__main__":
    sys.exit(run_standalone("gather_ceiling", SOURCE, __doc__, ["-std=c++17", "-I", str(templates_dir() / "include")],
                            reps=30, reps_help="launches a row (median span, mean period)"))
