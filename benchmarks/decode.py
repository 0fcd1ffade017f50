"""Paged decode and KV append, side by side in one run on one GPU: flashjit with
use_tensor_cores=False and True, and FlashInfer (both) when importable.

bf16, head_dim 128, page 16, NHD, pages in random order, N(0, 1) data. Baselines
first: the device's read bandwidth (best of a few large reductions over 4 GiB)
and copy bandwidth (a 2 GiB copy_, read + write bytes). Decode GB/s = K+V bytes
read (B * kv_len * kv_heads * 128 * 2 tensors * 2 bytes) / t, and its fraction of
the read bandwidth; append GB/s = (bytes of new K/V read + written) / t, and its
fraction of the copy bandwidth. Every output is checked first (decode against a
float32 reference gathered from the pages, append against the written slots); a
flashjit mismatch or error prints FAIL and makes the exit status 1. Times are the
median of --reps CUDA-event samples, each a CUDA graph of N calls (an eager loop
where capture fails), divided by N.

Usage: python benchmarks/decode.py [--quick] [--out results.md] [--json raw.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from common import emit, event_ms

D, PAGE, BF16 = 128, 16, torch.bfloat16
ATOL = RTOL = 2e-2  # elementwise bound against the float32 reference, bf16
REL_NORM = 1e-2  # and ||out - ref|| / ||ref||, which an all-zero output cannot meet
# (label, batch, kv_len, qo heads, kv heads). FlashInfer's CUDA-core decode dispatches
# group sizes 1-4, 6, 8, 16 only: 32/1 has no FlashInfer CUDA-core cell, 16/1 does.
ROWS = [("GQA 64x4k 32/8", 64, 4096, 32, 8), ("MHA 64x4k 32/32", 64, 4096, 32, 32),
        ("MQA 64x4k 32/1", 64, 4096, 32, 1), ("MQA 64x4k 16/1", 64, 4096, 16, 1),
        ("split 1x32k 32/8", 1, 32768, 32, 8), ("split 1x128k 32/8", 1, 131072, 32, 8),
        ("8x32k 64/8", 8, 32768, 64, 8)]
QUICK_ROWS = ("GQA 64x4k 32/8", "split 1x32k 32/8")
APPEND = [(64, 1), (64, 128)]  # (requests, new tokens per request), 8 kv heads


# Calls per timing sample, at least: a sample starts on an idle GPU, and its
# first launch costs tens of µs that a lone call would carry whole (on the
# 1 ms MHA row, a 1-call sample read 1005 µs where 50 back-to-back calls ran
# at 965 µs each, while the other library, estimated a little faster, got
# 2-call samples: benchmarks/results/2026-11-22-h200-decode-mha-loop.md).
MIN_CALLS_PER_SAMPLE = 4


def time_us(fn, reps: int, target_us: float = 2000.0) -> tuple[float, str, int]:
    """(median µs per call, 'graph' or 'eager', calls per sample)."""
    for _ in range(3):
        fn()
    est = event_ms(fn, 5) * 1e3 / 5
    inner = max(MIN_CALLS_PER_SAMPLE, min(500, int(target_us / max(est, 1.0))))
    runner, mode, graph = (lambda: event_ms(fn, inner)), "eager", None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        runner, mode = (lambda: event_ms(graph.replay)), "graph"
    except Exception as exc:
        print(f"  graph capture failed, timing eager: {type(exc).__name__}: {str(exc)[:150]}", file=sys.stderr)
    torch.cuda.synchronize()
    times = sorted(runner() for _ in range(reps))
    return times[len(times) // 2] * 1e3 / inner, mode, inner


def bandwidth_baselines(reps: int) -> tuple[dict, float]:
    """Read GB/s per reduction over 4 GiB (timed like the kernels), and copy GB/s (read + write bytes)."""
    x = torch.empty(1 << 31, dtype=BF16, device="cuda").normal_()
    nbytes = x.numel() * 2
    methods = {"amax(int64 view)": lambda: x.view(torch.int64).amax(),  # fastest on an H200: ~4440 GB/s
               "amax(f32 view)": lambda: x.view(torch.float32).amax(),
               "sum(bf16->f32)": lambda: x.sum(dtype=torch.float32)}
    read = {name: nbytes / time_us(fn, reps)[0] / 1e3 for name, fn in methods.items()}
    src, dst = x[: x.numel() // 2], x[x.numel() // 2:]
    dst.copy_(src)  # eager: a captured memcpy node ran at 2/3 of the eager copy's speed on an H200
    copy = nbytes / (sorted(event_ms(lambda: dst.copy_(src)) for _ in range(reps))[reps // 2] * 1e6)
    return read, copy  # the caller empties the cache once these locals are gone


def spec_bandwidth() -> float | None:
    """GB/s from the memory clock and bus width (DDR), where torch reports them."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def paged_cache(batch: int, kv_len: int, kv_heads: int, fill: str = "randn"):
    """5-D NHD cache with each request's pages at random ids; (cache, indptr, indices, last_page_len)."""
    ppr = -(-kv_len // PAGE)
    pages = batch * ppr
    cache = torch.empty(pages, 2, PAGE, kv_heads, D, dtype=BF16, device="cuda")
    cache.normal_() if fill == "randn" else cache.zero_()
    indices = torch.randperm(pages, dtype=torch.int32, device="cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * ppr
    last = torch.full((batch,), kv_len - (ppr - 1) * PAGE, dtype=torch.int32, device="cuda")
    return cache, indptr, indices, last


def reference(q, cache, indices, kv_len) -> torch.Tensor:
    """float32 decode attention, gathered page by page, a few requests at a time."""
    batch, qo_heads, _ = q.shape
    kv_heads = cache.shape[3]
    group, ppr = qo_heads // kv_heads, indices.numel() // batch
    pages = indices.view(batch, ppr).long()
    chunk = max(1, (2 << 30) // (kv_len * kv_heads * D * 2 * 4))
    out = torch.empty(batch, qo_heads, D, dtype=torch.float32, device=q.device)
    for s in range(0, batch, chunk):
        kv = cache[pages[s:s + chunk]]  # [c, ppr, 2, page, kv_heads, D]
        c = kv.shape[0]
        kv = kv.transpose(1, 2).reshape(c, 2, ppr * PAGE, kv_heads, D)[:, :, :kv_len].float()
        qq = q[s:s + chunk].float().view(c, kv_heads, group, D)
        p = (torch.einsum("bhgd,bnhd->bhgn", qq, kv[:, 0]) / math.sqrt(D)).softmax(-1)
        out[s:s + chunk] = torch.einsum("bhgn,bnhd->bhgd", p, kv[:, 1]).reshape(c, qo_heads, D)
        del kv, p
    return out


def check(out, ref) -> tuple[bool, float, float]:
    out = out.float()
    err = (out - ref).abs()
    rel = ((out - ref).norm() / ref.norm()).item()
    ok = bool(torch.isfinite(out).all()) and bool((err <= ATOL + RTOL * ref.abs()).all()) and rel < REL_NORM
    return ok, err.max().item(), rel


def libraries() -> dict:
    import flashjit

    libs = {"flashjit": flashjit}
    try:
        import flashinfer

        libs["flashinfer"] = flashinfer
    except Exception as exc:  # not installed, or no kernels for this GPU
        print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
    return libs


def short(exc: Exception) -> str:
    """A table cell: the error's type and its message's first line (its tail, where FlashInfer's reason is)."""
    msg = str(exc).splitlines()[0] if str(exc) else ""
    msg = msg if len(msg) <= 90 else "..." + msg[-80:]
    return f"error: {type(exc).__name__}: {msg}".replace("|", "/")


def bandwidth_cell(fn, reps: int, nbytes: int, baseline_gbps: float, frac_key: str, rec: dict,
                   us_digits: int) -> str:
    """Times fn, records µs, GB/s and the fraction of the baseline bandwidth in
    rec, and returns the table cell: µs · GB/s · % of the baseline."""
    us, mode, inner = time_us(fn, reps)
    gbps = nbytes / us / 1e3
    rec.update(us=us, gbps=gbps, mode=mode, inner=inner, **{frac_key: gbps / baseline_gbps})
    cell = f"{us:.{us_digits}f} · {gbps:.0f} · {100 * gbps / baseline_gbps:.0f}%"
    return cell + ("" if mode == "graph" else " (eager)")


def error_cell(exc: Exception, rec: dict, what: str) -> str:
    """Records a failed cell in rec and on stderr; returns its table text."""
    rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    print(f"{what}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
    return short(exc)


def decode_row(libs, workspaces, row, reps, results, failures) -> list[str]:
    label, batch, kv_len, qo_heads, kv_heads = row
    cache, indptr, indices, last = paged_cache(batch, kv_len, kv_heads)
    q = torch.randn(batch, qo_heads, D, dtype=BF16, device="cuda")
    ref = reference(q, cache, indices, kv_len)
    nbytes = batch * kv_len * kv_heads * D * 2 * 2
    cells = [label, f"{nbytes / 2**20:.0f}"]
    for lib_name, lib in libs.items():
        for tc in (False, True):
            impl = f"{lib_name} tc={tc}"
            rec = {"row": label, "batch": batch, "kv_len": kv_len, "qo_heads": qo_heads, "kv_heads": kv_heads,
                   "impl": impl, "bytes": nbytes}
            w = None
            try:
                w = lib.BatchDecodeWithPagedKVCacheWrapper(workspaces[lib_name], kv_layout="NHD",
                                                          use_cuda_graph=False, use_tensor_cores=tc)
                w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16, kv_data_type=BF16)
                ok, max_err, rel = check(w.run(q, cache), ref)
                rec.update(ok=ok, max_err=max_err, rel_err=rel)
                if not ok:
                    cell = f"FAIL max err {max_err:.3g}, rel {rel:.3g}"
                    print(f"FAIL {impl} {label}: max |out - ref| {max_err:.4g}, ||out - ref||/||ref|| {rel:.4g} "
                          f"(bound {ATOL} + {RTOL}*|ref|, rel < {REL_NORM})", flush=True)
                else:
                    cell = bandwidth_cell(lambda w=w: w.run(q, cache), reps, nbytes, results["read_gbps"], "frac_read",
                                          rec, us_digits=1)
            except Exception as exc:
                cell = error_cell(exc, rec, f"{impl} {label}")
            if lib_name == "flashjit" and not rec["ok"]:
                failures.append(f"{impl} {label}: {cell}")
            results["decode"].append(rec)
            cells.append(cell)
    return cells


def append_row(libs, n_req, n_new, reps, results, failures) -> list[str]:
    kv_heads, base = 8, 4096
    cache, indptr, indices, last = paged_cache(n_req, base + n_new, kv_heads, fill="zeros")
    k, v = (torch.randn(n_req * n_new, kv_heads, D, dtype=BF16, device="cuda") for _ in range(2))
    batch_idx = torch.arange(n_req, dtype=torch.int32, device="cuda").repeat_interleave(n_new)
    pos = (base + torch.arange(n_new, dtype=torch.int32, device="cuda")).repeat(n_req)
    page = indices.view(n_req, -1).long()[batch_idx.long(), (pos // PAGE).long()]
    slot = (pos % PAGE).long()
    nbytes = 2 * (k.numel() + v.numel()) * 2  # new K/V read, then written
    label = f"append {n_req}x{n_new} tok, 8 kv heads"
    cells = [label, f"{nbytes / 2**20:.2f}"]
    for lib_name, lib in libs.items():
        rec = {"row": label, "requests": n_req, "tokens_per_request": n_new, "impl": lib_name, "bytes": nbytes}
        try:
            def fn(lib=lib):
                lib.append_paged_kv_cache(k, v, batch_idx, pos, cache, indices, indptr, last, kv_layout="NHD")
            cache.zero_()
            fn()
            torch.cuda.synchronize()
            ok = torch.equal(cache[page, 0, slot], k) and torch.equal(cache[page, 1, slot], v)
            written = int((cache != 0).any(-1).sum())
            ok = ok and written == 2 * k.shape[0] * kv_heads  # nothing written outside the new slots
            rec.update(ok=ok)
            if not ok:
                cell = "FAIL wrong slots"
                print(f"FAIL {lib_name} {label}: appended K/V not found in the cache slots", flush=True)
            else:
                cell = bandwidth_cell(fn, reps, nbytes, results["copy_gbps"], "frac_copy", rec, us_digits=2)
        except Exception as exc:
            cell = error_cell(exc, rec, f"{lib_name} {label}")
        if lib_name == "flashjit" and not rec["ok"]:
            failures.append(f"{lib_name} {label}: {cell}")
        results["append"].append(rec)
        cells.append(cell)
    return cells


def git_commit() -> str:
    """FLASHJIT_COMMIT when set (a copied tree may carry a stale .git), else git's HEAD."""
    if os.environ.get("FLASHJIT_COMMIT"):
        return os.environ["FLASHJIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10, check=True).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="decode rows GQA 64x4k and split 1x32k only, no append")
    parser.add_argument("--reps", type=int, default=50, help="timed samples per cell (median reported)")
    parser.add_argument("--out", help="append the markdown table to this file")
    parser.add_argument("--json", help="write raw numbers to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference stays float32
    libs = libraries()
    read, copy = bandwidth_baselines(min(args.reps, 10))
    torch.cuda.empty_cache()
    best = max(read, key=read.get)
    results = {"gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "commit": git_commit(), "torch": torch.__version__,
               "flashinfer": getattr(libs.get("flashinfer"), "__version__", None),
               "read_gbps": read[best], "read_method": best, "read_all_gbps": read, "copy_gbps": copy,
               "spec_gbps": spec_bandwidth(),
               "decode": [], "append": []}
    impls = [f"{lib} tc={tc}" for lib in libs for tc in (False, True)]
    all_read = ", ".join(f"{k} {v:.0f}" for k, v in read.items())
    lines = [f"## Paged decode, bf16, head_dim {D}, page {PAGE}, NHD, random page order", "",
             (f"GPU: {results['gpu']}; date {results['date']}; commit {results['commit']}; "
              f"torch {torch.__version__}; flashinfer {results['flashinfer'] or 'not available'}"),
             (f"read bandwidth {read[best]:.0f} GB/s ({best}; {all_read}); "
              f"copy bandwidth {copy:.0f} GB/s (2 GiB copy_, read + write); from memory clock x bus width "
              + (f"{results['spec_gbps']:.0f} GB/s" if results["spec_gbps"] else "unknown")),
             (f"cells: µs · GB/s of K+V read · % of read bandwidth; median of {args.reps} samples, "
              "each a CUDA graph of N calls / N ('eager' where capture failed)"), "",
             "| row (B x kv_len, qo/kv heads) | K+V MiB | " + " | ".join(impls) + " |", "|---|---|" + "---|" * len(impls)]
    print("\n".join(lines), flush=True)
    failures: list[str] = []
    workspaces = {name: torch.zeros(256 << 20, dtype=torch.uint8, device="cuda") for name in libs}
    for row in ROWS:
        if args.quick and row[0] not in QUICK_ROWS:
            continue
        lines.append("| " + " | ".join(decode_row(libs, workspaces, row, args.reps, results, failures)) + " |")
        torch.cuda.empty_cache()
        print(lines[-1], flush=True)
    if not args.quick:
        lines += ["", "cells: µs · GB/s of new K/V read + written · % of copy bandwidth", "",
                  "| append (NHD, page 16, d128) | MiB moved | " + " | ".join(libs) + " |",
                  "|---|---|" + "---|" * len(libs)]
        for n_req, n_new in APPEND:
            lines.append("| " + " | ".join(append_row(libs, n_req, n_new, args.reps, results, failures)) + " |")
            torch.cuda.empty_cache()
            print(lines[-1], flush=True)
    lines += [""] + [f"FAIL {f}" for f in failures] + [f"decode benchmark: {len(failures)} flashjit failure(s)"]
    print(flush=True)
    emit("\n".join(lines), args.out)
    if args.json:
        results["failures"] = failures
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
