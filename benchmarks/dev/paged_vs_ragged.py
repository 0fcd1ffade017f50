"""Paged prefill against ragged prefill on the same shapes, one GPU, one run:
flashjit's BatchPrefillWithPagedKVCacheWrapper (pages of 1, 16 and 64 tokens,
in random order) beside its ragged wrapper, per backend (fa3 on sm_90a, fa2),
and FlashInfer's paged wrapper (fa3) with --flashinfer. --kv-dtypes bf16 e4m3
adds paged columns over the same cache quantised per tensor to FP8
(flashjit.bench.decode_fp8.quantise; k_scale = v_scale = its scale), for
flashjit and FlashInfer, and a last column of the first backend's FP8 paged
speed over its bf16 paged speed at the same page size, the worst page size
(docs/fp8.md).

Shapes as benchmarks/prefill.py: batch * seqlen = 16k tokens, heads * head_dim =
2048, bf16, TFLOP/s = 4*B*H*S^2*D / t (halved when causal); a cell is the median
of --samples samples, taken in passes of a fresh random order each
(flashjit.bench.timing.shuffled_ms). The last column is the slowest paged cell
of the row's first backend against its ragged cell. --baseline-templates adds
the ragged and paged kernels rendered from other templates/ folders as more
columns, for an A/B of a kernel change in one run.

Usage: python benchmarks/dev/paged_vs_ragged.py [--head-dims 128] [--seqlens 1024 4096]
       [--backends fa3 fa2] [--page-sizes 1 16 64] [--flashinfer] [--baseline-templates DIR ...]
       [--kv-dtypes bf16 e4m3] [--samples 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from common import emit, rendered_from, use_templates  # noqa: E402

import flashjit  # noqa: E402
from flashjit import jit  # noqa: E402
from flashjit.bench import decode_fp8  # noqa: E402
from flashjit.bench.prefill import attention_flops, indptr  # noqa: E402
from flashjit.bench.timing import shuffled_ms  # noqa: E402
from flashjit.spec import KernelSpec  # noqa: E402


def workspace() -> torch.Tensor:
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def paged_cache(k: torch.Tensor, v: torch.Tensor, kv_lens, page_size: int):
    """K/V scattered over pages in random order, the slots past a request random:
    (cache [pages, 2, page, H, D], indptr, indices, last lengths)."""
    pages = [math.ceil(n / page_size) for n in kv_lens]
    total = sum(pages)
    order = torch.randperm(total, device="cuda")
    cache = torch.randn(total, 2, page_size, k.shape[1], k.shape[2], device="cuda").to(k.dtype)
    page_of, slot_of, first_page = [], [], 0
    for n, p in zip(kv_lens, pages):
        pos = torch.arange(n, device="cuda")
        page_of.append(order[first_page + pos // page_size])
        slot_of.append(pos % page_size)
        first_page += p
    page_of, slot_of = torch.cat(page_of), torch.cat(slot_of)
    cache[page_of, 0, slot_of] = k
    cache[page_of, 1, slot_of] = v
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32)
    return cache, indptr(pages), order.to(torch.int32), last


def flashjit_ragged(backend):
    def make(qo_lens, kv_lens, h, d, causal, k, v):
        w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(workspace(), backend=backend, strict=True)
        w.plan(indptr(qo_lens), indptr(kv_lens), h, h, d, causal=causal, q_data_type=k.dtype)
        return lambda q: w.run(q, k, v)
    return make


def fp8_cache(cache, kv: str):
    """(cache, kv_data_type, run() keywords): the bf16 cache as it is, or its FP8 codes and scales."""
    if not decode_fp8.is_fp8(kv):
        return cache, cache.dtype, {}
    codes, scale = decode_fp8.quantise(cache, kv)
    return codes, codes.dtype, {"k_scale": scale, "v_scale": scale}


def flashjit_paged(backend, page_size, kv=decode_fp8.BF16_KV):
    def make(qo_lens, kv_lens, h, d, causal, k, v):
        cache, kv_indptr, indices, last = paged_cache(k, v, kv_lens, page_size)
        cache, kv_dtype, scales = fp8_cache(cache, kv)
        w = flashjit.BatchPrefillWithPagedKVCacheWrapper(workspace(), backend=backend, strict=True)
        w.plan(indptr(qo_lens), kv_indptr, indices, last, h, h, d, page_size, causal=causal, q_data_type=k.dtype,
               kv_data_type=kv_dtype)
        return lambda q: w.run(q, cache, **scales)
    return make


def flashinfer_paged(page_size, kv=decode_fp8.BF16_KV):
    import flashinfer

    def make(qo_lens, kv_lens, h, d, causal, k, v):
        cache, kv_indptr, indices, last = paged_cache(k, v, kv_lens, page_size)
        cache, kv_dtype, scales = fp8_cache(cache, kv)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend="fa3")
        w.plan(indptr(qo_lens).cuda(), kv_indptr.cuda(), indices, last.cuda(), h, h, d, page_size, causal=causal,
               q_data_type=k.dtype, kv_data_type=kv_dtype)
        return lambda q: w.run(q, cache, **scales)
    return make


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--backends", nargs="+", default=["fa3", "fa2"])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--flashinfer", action="store_true", help="FlashInfer's paged fa3 at the page sizes too")
    parser.add_argument("--baseline-templates", type=Path, nargs="+", default=[],
                        help="copies of other templates/ folders: their kernels as more columns, same run")
    parser.add_argument("--kv-dtypes", type=decode_fp8.kv_dtype_arg, nargs="+", default=[decode_fp8.BF16_KV],
                        help="paged caches: bf16 and/or FP8 (e4m3, e5m2) quantised per tensor")
    parser.add_argument("--samples", type=int, default=30, help="timed samples per cell (median reported)")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    impls, folders = {}, {}  # name -> make; name -> templates folder (None: this tree's)
    fp8_kvs = [kv for kv in dict.fromkeys(args.kv_dtypes) if decode_fp8.is_fp8(kv)]
    for backend in args.backends:
        impls[f"{backend} ragged"] = flashjit_ragged(backend)
        impls.update({f"{backend} paged p{p}": flashjit_paged(backend, p) for p in args.page_sizes})
        impls.update({f"{backend} paged p{p} {kv}": flashjit_paged(backend, p, kv) for kv in fp8_kvs
                      for p in args.page_sizes})
        for folder in args.baseline_templates:
            label = folder.resolve().parent.name if folder.name == "templates" else folder.name
            impls[f"{backend} ragged [{label}]"] = flashjit_ragged(backend)
            folders[f"{backend} ragged [{label}]"] = folder.resolve()
            for p in args.page_sizes:
                impls[f"{backend} paged p{p} [{label}]"] = flashjit_paged(backend, p)
                folders[f"{backend} paged p{p} [{label}]"] = folder.resolve()
    if args.flashinfer:
        impls.update({f"flashinfer-fa3 paged p{p}": flashinfer_paged(p) for p in args.page_sizes})
        impls.update({f"flashinfer-fa3 paged p{p} {kv}": flashinfer_paged(p, kv) for kv in fp8_kvs
                      for p in args.page_sizes})
    # Every library of each source in one parallel build.
    for folder in [None, *(f.resolve() for f in args.baseline_templates)]:
        use_templates(folder)
        specs = [KernelSpec.make(op, "bfloat16", d, backend=b, use_tensor_cores=True, causal=c, return_lse=True)
                 for op in ("batch_prefill_paged", "batch_prefill_ragged") for b in args.backends
                 for d in args.head_dims for c in (False, True)]
        for kv in fp8_kvs:  # FP8 configurations a backend does not generate are n/a cells, built by none
            for b in args.backends:
                for d in args.head_dims:
                    for c in (False, True):
                        try:
                            specs.append(KernelSpec.make("batch_prefill_paged", "bfloat16", d, backend=b,
                                                         use_tensor_cores=True, causal=c, return_lse=True,
                                                         dtype_kv=decode_fp8.canonical_of(kv)))
                        except ValueError as exc:
                            print(f"{b} d={d} {kv}: {exc}", file=sys.stderr)
        jit.build_many(specs)
    use_templates(None)
    first = args.backends[0]
    lines = [f"device: {torch.cuda.get_device_name()}, bf16, TFLOP/s, median of {args.samples} samples in shuffled "
             "passes", "",
             "| head_dim | batch x S | causal | " + " | ".join(impls) + f" | {first} slowest paged / ragged |"
             + "".join(f" {first} paged {kv} / bf16, worst page size |" for kv in fp8_kvs),
             "|---|---|---|" + "---|" * (len(impls) + 1 + len(fp8_kvs))]
    for d in args.head_dims:
        h = 2048 // d
        for s in args.seqlens:
            b = 16384 // s
            for causal in (False, True):
                q, k, v = (torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = attention_flops(b, h, s, d, causal)
                fns = {}
                for name, make in impls.items():
                    try:
                        # A wrapper keeps the module it first ran: load it with its sources in place.
                        with rendered_from(folders.get(name)):
                            fns[name] = make([s] * b, [s] * b, h, d, causal, k, v)
                            fns[name](q)
                    except Exception as exc:  # the cell reads n/a; the reason goes to stderr
                        print(f"{name} d={d} {b}x{s}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                samples = shuffled_ms({name: (lambda fn=fn, q=q: fn(q)) for name, fn in fns.items()}, args.samples)
                rate = {name: flops / statistics.median(ms) / 1e9 for name, ms in samples.items()}
                cells = [f"{rate[name]:.0f}" if name in rate else "n/a" for name in impls]
                bf16 = {p: rate[f"{first} paged p{p}"] for p in args.page_sizes if f"{first} paged p{p}" in rate}
                ratio = (f"{min(bf16.values()) / rate[f'{first} ragged']:.3f}"
                         if bf16 and f"{first} ragged" in rate else "n/a")
                # FP8 against bf16 at each page size, the worst page size
                fp8 = [[rate[f"{first} paged p{p} {kv}"] / bf16[p] for p in bf16 if f"{first} paged p{p} {kv}" in rate]
                       for kv in fp8_kvs]
                ratios = [f"{min(r):.3f}" if r else "n/a" for r in fp8]
                lines.append(f"| {d} | {b} x {s} | {causal} | " + " | ".join(cells) + f" | {ratio} |"
                             + "".join(f" {r} |" for r in ratios))
                print(lines[-1], flush=True)
                del q, k, v, fns
    emit("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
