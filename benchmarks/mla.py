"""MLA paged decode (DeepSeek latent attention, ckv 512 + kpe 64, bf16) on one
GPU: flashjit's fa2 and (on sm_90a) fa3 kernels beside FlashInfer's
BatchMLAPagedAttentionWrapper (backend fa2 and fa3) when importable, each row's
cells timed sample by sample in a fresh random order per pass
(flashjit.bench.timing.shuffled_ms: a column's place in the table does not
decide which kernel runs before it); a cell is the median of its samples.
GB/s counts the ckv and kpe bytes the batch reads once; TFLOP/s counts
2 * heads * kv_len * (576 + 512) per request. Every cell's output is first
checked against float64 within flashjit's mla_paged profile.

The header gives the device's copy bandwidth, measured in the same run (a
2 GiB copy_, read + write bytes: flashjit.bench.decode.bandwidth_baselines):
the memory-bound rows' target is 85% of it.

A sample is --sample-ms of back-to-back calls (at most 50 calls,
flashjit.bench.timing.calls_per_sample), 20 ms by default: a sample starts on
an idle GPU, and its first call carries tens of us that the calls behind it
do not (more for FlashInfer than for flashjit); 2-ms samples (6-7 calls on the
128-head row) spread that over few calls (benchmarks/dev/mla_sample_size.py,
benchmarks/results/2026-11-27-h200-mla-sample-size.md).

--baseline-templates DIR [DIR ...] adds a column of flashjit fa3 per folder,
its kernels rendered from that templates/ folder (e.g. `git archive` of an
earlier commit), for an A/B of a kernel change in one run. Naming this
checkout's templates/ times the shipped kernels in a second column: the spread
an A/B must beat. --baseline-backends fa2 fa3 gives each folder a column per
backend (fa3 alone by default).

--fa3-variant 'Fa3MlaTiling(...)' (repeatable) adds a column of flashjit fa3
with that tiling (kernels.fa3.Fa3MlaTiling, e.g. key_groups=1), built into a
cache of its own.

--kv-dtype bf16 e4m3 (e5m2) gives flashjit's and FlashInfer's columns one per
cache dtype: an FP8 cache holds the bf16 row's values quantised per tensor
(scale amax / the format's largest value, saturating), run with ckv_scale /
kpe_scale, and checked against float64 over its dequantised values; GB/s count
its bytes. FlashInfer 0.7.2 reads an e4m3 MLA cache (its e5m2 cells stay
empty). Baseline and variant columns keep the bf16 cache.

Usage: python benchmarks/mla.py [--samples 60] [--sample-ms 20] [--out results.md]
       [--baseline-templates DIR [DIR ...]] [--baseline-backends fa2 fa3]
       [--fa3-variant 'Fa3MlaTiling(stages=2, key_groups=1)' ...] [--kv-dtype bf16 e4m3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
from common import fa3_mla_tiling, parse_fa3_mla_tiling, rendered_from

import flashjit
from flashjit.bench.decode import bandwidth_baselines
from flashjit.bench.timing import shuffled_ms
from flashjit.error_model import mla_tolerance
from flashjit.spec import FP8_MAX, canonical_dtype

# (label, batch, kv_len, heads, page_size)
ROWS = [("128 x 4k, 16 heads, page 64", 128, 4096, 16, 64),
        ("128 x 4k, 128 heads, page 64", 128, 4096, 128, 64),
        ("128 x 4k, 64 heads, page 64", 128, 4096, 64, 64),
        ("32 x 8k, 16 heads, page 1", 32, 8192, 16, 1)]
SM_SCALE = 1 / math.sqrt(192)
DTYPE = torch.bfloat16


def make_row(batch, kv_len, heads, page_size):
    pages_per = kv_len // page_size
    num_pages = batch * pages_per
    ckv = torch.randn(num_pages, page_size, 512, device="cuda").to(DTYPE)
    kpe = torch.randn(num_pages, page_size, 64, device="cuda").to(DTYPE)
    return dict(q_nope=torch.randn(batch, heads, 512, device="cuda").to(DTYPE),
                q_pe=torch.randn(batch, heads, 64, device="cuda").to(DTYPE), ckv=ckv, kpe=kpe,
                qo_indptr=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                kv_indptr=torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages_per,
                kv_indices=torch.randperm(num_pages, device="cuda").to(torch.int32),
                kv_lens=torch.full((batch,), kv_len, dtype=torch.int32, device="cuda"))


def quantised(r, kv):
    """The row's caches in kv (DTYPE: as they are), with their scales: per tensor,
    amax / the format's largest value, codes saturated (flashjit's append's rule)."""
    if kv == DTYPE:
        return r["ckv"], r["kpe"], {}
    bound = FP8_MAX[canonical_dtype(kv)]
    out, scales = [], {}
    for name in ("ckv", "kpe"):
        scale = float(r[name].abs().max().float()) / bound
        scale = float(torch.tensor(scale, dtype=torch.float32))  # as the kernel holds it
        out.append((r[name].float() / scale).clamp(-bound, bound).to(kv))
        scales[f"{name}_scale"] = scale
    return out[0], out[1], scales


def runner(lib, backend, r, heads, page_size, folder=None, tiling=None, kv=DTYPE):
    """A zero-argument call of one library's planned wrapper over the row's
    caches in kv (None if it cannot plan)."""
    ckv, kpe, scales = r["caches"][kv]
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = lib.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    with rendered_from(folder), fa3_mla_tiling(tiling):
        wrapper.plan(r["qo_indptr"], r["kv_indptr"], r["kv_indices"], r["kv_lens"], heads, 512, 64, page_size, False,
                     SM_SCALE, DTYPE, kv)
    return lambda: wrapper.run(r["q_nope"], r["q_pe"], ckv, kpe, **scales)


def check(out, r, kv_len, label, backend, kv=DTYPE):
    ckv, kpe, scales = r["caches"][kv]
    values = [t.double() * scales.get(f"{name}_scale", 1.0) for name, t in (("ckv", ckv), ("kpe", kpe))]
    ref, _ = flashjit.mla_reference(r["q_nope"][:4], r["q_pe"][:4], *values, list(range(5)),
                                    r["kv_indptr"][:5].tolist(), r["kv_indices"], r["kv_lens"][:4].tolist(),
                                    sm_scale=SM_SCALE)
    tol = mla_tolerance(DTYPE, kv_len=kv_len, q_nope=r["q_nope"], q_pe=r["q_pe"], ckv=ckv, kpe=kpe,
                        sm_scale=SM_SCALE, backend=backend, dtype_kv=kv if kv != DTYPE else None, **scales)
    tol.assert_close(out[:4], ref, label)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=60, help="timed samples per cell (median reported)")
    parser.add_argument("--sample-ms", type=float, default=20.0,
                        help="back-to-back calls a sample lasts (at most 50 calls)")
    parser.add_argument("--out", help="append the markdown table to this file")
    parser.add_argument("--baseline-templates", type=Path, nargs="+", default=[], metavar="DIR",
                        help="also flashjit rendered from each of these templates/ folders (see --baseline-backends)")
    parser.add_argument("--baseline-backends", nargs="+", choices=("fa2", "fa3"), default=["fa3"],
                        help="the backends each --baseline-templates folder gets a column of")
    parser.add_argument("--fa3-variant", action="append", default=[], metavar="EXPR",
                        help="also flashjit fa3 with this Fa3MlaTiling(...)")
    parser.add_argument("--kv-dtype", nargs="+", default=["bf16"], metavar="DTYPE",
                        help="cache dtypes of flashjit's and FlashInfer's columns: bf16, e4m3, e5m2")
    args = parser.parse_args()
    kv_dtypes = [getattr(torch, canonical_dtype(d)) for d in args.kv_dtype]
    hopper = torch.cuda.get_device_capability() == (9, 0)
    folders, tilings = {}, {}
    baselines = {backend: [] for backend in ("fa2", "fa3")}
    for backend in args.baseline_backends:
        if backend == "fa3" and not hopper:
            continue
        for i, folder in enumerate(args.baseline_templates):
            name = f"flashjit {backend} baseline {i + 1}"
            baselines[backend].append((name, flashjit, backend))
            folders[name] = folder.resolve()
            print(f"{name}: kernels rendered from {folders[name]}", flush=True)
    def per_kv(name, lib, backend):  # a column per cache dtype, named by it where not bf16 alone
        return [(name if kv_dtypes == [DTYPE] else f"{name} {str(kv).removeprefix('torch.')}", lib, backend, kv)
                for kv in kv_dtypes]

    libs = per_kv("flashjit fa2", flashjit, "fa2") + [(*b, DTYPE) for b in baselines["fa2"]]
    if hopper:
        variants = [(f"flashjit fa3 variant {i + 1}", flashjit, "fa3", DTYPE) for i in range(len(args.fa3_variant))]
        libs += per_kv("flashjit fa3", flashjit, "fa3") + variants + [(*b, DTYPE) for b in baselines["fa3"]]
        for (name, _, _, _), text in zip(variants, args.fa3_variant):
            tilings[name] = parse_fa3_mla_tiling(text)
            print(f"{name}: {tilings[name]}", flush=True)
    try:
        import flashinfer

        libs += per_kv("flashinfer fa2", flashinfer, "fa2") + per_kv("flashinfer fa3", flashinfer, "fa3")
    except Exception as exc:  # noqa: BLE001 (any import failure means: no FlashInfer column)
        print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
    _, copy_gbps = bandwidth_baselines(20)
    torch.cuda.empty_cache()
    lines = [f"MLA paged decode, {torch.cuda.get_device_name()}, bf16 queries, caches "
             f"{', '.join(str(kv).removeprefix('torch.') for kv in kv_dtypes)}; GB/s of ckv+kpe read, TFLOP/s; "
             f"{args.sample_ms:g}-ms samples", "",
             f"copy bandwidth {copy_gbps:.0f} GB/s (2 GiB copy_, read + write), 85% of it {0.85 * copy_gbps:.0f} GB/s",
             "",
             "| row | " + " | ".join(f"{name} us | GB/s | TFLOP/s" for name, _, _, _ in libs) + " |",
             "|---|" + "---|---|---|" * len(libs)]
    print("\n".join(lines), flush=True)
    status = 0
    for label, batch, kv_len, heads, page_size in ROWS:
        r = make_row(batch, kv_len, heads, page_size)
        r["caches"] = {kv: quantised(r, kv) for kv in {DTYPE, *kv_dtypes}}
        calls = {}
        for name, lib, backend, kv in libs:
            try:
                calls[name] = runner(lib, backend, r, heads, page_size, folders.get(name), tilings.get(name), kv)
                out = calls[name]()
                torch.cuda.synchronize()
                check(out, r, kv_len, f"{name} {label}", backend, kv)
            except Exception as exc:  # noqa: BLE001 (a peer that cannot run this row leaves its cell empty)
                print(f"{name} {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
                calls.pop(name, None)
                status |= name.startswith("flashjit")
        times = shuffled_ms(calls, args.samples, args.sample_ms)
        flops = 2 * batch * heads * kv_len * (576 + 512)
        cells = []
        for name, _, _, kv in libs:
            if name not in times:
                cells.append("- | - | -")
                continue
            nbytes = batch * kv_len * (512 + 64) * kv.itemsize
            ms = statistics.median(times[name])
            cells.append(f"{ms * 1e3:.1f} | {nbytes / ms / 1e6:.0f} | {flops / ms / 1e9:.1f}")
        line = f"| {label} | " + " | ".join(cells) + " |"
        lines.append(line)
        print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
