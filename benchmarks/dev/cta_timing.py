"""Where a prefill kernel's time goes, per CTA: builds the shipped fa2 kernel
from a copy of templates/ with timestamps added (thread 0 of each CTA reads
%globaltimer at entry, after its first K/V tile landed, after its last tile and
after its stores, and %smid; also after decoding its work and after issuing Q
and the first K/V tiles), runs one ragged batch, and reports the kernel
span, the mean CTA phases, and how full the SMs' CTA slots were
(sum of CTA durations / (slots x span)).

Non-split plans only: the timestamps go to the partial-LSE pointer, which such
a plan leaves unused. The instrumented copy lives in a temporary folder; the
shipped templates are not touched.

With --tiles, thread 0 also stamps the first TILES tiles of its CTA: at the
top of the tile, once the tile's K/V landed (wait and barrier), once the next
copies are issued (FlashInfer: its Q.K^T and softmax done) and before P.V
(FlashInfer: its V landed); the report gives the mean of each part per tile.

Usage: python benchmarks/dev/cta_timing.py [--head-dim 128] [--batch 16] [--qo-len 1024] [--kv-len 1024]
       [--causal] [--templates DIR] [--stagger-ns NS [--stagger-which CONDITION]] [--flashinfer-site DIR]
       [--tiling 'Fa2Tiling(...)'] [--tiles]
$CTA_TIMING_CACHE: a folder where runs share their builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, decode, prefill
from common import insert_probes, use_templates
from common import instrumented_templates as common_instrumented
from prefill import indptr

import flashjit
from flashjit import jit, kernels

HEADER = "include/flashjit/fa2/fa2_attention.cuh"
TILES, TILE_STAMPS = 16, 4  # --tiles: stamps per tile, for the first TILES tiles of a CTA
STRIDE = 8 + TILES * TILE_STAMPS  # int64 slots per CTA: the phase stamps, then the tiles'


def stamp(i: int, indent: str = "  ") -> str:
    """CUDA that reads %globaltimer into fj_t[i]."""
    return f"{indent}asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_t[{i}]));\n"


# (anchor in the kernel source, code, "before" or "after" the anchor). fj_t:
# entry, first tile landed, loop end, end, work decoded, copies issued, Q issued.
STORES = "  fa2::store_rows<Traits>(p, w, o, softmax.m, softmax.l, smem, warp_row0, rows_total, softmax.scale);\n"
# The next tile's copies: one thread's TMA loads (kTmaKv), or every thread's cp.async.
ISSUE_TMA = "        ring.template issue<kCopySpan>(p, tma_arg.maps, w, t + STAGES - 1);\n"
ISSUE_CP_ASYNC = "        issue_k(t + STAGES - 1);\n"
PROBES = [
    ("                         const __grid_constant__ KvMapsArg<Traits::kTmaKv> tma_arg) {\n",
     "  unsigned long long fj_t[7] = {0, 0, 0, 0, 0, 0, 0};\n" + stamp(0), "after"),
    ("  const CtaWork w = decode_work<Traits::kPaged>(p, ROWS);\n", stamp(4), "after"),
    ("    // Who copies which K/V rows", stamp(6, "    "), "before"),
    ("    // Per-lane ldmatrix offsets", stamp(5, "    "), "before"),
    (ISSUE_TMA, "        if (t == 0) " + stamp(1, ""), "before"),
    (ISSUE_CP_ASYNC, "        if (t == 0) " + stamp(1, ""), "before"),
    # The loop's end once every warp is there (a barrier the shipped kernel does
    # not have), so that the stores' time holds no warp's lag behind thread 0.
    (STORES, "  __syncthreads();\n" + stamp(2), "before"),
    (STORES,
     "  __syncthreads();\n" + stamp(3) +
     "  if (threadIdx.x == 0 && w.split < 0 && p.partial_lse != nullptr) {\n"
     "    unsigned smid;\n"
     "    asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     f"    auto* out = reinterpret_cast<unsigned long long*>(p.partial_lse) + {STRIDE} * size_t(blockIdx.x);\n"
     "    for (int i = 0; i < 6; ++i) out[i] = fj_t[i];\n"
     "    out[6] = smid;\n"
     "    out[7] = fj_t[6];\n"
     "  }\n", "after"),
]


def tile_stamp(slot: int, dst: str, t: str = "t") -> str:
    """CUDA by which thread 0 stamps `slot` of tile `t` (of the first TILES) into dst[4t + slot]."""
    return (f"      if (threadIdx.x + threadIdx.y + threadIdx.z == 0 && {t} < {TILES}) {{\n"
            "        unsigned long long fj_now;\n"
            "        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_now));\n"
            f"        {dst}[{TILE_STAMPS} * {t} + {slot}] = fj_now;\n"
            "      }\n")


FJ_TILES = f"(reinterpret_cast<unsigned long long*>(p.partial_lse) + {STRIDE} * size_t(blockIdx.x) + 8)"
TILE_PROBES = [  # our kernel: top, K/V landed, next copies issued, before P.V
    ("      const int t0 = key_begin + t * KEYS;\n", tile_stamp(0, FJ_TILES), "after"),
    (ISSUE_TMA, tile_stamp(1, FJ_TILES), "before"),
    (ISSUE_CP_ASYNC, tile_stamp(1, FJ_TILES), "before"),
    (ISSUE_TMA, tile_stamp(2, FJ_TILES), "after"),
    ("        lookup(t + STAGES);\n", tile_stamp(2, FJ_TILES), "after"),
    ("        if constexpr (Traits::kFencePv) __syncwarp();\n", "  " + tile_stamp(3, FJ_TILES), "before"),
]


def stagger_probe(ns: int, second: str) -> tuple:
    """Code that holds back the first wave's CTAs that `second` selects, `ns`
    nanoseconds at entry: a test of whether CTAs running in lockstep cost time."""
    return ("  const CtaWork w = decode_work<Traits::kPaged>(p, ROWS);\n",
            "  {\n"
            "    unsigned nsm;\n"
            "    asm(\"mov.u32 %0, %%nsmid;\" : \"=r\"(nsm));\n"
            f"    if (blockIdx.x < 2 * nsm && ({second})) {{\n"
            "      unsigned long long t0, t;\n"
            "      asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t0));\n"
            "      do {\n"
            "        __nanosleep(200);\n"
            "        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t));\n"
            f"      }} while (t - t0 < {ns}ull);\n"
            "    }\n"
            "  }\n", "after")


def instrumented_templates(source: Path | None = None, stagger: tuple | None = None, tiles: bool = False) -> Path:
    probes = ([stagger] if stagger else []) + PROBES + (TILE_PROBES if tiles else [])
    return common_instrumented(HEADER, probes, source, prefix="cta-timing-")


# FlashInfer's ragged prefill kernel, instrumented the same way in a private copy
# of its package (its JIT builds from the copy's headers into a private cache).
# The stamps go over the first 56 bytes of each CTA's first output row (group
# size 1, no split), written after the CTA's own stores.
FI_PROBES = [
    ("    auto block = cg::this_thread_block();\n",
     "  unsigned long long fj_t[6] = {0, 0, 0, 0, 0, 0};\n" + stamp(0), "after"),
    ("    const uint32_t kv_abs_base = kv_indptr[request_idx] + chunk_start;\n", stamp(4), "after"),
    ("#pragma unroll 1\n      for (uint32_t iter = 0; iter < num_iterations; ++iter) {\n", stamp(5), "before"),
    ("          cp_async::wait_group<1>();\n        }\n        block.sync();\n",  # the first: K's wait
     "  if (iter == 0) " + stamp(1, ""), "after"),
    ("      cp_async::wait_group<0>();\n      block.sync();\n\n      finalize_m<KTraits>(variant, m);\n",
     stamp(2), "after"),
    ("      block.sync();\n    }  // d_tile (split-D over VO) loop\n",
     stamp(3) +
     "    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0 && !partition_kv) {\n"
     "      unsigned smid;\n"
     "      asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     "      auto* out = reinterpret_cast<unsigned long long*>(\n"
     "          o + (o_indptr[request_idx] + qo_tile_idx * CTA_TILE_Q) * o_stride_n + kv_head_idx * o_stride_h);\n"
     "      for (int i = 0; i < 6; ++i) out[i] = fj_t[i];\n"
     "      out[6] = smid;\n"
     "    }\n", "after"),
]


# With --tiles, FlashInfer's tiles are stamped into a device array (its
# kernel has no spare output) that thread 0 copies after its stores into the
# CTA's output rows 1, 2, ... (after the phase stamps of row 0).
FI_TILES_ARRAY = "static __device__ unsigned long long fj_tiles[1 << 20];\n"
FI_TILES = (f"(fj_tiles + {TILES * TILE_STAMPS} * size_t(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * "
            "blockIdx.z)))")
FI_TILE_PROBES = [  # top, K landed, Q.K^T and softmax done, V landed
    ("        // Shared K/V serializes loads (no K/V prefetch overlap) -> drain fully.\n",
     tile_stamp(0, FI_TILES, "iter"), "before"),
    ("          cp_async::wait_group<1>();\n        }\n        block.sync();\n",
     tile_stamp(1, FI_TILES, "iter"), "after"),
    ("          update_mdo_states<KTraits>(variant, s_frag, o_frag, m, d);\n        }\n",
     tile_stamp(2, FI_TILES, "iter"), "after"),
    ("          cp_async::commit_group();\n          cp_async::wait_group<1>();\n        }\n        block.sync();\n",
     tile_stamp(3, FI_TILES, "iter"), "after"),
    ("      for (int i = 0; i < 6; ++i) out[i] = fj_t[i];\n",
     f"      for (int i = 0; i < {TILES * TILE_STAMPS}; ++i)\n"
     f"        out[(1 + i / {{per_row}}) * (o_stride_n / 4) + i % {{per_row}}] = {FI_TILES}[i];\n", "after"),
]


def instrumented_flashinfer(site: Path, tiles: bool = False, head_dim: int = 128) -> Path:
    """A copy of the flashinfer package from `site` with FI_PROBES in its ragged
    prefill kernel; returns the folder to put first on sys.path."""
    root = Path(tempfile.mkdtemp(prefix="cta-timing-fi-"))
    shutil.copytree(site / "flashinfer", root / "flashinfer", symlinks=True)
    path = root / "flashinfer/data/include/flashinfer/attention/prefill.cuh"
    text = path.read_text()
    begin = text.index("void BatchPrefillWithRaggedKVCacheKernel(")
    begin = text.rindex("\ntemplate", 0, begin)  # the kernel's template line
    end = text.index("\ntemplate", begin + 1)
    probes = FI_PROBES
    if tiles:  # a bf16 output row of one head holds head_dim / 4 int64 slots
        probes = FI_PROBES + [(a, c.replace("{per_row}", str(head_dim // 4)), w) for a, c, w in FI_TILE_PROBES]
    kernel = insert_probes(text[begin:end], probes)
    path.write_text(text[:begin] + (FI_TILES_ARRAY if tiles else "") + kernel + text[end:])
    return root


def report(label: str, t: torch.Tensor, slots_per_sm: int) -> None:
    """t: [CTAs, 7] stamps (entry, first tile, loop end, end, work decoded, copies issued, smid)."""
    t = t.double()
    start, first, last, end, decoded, issued, sm = t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 4], t[:, 5], t[:, 6].long()
    ctas = t.shape[0]
    span = (end.max() - start.min()) / 1e3
    dur = (end - start) / 1e3
    slots = len(sm.unique()) * slots_per_sm
    us = lambda x: f"{(x / 1e3).mean():.2f} us"  # noqa: E731
    print(f"{label}: {ctas} CTAs on {len(sm.unique())} SMs")
    print(f"kernel span (first CTA start to last CTA end): {span:.1f} us")
    print(f"CTA mean: {dur.mean():.2f} us (min {dur.min():.2f}, max {dur.max():.2f}); entry to first tile "
          f"{us(first - start)}, tiles {us(last - first)}, stores {us(end - last)}")
    print(f"  of the entry: work decoded {us(decoded - start)}, Q and first K/V issued {us(issued - decoded)}, "
          f"waiting for them {us(first - issued)}")
    print(f"slot use: sum of CTA durations / ({slots} slots x span) = {dur.sum() / (slots * span):.3f}")
    first_sm = [int(c) for c in (sm[: min(ctas, slots)] == sm[0]).nonzero().flatten()]
    print(f"first wave: CTAs {first_sm} share SM {int(sm[0])}")
    starts = (start - start.min()) / 1e3
    print("CTA starts per 10% of the span:", torch.histc(starts, bins=10, min=0, max=float(span)).long().tolist())


def report_tiles(tiles: torch.Tensor, loop_end: torch.Tensor, parts: list[str]) -> None:
    """tiles: [CTAs, TILES * TILE_STAMPS] per-tile stamps (0 where a CTA had fewer
    tiles); loop_end: [CTAs]. Mean µs of each part of each tile over the CTAs that
    have it; a tile ends where the next one starts, the last stamped one at loop_end
    (so in a CTA of more than TILES tiles its last part holds the rest of the loop)."""
    tiles = tiles.double().view(tiles.shape[0], TILES, TILE_STAMPS)
    tops = torch.cat([tiles[:, 1:, 0], loop_end.double()[:, None]], dim=1)
    ends = torch.where(tops > 0, tops, loop_end.double()[:, None])  # past a CTA's last tile: its loop end
    bounds = torch.cat([tiles, ends[:, :, None]], dim=2)  # [CTAs, TILES, TILE_STAMPS + 1]
    print("| tile | " + " | ".join(parts) + " | tile |")
    print("|---" * (len(parts) + 2) + "|")
    for i in range(TILES):
        have = tiles[:, i, 0] > 0
        if not bool(have.any()):
            break
        b = bounds[have, i] / 1e3
        cells = [f"{(b[:, k + 1] - b[:, k]).mean():.3f}" for k in range(TILE_STAMPS)]
        print(f"| {i} | " + " | ".join(cells) + f" | {(b[:, -1] - b[:, 0]).mean():.3f} |")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--qo-len", type=int, default=1024)
    parser.add_argument("--kv-len", type=int, default=1024)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--templates", type=Path, help="instrument this templates/ folder (default: the package's)")
    parser.add_argument("--stagger-ns", type=int, default=0,
                        help="hold back the first wave's CTAs chosen by --stagger-which this long at entry")
    parser.add_argument("--stagger-which", default="blockIdx.x % 2 == 1",
                        help="CUDA condition on blockIdx.x / nsm choosing the held-back CTAs")
    parser.add_argument("--tiling", help="a Fa2Tiling(...) expression in place of the head_dim's prefill tilings")
    parser.add_argument("--flashinfer-site", type=Path,
                        help="also time FlashInfer fa2's kernel, instrumented in a copy of the flashinfer package "
                             "found in this site-packages folder")
    parser.add_argument("--tiles", action="store_true", help=f"also time each of the first {TILES} tiles in parts")
    args = parser.parse_args()
    d, b = args.head_dim, args.batch
    h = 2048 // d
    if args.tiling:
        kernels.fa2.FA2_TILINGS[d] = kernels.fa2.FA2_WIDE_TILINGS[d] = eval(args.tiling, {"Fa2Tiling": kernels.fa2.Fa2Tiling})
    stagger = stagger_probe(args.stagger_ns, args.stagger_which) if args.stagger_ns else None
    use_templates(instrumented_templates(args.templates, stagger, args.tiles))
    # A cached library is found by the spec and the generator's files, not a
    # tiling replaced at run time: a private cache builds what is asked for.
    # $CTA_TIMING_CACHE keeps the builds for the next run where nothing replaced at
    # run time decides what is built (the instrumented sources are in the key).
    shared = os.environ.get("CTA_TIMING_CACHE")
    os.environ["FLASHJIT_CACHE_DIR"] = (f"{shared}/flashjit" if shared and not args.tiling
                                        else tempfile.mkdtemp(prefix="cta-timing-cache-"))
    jit._modules.clear()
    q = torch.randn(b * args.qo_len, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b * args.kv_len, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr([args.qo_len] * b), indptr([args.kv_len] * b), h, h, d, causal=args.causal,
           q_data_type=torch.bfloat16)
    plan = w._plan
    if plan.merge_tokens:
        print("the plan splits keys: no timestamps", file=sys.stderr)
        return 1
    ctas = plan.num_work * h
    stamps = torch.zeros(ctas * STRIDE, dtype=torch.int64, device="cuda")
    w._plan = dataclasses.replace(plan, partials=(0, stamps.data_ptr()))
    for _ in range(3):
        w.run(q, k, v)
    torch.cuda.synchronize()
    shape = f"bf16 d{d}, {b} x {args.qo_len} queries, {args.kv_len} keys, causal={args.causal}"
    t = stamps.view(ctas, STRIDE).cpu()
    report(f"{torch.cuda.get_device_name()}, flashjit fa2, {shape}", t[:, :7], 1 if d == 256 else 2)
    print(f"  of the copies issued: Q {((t[:, 7] - t[:, 4]).double() / 1e3).mean():.2f} us, "
          f"first K/V {((t[:, 5] - t[:, 7]).double() / 1e3).mean():.2f} us")
    if args.tiles:
        report_tiles(t[:, 8:], t[:, 2], ["K/V wait", "copies issued", "Q.K^T, softmax", "P.V"])
    if args.flashinfer_site:
        # FlashInfer's JIT finds a module by name, not by its sources: one
        # workspace per instrumentation.
        os.environ["FLASHINFER_WORKSPACE_BASE"] = (f"{shared}/flashinfer-tiles{int(args.tiles)}" if shared
                                                   else tempfile.mkdtemp(prefix="cta-timing-fi-jit-"))
        sys.path.insert(0, str(instrumented_flashinfer(args.flashinfer_site.resolve(), args.tiles, d)))
        import flashinfer

        assert Path(flashinfer.__file__).resolve().is_relative_to(Path(sys.path[0]).resolve()), flashinfer.__file__
        fw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD", backend="fa2")
        fw.plan(indptr([args.qo_len] * b).cuda(), indptr([args.kv_len] * b).cuda(), h, h, d, causal=args.causal,
                q_data_type=torch.bfloat16)
        for _ in range(3):
            out = fw.run(q, k, v)
        torch.cuda.synchronize()
        tiles = -(-args.qo_len // 128)
        rows = torch.tensor([r * args.qo_len + t * 128 for r in range(b) for t in range(tiles)])
        words = out.contiguous().view(torch.int64)  # [tokens, heads, d / 4]
        fi = words[rows][:, :, :7].reshape(-1, 7).cpu()
        report(f"FlashInfer fa2 (CTA tile 128 assumed), {shape}", fi, 1 if d == 256 else 2)
        if args.tiles:  # rows 1, 2, ... of each CTA, row after row
            per_row = d // 4
            stamp_rows = [words[rows + 1 + i] for i in range(-(-TILES * TILE_STAMPS // per_row))]
            fi_tiles = torch.cat(stamp_rows, dim=-1)[:, :, : TILES * TILE_STAMPS].reshape(-1, TILES * TILE_STAMPS)
            report_tiles(fi_tiles.cpu(), fi[:, 2], ["K wait", "Q.K^T, softmax", "K issued, V wait", "P.V, V issued"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
