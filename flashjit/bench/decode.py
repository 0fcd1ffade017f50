"""Paged decode and KV append, side by side in one run on one GPU: flashjit with
use_tensor_cores=False and True, and FlashInfer (both) when importable.

bf16, head_dim 128, page 16, NHD, pages in random order, N(0, 1) data. Baselines
first: the device's read bandwidth (best of a few large reductions over 4 GiB)
and copy bandwidth (a 2 GiB copy_, read + write bytes). Decode GB/s = K+V bytes
read (B * kv_len * kv_heads * 128 * 2 tensors * 2 bytes) / t, and its fraction of
the read bandwidth; append GB/s = (bytes of new K/V read + written) / t, and its
fraction of the copy bandwidth. Every output is checked first (decode against a
float32 reference gathered from the pages, append against the written slots); a
flashjit mismatch or error is a FAIL line and a failure in the section. Times are
the median of `reps` CUDA-event samples, each a CUDA graph of N calls (an eager
loop where capture fails), divided by N.

With kv_dtypes naming FP8 formats (decode_fp8.py), each decode row also runs
every implementation on the row's cache quantised per tensor (plan
kv_data_type=FP8, run k_scale=v_scale=scale): checked against the float32
reference over the dequantised cache with the same bounds; GB/s counts one
byte an element, and the fraction reported is of the copy bandwidth. A flashjit
FP8 configuration that is not generated yet is a skipped cell, not a failure.
"""

from __future__ import annotations

import datetime
import math
import sys

import torch

from . import decode_fp8
from .decode_fp8 import BF16_KV, impl_label, impl_labels, is_fp8
from .report import decode_cell, git_commit
from .timing import event_ms, time_us

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
APPEND_KV_HEADS = 8
# Where decode_row builds its cache and queries (the CPU tests run it on the CPU with stand-in libraries).
DEVICE = "cuda"


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


def paged_cache(batch: int, kv_len: int, kv_heads: int, fill: str = "randn", head_dim: int = D, device="cuda"):
    """5-D NHD cache with each request's pages at random ids; (cache, indptr, indices, last_page_len)."""
    ppr = -(-kv_len // PAGE)
    pages = batch * ppr
    cache = torch.empty(pages, 2, PAGE, kv_heads, head_dim, dtype=BF16, device=device)
    cache.normal_() if fill == "randn" else cache.zero_()
    indices = torch.randperm(pages, dtype=torch.int32, device=device)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * ppr
    last = torch.full((batch,), kv_len - (ppr - 1) * PAGE, dtype=torch.int32, device=device)
    return cache, indptr, indices, last


def reference(q, cache, indices, kv_len, scale: float | None = None, sinks=None) -> torch.Tensor:
    """float32 decode attention, gathered page by page, a few requests at a time.
    scale: an FP8 cache's per-tensor scale; the keys and values are then the
    dequantised codes * scale (decode_fp8.dequantise). sinks: one logit per query
    head that joins each row's softmax and contributes no value."""
    batch, qo_heads, d = q.shape
    kv_heads = cache.shape[3]
    group, ppr = qo_heads // kv_heads, indices.numel() // batch
    pages = indices.view(batch, ppr).long()
    chunk = max(1, (2 << 30) // (kv_len * kv_heads * d * 2 * 4))
    out = torch.empty(batch, qo_heads, d, dtype=torch.float32, device=q.device)
    fp8 = cache.element_size() == 1
    if fp8 and scale is None:
        raise ValueError("reference: an FP8 cache needs its scale")
    for s in range(0, batch, chunk):
        # [c, ppr, 2, page, kv_heads, d]; FP8 codes gathered and laid out as bytes (no FP8 indexing kernel needed)
        kv = (cache.view(torch.uint8) if fp8 else cache)[pages[s:s + chunk]]
        c = kv.shape[0]
        kv = kv.transpose(1, 2).reshape(c, 2, ppr * PAGE, kv_heads, d)[:, :, :kv_len]
        kv = decode_fp8.dequantise(kv.view(cache.dtype), scale) if fp8 else kv.float()
        qq = q[s:s + chunk].float().view(c, kv_heads, group, d)
        logits = torch.einsum("bhgd,bnhd->bhgn", qq, kv[:, 0]) / math.sqrt(d)
        if sinks is not None:  # one more logit per row, dropped after the softmax
            sink = sinks.float().view(1, kv_heads, group, 1).expand(c, -1, -1, 1)
            p = torch.cat([logits, sink], -1).softmax(-1)[..., :-1]
        else:
            p = logits.softmax(-1)
        out[s:s + chunk] = torch.einsum("bhgn,bnhd->bhgd", p, kv[:, 1]).reshape(c, qo_heads, d)
        del kv, p
    return out


def check(out, ref) -> tuple[bool, float, float]:
    out = out.float()
    err = (out - ref).abs()
    rel = ((out - ref).norm() / ref.norm()).item()
    ok = bool(torch.isfinite(out).all()) and bool((err <= ATOL + RTOL * ref.abs()).all()) and rel < REL_NORM
    return ok, err.max().item(), rel


def libraries(peers=None) -> dict:
    """flashjit, and FlashInfer where importable and `peers` (None: all) names it."""
    import flashjit

    libs = {"flashjit": flashjit}
    if peers is not None and "flashinfer" not in peers:
        return libs
    try:
        import flashinfer

        libs["flashinfer"] = flashinfer
    except Exception as exc:  # not installed, or no kernels for this GPU
        print(f"flashinfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
    return libs


def _timed(fn, reps: int, nbytes: int, baseline_gbps: float, frac_key: str, rec: dict) -> None:
    """Times fn; records µs, GB/s, the fraction of the baseline bandwidth and how it was timed."""
    us, mode, inner = time_us(fn, reps)
    gbps = nbytes / us / 1e3
    rec.update(us=us, gbps=gbps, mode=mode, inner=inner, **{frac_key: gbps / baseline_gbps})


def _failed(exc: Exception, rec: dict, what: str) -> None:
    rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    print(f"{what}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)


def decode_row(libs, workspaces, row, reps, results, failures, kv_dtypes=(BF16_KV,)) -> None:
    """Checks, then times, every implementation on one row, for each KV dtype: the
    bf16 cache, or its per-tensor FP8 quantisation (decode_fp8.quantise); appends a
    record each to results['decode']."""
    label, batch, kv_len, qo_heads, kv_heads = row
    cache, indptr, indices, last = paged_cache(batch, kv_len, kv_heads, device=DEVICE)
    q = torch.randn(batch, qo_heads, D, dtype=BF16, device=DEVICE)
    for kv in kv_dtypes:
        kv_cache, scale = decode_fp8.quantise(cache, kv) if is_fp8(kv) else (cache, None)
        ref = reference(q, kv_cache, indices, kv_len, scale)
        nbytes = batch * kv_len * kv_heads * D * 2 * kv_cache.element_size()
        scales = {} if scale is None else {"k_scale": scale, "v_scale": scale}
        for lib_name, lib in libs.items():
            for tc in (False, True):
                impl = impl_label(lib_name, tc, kv)
                rec = {"row": label, "batch": batch, "kv_len": kv_len, "qo_heads": qo_heads, "kv_heads": kv_heads,
                       "impl": impl, "lib": lib_name, "tensor_cores": tc, "kv_dtype": kv, "bytes": nbytes}
                if scale is not None:
                    rec["scale"] = scale
                try:
                    w = lib.BatchDecodeWithPagedKVCacheWrapper(workspaces[lib_name], kv_layout="NHD",
                                                              use_cuda_graph=False, use_tensor_cores=tc)
                    w.plan(indptr, indices, last, qo_heads, kv_heads, D, PAGE, q_data_type=BF16,
                           kv_data_type=kv_cache.dtype)
                    _check_and_time(lambda w=w: w.run(q, kv_cache, **scales), ref, reps, nbytes, results, rec)
                except Exception as exc:
                    if lib_name == "flashjit" and is_fp8(kv) and decode_fp8.is_not_generated(exc):
                        rec.update(ok=None, skipped=f"{type(exc).__name__}: {exc}")
                        results["skipped"].append(f"{impl} {label}")
                        print(f"skipped {impl} {label}: {decode_fp8.NOT_GENERATED}", file=sys.stderr, flush=True)
                    else:
                        _failed(exc, rec, f"{impl} {label}")
                if lib_name == "flashjit" and not rec["ok"] and "skipped" not in rec:
                    failures.append(f"{impl} {label}: {decode_cell(rec, 'decode')}")
                results["decode"].append(rec)
        del kv_cache, ref
        torch.cuda.empty_cache()


def _check_and_time(fn, ref, reps, nbytes, results, rec) -> None:
    """Checks fn's output against ref, then times it: bf16 cells against the read
    bandwidth, FP8 cells against the copy bandwidth (their target) and the read's."""
    ok, max_err, rel = check(fn(), ref)
    rec.update(ok=ok, max_err=max_err, rel_err=rel)
    if not ok:
        print(f"FAIL {rec['impl']} {rec['row']}: max |out - ref| {max_err:.4g}, ||out - ref||/||ref|| {rel:.4g} "
              f"(bound {ATOL} + {RTOL}*|ref|, rel < {REL_NORM})", file=sys.stderr, flush=True)
    elif is_fp8(rec["kv_dtype"]):
        _timed(fn, reps, nbytes, results["copy_gbps"], "frac_copy", rec)
        rec["frac_read"] = rec["gbps"] / results["read_gbps"]
    else:
        _timed(fn, reps, nbytes, results["read_gbps"], "frac_read", rec)


def append_row(libs, n_req, n_new, reps, results, failures) -> None:
    """Checks, then times, every library's append of n_new tokens to each of n_req requests."""
    kv_heads, base = APPEND_KV_HEADS, 4096
    cache, indptr, indices, last = paged_cache(n_req, base + n_new, kv_heads, fill="zeros")
    k, v = (torch.randn(n_req * n_new, kv_heads, D, dtype=BF16, device="cuda") for _ in range(2))
    batch_idx = torch.arange(n_req, dtype=torch.int32, device="cuda").repeat_interleave(n_new)
    pos = (base + torch.arange(n_new, dtype=torch.int32, device="cuda")).repeat(n_req)
    page = indices.view(n_req, -1).long()[batch_idx.long(), (pos // PAGE).long()]
    slot = (pos % PAGE).long()
    nbytes = 2 * (k.numel() + v.numel()) * 2  # new K/V read, then written
    label = append_label(n_req, n_new)
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
                print(f"FAIL {lib_name} {label}: appended K/V not found in the cache slots", file=sys.stderr,
                      flush=True)
            else:
                _timed(fn, reps, nbytes, results["copy_gbps"], "frac_copy", rec)
        except Exception as exc:
            _failed(exc, rec, f"{lib_name} {label}")
        if lib_name == "flashjit" and not rec["ok"]:
            failures.append(f"{lib_name} {label}: {decode_cell(rec, 'append')}")
        results["append"].append(rec)


def append_label(n_req: int, n_new: int) -> str:
    return f"append {n_req}x{n_new} tok, {APPEND_KV_HEADS} kv heads"


def rows(quick: bool = False) -> list[dict]:
    """The rows to time, in table order: the bandwidth baselines, decode rows, append rows (not with quick)."""
    plan = [{"kind": "baselines", "label": "read/copy bandwidth"}]
    plan += [{"kind": "decode", "label": row[0], "row": row} for row in ROWS if not quick or row[0] in QUICK_ROWS]
    if not quick:
        plan += [{"kind": "append", "label": append_label(*a), "append": a} for a in APPEND]
    return plan


def specs(plan: list[dict], kv_dtypes=(BF16_KV,)) -> list:
    """The flashjit configurations `plan` runs, to build in one parallel run before
    timing; FP8 ones that are not generated yet are left out (their cells say skipped)."""
    from flashjit.spec import KernelSpec

    out = []
    if any(row["kind"] == "decode" for row in plan):
        for kv in kv_dtypes:
            for tc in (False, True):
                spec = KernelSpec.make("batch_decode_paged", "bfloat16", D, dtype_kv=decode_fp8.canonical_of(kv),
                                       use_tensor_cores=tc, return_lse=True)
                try:
                    out.append(spec.validate())
                except ValueError as exc:
                    if not (is_fp8(kv) and decode_fp8.is_not_generated(exc)):
                        raise
    if any(row["kind"] == "append" for row in plan):
        out.append(KernelSpec.make("append_paged", "bfloat16", D))
    return out


def run(plan: list[dict], libs: dict, reps: int = 50, progress=None, on_row=None, kv_dtypes=(BF16_KV,)) -> dict:
    """Runs `plan` (rows()) over `libs` (libraries()) and each of kv_dtypes
    (decode_fp8 short names: bf16, e4m3, e5m2); returns the section
    report.decode_table() renders (the raw numbers, as decode.py's --json wrote
    them). progress(label) after each row; on_row(section, label) after each
    row of the plan, for callers that print rows as they come."""
    kv_dtypes = decode_fp8.kv_dtypes_of(kv_dtypes)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference stays float32
    section = {"kind": "decode", "gpu": torch.cuda.get_device_name(),
               "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": git_commit(),
               "torch": torch.__version__, "flashinfer": getattr(libs.get("flashinfer"), "__version__", None),
               "reps": reps, "libs": list(libs), "kv_dtypes": list(kv_dtypes), "impls": impl_labels(libs, kv_dtypes),
               "decode": [], "append": [], "failures": [], "skipped": []}
    workspaces = None
    for row in plan:
        if row["kind"] == "baselines":
            read, copy = bandwidth_baselines(min(reps, 10))
            torch.cuda.empty_cache()
            best = max(read, key=read.get)
            section.update(read_gbps=read[best], read_method=best, read_all_gbps=read, copy_gbps=copy,
                           spec_gbps=spec_bandwidth())
            workspaces = {name: torch.zeros(256 << 20, dtype=torch.uint8, device="cuda") for name in libs}
        elif row["kind"] == "decode":
            decode_row(libs, workspaces, row["row"], reps, section, section["failures"], kv_dtypes)
        else:
            append_row(libs, *row["append"], reps, section, section["failures"])
        torch.cuda.empty_cache()
        if on_row and row["kind"] != "baselines":
            on_row(section, row["label"])
        if progress:
            progress(f"decode {row['label']}")
    section["fp8_speedup"] = decode_fp8.speed_ratios(section)
    return section
