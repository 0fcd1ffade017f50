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

Usage: python benchmarks/cta_timing.py [--head-dim 128] [--batch 16] [--qo-len 1024] [--kv-len 1024]
       [--causal] [--templates DIR] [--stagger-ns NS [--stagger-which CONDITION]]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from common import use_templates
from prefill import indptr

import flashjit
from flashjit import jit, render

HEADER = "include/flashjit/fa2_attention.cuh"
# (anchor in the kernel source, code inserted after it)
PROBES = [
    ("    fa2_attention_kernel(const __grid_constant__ FlashjitAttentionParams p) {\n",
     "  unsigned long long fj_t[6] = {0, 0, 0, 0, 0, 0};\n"
     "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_t[0]));\n"),
    ("  const CtaWork w = decode_work<Traits::kPaged>(p, ROWS);\n",
     "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_t[4]));\n"),
    ("    lookup(STAGES - 1);\n",
     "    asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_t[5]));\n"),
    ("      tile_barrier();\n      issue_k(t + STAGES - 1);\n",
     "      if (t == 0) asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_t[1]));\n"),
    ("  fa2::store_rows<Traits>(p, w, o, m, l, smem, warp_row0, rows_total, scale);\n",
     "  __syncthreads();\n"
     "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_t[3]));\n"
     "  if (threadIdx.x == 0 && w.split < 0 && p.partial_lse != nullptr) {\n"
     "    unsigned smid;\n"
     "    asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     "    auto* out = reinterpret_cast<unsigned long long*>(p.partial_lse) + 7 * size_t(blockIdx.x);\n"
     "    for (int i = 0; i < 6; ++i) out[i] = fj_t[i];\n"
     "    out[6] = smid;\n"
     "  }\n"),
]
# Before the stores: the end of the main loop, once every warp is there (a
# barrier the shipped kernel does not have), so that the stores' time holds no
# warp's lag behind thread 0.
BEFORE_STORES = ("  fa2::store_rows<Traits>(p, w, o, m, l, smem, warp_row0, rows_total, scale);\n",
                 "  __syncthreads();\n"
                 "  asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_t[2]));\n")


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
            "  }\n")


def instrumented_templates(source: Path | None = None, stagger: tuple | None = None) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="cta-timing-")) / "templates"
    shutil.copytree(source or render.templates_dir(), folder)
    path = folder / HEADER
    text = path.read_text()
    if stagger:
        anchor, code = stagger
        assert text.count(anchor) == 1, anchor
        text = text.replace(anchor, anchor + code)
    anchor, code = BEFORE_STORES
    assert text.count(anchor) == 1, anchor
    text = text.replace(anchor, code + anchor)
    for anchor, code in PROBES:
        assert text.count(anchor) == 1, anchor
        text = text.replace(anchor, anchor + code)
    path.write_text(text)
    return folder


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
    args = parser.parse_args()
    d, b = args.head_dim, args.batch
    h = 2048 // d
    stagger = stagger_probe(args.stagger_ns, args.stagger_which) if args.stagger_ns else None
    use_templates(instrumented_templates(args.templates, stagger))
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
    stamps = torch.zeros(ctas * 7, dtype=torch.int64, device="cuda")
    w._plan = dataclasses.replace(plan, partials=(0, stamps.data_ptr()))
    for _ in range(3):
        w.run(q, k, v)
    torch.cuda.synchronize()
    t = stamps.view(ctas, 7).cpu().double()
    start, first, last, end, decoded, issued, sm = t[:, 0], t[:, 1], t[:, 2], t[:, 3], t[:, 4], t[:, 5], t[:, 6].long()
    span = (end.max() - start.min()) / 1e3
    dur = (end - start) / 1e3
    slots = len(sm.unique()) * 2 if d != 256 else len(sm.unique())
    print(f"{torch.cuda.get_device_name()}, bf16 d{d}, {b} x {args.qo_len} queries, {args.kv_len} keys, "
          f"causal={args.causal}: {ctas} CTAs on {len(sm.unique())} SMs")
    print(f"kernel span (first CTA start to last CTA end): {span:.1f} us")
    print(f"CTA mean: {dur.mean():.2f} us (min {dur.min():.2f}, max {dur.max():.2f}); entry to first tile "
          f"{((first - start) / 1e3).mean():.2f} us, tiles {((last - first) / 1e3).mean():.2f} us, stores "
          f"{((end - last) / 1e3).mean():.2f} us")
    print(f"  of the entry: work decoded {((decoded - start) / 1e3).mean():.2f} us, Q and first K/V issued "
          f"{((issued - decoded) / 1e3).mean():.2f} us, waiting for them {((first - issued) / 1e3).mean():.2f} us")
    print(f"slot use: sum of CTA durations / ({slots} slots x span) = {dur.sum() / (slots * span):.3f}")
    # Idle time between a CTA's end and the next start on the same SM (either slot).
    gaps = []
    for s in sm.unique():
        on = (sm == s).nonzero().flatten()
        order = start[on].argsort()
        st, en = start[on][order], end[on][order]
        for i in range(2, len(st)):  # the i-th CTA took the slot the earliest-ending earlier one freed
            freed = torch.sort(en[:i]).values[i - 2]
            gaps.append(float(st[i] - freed) / 1e3)
    if gaps:
        g = torch.tensor(gaps)
        print(f"slot refill gap (CTA start - slot freed): mean {g.mean():.2f} us, median {g.median():.2f} us")
    starts = ((start - start.min()) / 1e3)
    first_sm = [int(c) for c in (sm[: min(ctas, slots)] == sm[0]).nonzero().flatten()]
    print(f"first wave: CTAs {first_sm} share SM {int(sm[0])}")
    print("CTA starts per 10% of the span:", torch.histc(starts, bins=10, min=0, max=float(span)).long().tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
