"""How fast can shared memory be filled from global memory by bulk copies, per
SM and in all, with nothing else to do? A stand-alone CUDA program (no torch):
each CTA (one an SM: at least 116 KB of shared memory) streams 64 tiles of
72 KB, the fa3 MLA kernels' tile of 64 keys x 576 columns, through a ring of
1, 2 or 3 slots. A tile comes as nine 8 KB `cp.async.bulk` copies counted on
the slot's mbarrier (the MLA kernels' nine TMA boxes, here contiguous). The
consuming threads wait for it and hold it for `hold` cycles (a consumer's work,
as the MLA kernels' products of a tile: about 2200 cycles at the tensor pipe's
peak). Then the slot is refilled, in one of three ways:
- by lane 0 of the first warp, once all threads are past the tile (a CTA
  barrier), as the MLA pairs kernel's consumers issue their refills;
- the same by nine lanes, one copy each;
- by a producer warp that holds no tile, once the other three warps have
  arrived on the slot's "empty" mbarrier, as the MLA loader kernel's loader
  warpgroup does.

Where the tiles come from:
- "distinct": each CTA its own 4.5 MB (the 64- and 16-head rows: every key read
  from device memory once, by one CTA);
- "pairs": CTAs 2i and 2i + 1 read the same 4.5 MB at the same time (the
  128-head row: a token's two row tiles read the same keys, one of them mostly
  from L2);
- "L2": CTA c reads region c % 4 (18 MB in all, read once before timing), each
  from its own starting tile: L2 hits.

A row gives the median over --reps launches of the grid's span (first CTA's
start to last CTA's end, %globaltimer), the bytes landed in shared memory per
second in all and per CTA, per SM cycle (CTA 0's clock over its span), the
period of a tile in SM cycles, and the cycles CTA 0's issuing lane 0 spent on a
tile's copies (the issuing thread is held until the copy unit takes them).

Usage: python benchmarks/dev/smem_fill_rate.py [--build-only] [--out DIR] [--reps 20]
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
#include <vector>
#include "flashjit/common/async_copy.cuh"
#include "flashjit/common/tma.cuh"

constexpr int kThreads = 128, kBoxes = 9, kBoxBytes = 8192, kTileBytes = kBoxes * kBoxBytes, kTiles = 64;
constexpr size_t kRegionBytes = size_t(kTiles) * kTileBytes;
constexpr int kMaxCtas = 132, kL2Regions = 4;
enum Source { kDistinct, kPairs, kL2 };
const char* kSourceNames[] = {"distinct", "pairs", "L2"};

// stamps[5c .. 5c + 4]: CTA c's start and end (%globaltimer ns), then
// clock64, then the cycles lane 0 spent in issue() over the refills.
template <int kSlots, int kIssuers>
__global__ void __launch_bounds__(kThreads, 1) fill(const char* src, int source, int hold,
                                                    unsigned long long* stamps, float* sink) {
  extern __shared__ __align__(1024) char smem[];
  const uint32_t base = uint32_t(__cvta_generic_to_shared(smem)), bars = base + kSlots * kTileBytes;
  const int region = source == kDistinct ? blockIdx.x : source == kPairs ? blockIdx.x / 2 : blockIdx.x % kL2Regions;
  // The two CTAs of a pair walk their region in step; L2 readers of one region do not.
  const int first = ((source == kL2 ? blockIdx.x : region) * 7) % kTiles;
  const char* mine = src + size_t(region) * kRegionBytes;
  // kIssuers 0: the last warp is a producer that refills a slot once the other
  // three warps have arrived on its "empty" mbarrier; it holds no tile.
  constexpr bool kProducer = kIssuers == 0;
  constexpr int kLanes = kProducer ? 1 : kIssuers, kConsumers = kProducer ? kThreads - 32 : kThreads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool issuer = warp == (kProducer ? kThreads / 32 - 1 : 0);
  unsigned long long t0 = 0, c0 = 0, issuing = 0;
  if (threadIdx.x == 0) {
    t0 = globaltimer();
    c0 = clock64();
    for (int s = 0; s < kSlots; ++s) {
      flashjit::tma::mbar_init(bars + 8 * s, 1);
      flashjit::tma::mbar_init(bars + 8 * (kSlots + s), kConsumers);
    }
    flashjit::tma::fence_mbar_init();
  }
  __syncthreads();
  // Called by the issuing warp: lane 0 arms the slot's mbarrier, then lanes
  // 0 .. kLanes - 1 issue the tile's copies between them.
  auto issue = [&](int t) {
    const uint32_t bar = bars + 8 * (t % kSlots), dst = base + (t % kSlots) * kTileBytes;
    const char* from = mine + size_t((first + t) % kTiles) * kTileBytes;
    if (lane == 0) flashjit::tma::mbar_arrive_expect_tx(bar, kTileBytes);
    __syncwarp();
    for (int b = lane; b < kBoxes && lane < kLanes; b += kLanes)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                   ::"r"(dst + b * kBoxBytes), "l"(from + b * kBoxBytes), "n"(kBoxBytes), "r"(bar) : "memory");
  };
  auto timed_issue = [&](int t) {
    const long long before = clock64();
    issue(t);
    issuing += clock64() - before;
  };
  if (issuer)
    for (int s = 0; s < kSlots && s < kTiles; ++s) issue(s);
  if (kProducer && issuer) {
    for (int t = 0; t + kSlots < kTiles; ++t) {
      flashjit::tma::mbar_wait(bars + 8 * (kSlots + t % kSlots), (t / kSlots) & 1);
      timed_issue(t + kSlots);
    }
  } else {
    for (int t = 0; t < kTiles; ++t) {
      flashjit::tma::mbar_wait(bars + 8 * (t % kSlots), (t / kSlots) & 1);
      acc_sink(sink, reinterpret_cast<const float*>(smem + (t % kSlots) * kTileBytes)[threadIdx.x]);
      if (hold > 0) {
        const long long until = clock64() + hold;
        while (clock64() < until) {
        }
      }
      if (kProducer) {
        flashjit::tma::mbar_arrive(bars + 8 * (kSlots + t % kSlots));
      } else {
        __syncthreads();
        if (issuer && t + kSlots < kTiles) timed_issue(t + kSlots);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long* out = stamps + 5 * blockIdx.x;
    out[0] = t0;
    out[1] = globaltimer();
    out[2] = c0;
    out[3] = clock64();
  }
  if (issuer && lane == 0) stamps[5 * blockIdx.x + 4] = issuing;
}

template <int kSlots, int kIssuers = 1>
void measure(const char* src, int source, int ctas, int hold, int reps, unsigned long long* stamps, float* sink) {
  auto kernel = fill<kSlots, kIssuers>;
  const int smem = std::max(kSlots * kTileBytes + 1024, 116 * 1024);
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<double> spans, ghz, issue;
  std::vector<unsigned long long> got(5 * ctas);
  for (int r = 0; r < reps + 2; ++r) {
    kernel<<<ctas, kThreads, smem>>>(src, source, hold, stamps, sink);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(got.data(), stamps, got.size() * 8, cudaMemcpyDeviceToHost));
    unsigned long long start = ~0ull, end = 0;
    for (int c = 0; c < ctas; ++c) {
      start = std::min(start, got[5 * c]);
      end = std::max(end, got[5 * c + 1]);
    }
    if (r >= 2) {
      spans.push_back(double(end - start) * 1e-3);
      ghz.push_back(double(got[3] - got[2]) / double(got[1] - got[0]));
      issue.push_back(double(got[4]) / (kTiles - kSlots));
    }
  }
  std::sort(spans.begin(), spans.end());
  std::sort(ghz.begin(), ghz.end());
  std::sort(issue.begin(), issue.end());
  const double span_us = spans[spans.size() / 2], clock = ghz[ghz.size() / 2];
  const double per_cta = double(kTiles) * kTileBytes / span_us * 1e-3;  // GB/s
  const char* by = kIssuers == 0 ? "producer warp" : kIssuers == 1 ? "lane 0" : "9 lanes";
  std::printf("| %s | %d | %d | %s | %d | %.1f | %.0f | %.1f | %.1f | %.0f | %.0f | %.2f |\n",
              kSourceNames[source], ctas, kSlots, by, hold, span_us, per_cta * ctas, per_cta, per_cta / clock,
              span_us * 1e3 * clock / kTiles,
              issue[issue.size() / 2], clock);
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  char* src;
  unsigned long long* stamps;
  float* sink;
  const size_t bytes = size_t(kMaxCtas) * kRegionBytes;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&stamps, size_t(kMaxCtas) * 5 * 8));
  CHECK(cudaMalloc(&sink, kThreads * 4));
  CHECK(cudaMemset(src, 0x3c, bytes));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, L2 %d MB; tiles of %d KB, %d a CTA\n\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, kTileBytes / 1024, kTiles);
  std::printf("| source | CTAs | slots | issued by | hold (cycles) | span us | GB/s in all | GB/s a CTA "
              "| B/cycle a CTA | cycles a tile | issue cycles a tile (CTA 0) | SM GHz |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int source : {kDistinct, kPairs, kL2}) {
    for (int ctas : {132, 66, 16, 1}) {
      if (source == kPairs && ctas == 1) continue;
      measure<1>(src, source, ctas, 0, reps, stamps, sink);
      measure<2>(src, source, ctas, 0, reps, stamps, sink);
      measure<3>(src, source, ctas, 0, reps, stamps, sink);
      if (ctas == 132 && source != kDistinct) {
        for (int hold : {1500, 2200, 3000}) {
          measure<1>(src, source, ctas, hold, reps, stamps, sink);
          measure<2>(src, source, ctas, hold, reps, stamps, sink);
          measure<3>(src, source, ctas, hold, reps, stamps, sink);
          measure<2, 9>(src, source, ctas, hold, reps, stamps, sink);
          measure<2, 0>(src, source, ctas, hold, reps, stamps, sink);
          measure<3, 0>(src, source, ctas, hold, reps, stamps, sink);
        }
      }
      if (ctas == 132 || ctas == 1) {
        measure<2, 9>(src, source, ctas, 0, reps, stamps, sink);
        measure<2, 0>(src, source, ctas, 0, reps, stamps, sink);
      }
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
"""


if __name__ == "__main__":
    sys.exit(run_standalone("smem_fill_rate", SOURCE, __doc__, ["-std=c++17", "-I", str(templates_dir() / "include")],
                            reps=20, reps_help="launches a row (median span)"))
