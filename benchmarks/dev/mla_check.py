"""A few small MLA launches per backend, each checked against float64 within
its profile: decode and causal chunks of 4, 16 and 128 heads, pages of 1, 16
and 64 in random order (64 in the small set too), ragged lengths with an empty
request and split-KV plans of 16 and 128 heads. Small enough for compute-sanitizer (memcheck, racecheck, synccheck), so
that a clean sanitizer run is also a correct one; with a time limit per launch
set by the caller (`timeout`), a hang shows as such.

--fa3-tiling 'Fa3MlaTiling(...)' runs the fa3 cases on that tiling (e.g. key_groups=1),
built into a cache of its own; with --same-bits each of its outputs must also
equal the shipped tiling's bit for bit (a tiling that reorders the work but not
the arithmetic, such as alternate=True).

Usage: python benchmarks/dev/mla_check.py [--backends fa2 fa3] [--small] [--fa3-tiling EXPR [--same-bits]]
       compute-sanitizer --tool racecheck --error-exitcode 1 python benchmarks/dev/mla_check.py --small
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import fa3_mla_tiling, parse_fa3_mla_tiling

import flashjit
from flashjit.error_model import mla_tolerance
from flashjit.kernels import fa3

SM_SCALE = 1 / math.sqrt(192)
SHIPPED = fa3.MLA_TILING


def case(backend, dtype, heads, page_size, qo_len, causal, kv_lens, same_bits=False, **plan_kw) -> float:
    pages = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages) + 2
    ckv = torch.randn(num_pages, page_size, 512, device="cuda").to(dtype)
    kpe = torch.randn(num_pages, page_size, 64, device="cuda").to(dtype)
    tokens = qo_len * len(kv_lens)
    q_nope = torch.randn(tokens, heads, 512, device="cuda").to(dtype)
    q_pe = torch.randn(tokens, heads, 64, device="cuda").to(dtype)
    qo_indptr = torch.arange(len(kv_lens) + 1, dtype=torch.int32, device="cuda") * qo_len
    kv_indptr = torch.tensor([0, *pages], device="cuda").cumsum(0).to(torch.int32)
    kv_indices = torch.randperm(num_pages, device="cuda")[:sum(pages)].to(torch.int32)

    def run():
        wrapper = flashjit.BatchMLAPagedAttentionWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                         backend=backend, strict=True)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, torch.tensor(kv_lens, dtype=torch.int32, device="cuda"),
                     heads, 512, 64, page_size, causal, SM_SCALE, dtype, dtype, **plan_kw)
        assert wrapper._plan.module.spec.backend == backend
        out = torch.full_like(q_nope, float("nan"))
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
        torch.cuda.synchronize()
        return out

    out = run()
    if same_bits and backend == "fa3":
        with fa3_mla_tiling(SHIPPED):
            shipped = run()
        differ = int((out.view(torch.int16) != shipped.view(torch.int16)).sum())
        assert differ == 0, f"{differ} of {out.numel()} elements differ from the shipped tiling's"
    ref, _ = flashjit.mla_reference(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_lens,
                                    causal=causal, sm_scale=SM_SCALE)
    tol = mla_tolerance(dtype, kv_len=max(max(kv_lens), 1), q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe,
                        sm_scale=SM_SCALE, backend=backend)
    label = f"{backend} {str(dtype)[6:]} heads {heads} page {page_size} qo {qo_len} {plan_kw or ''}"
    ratio = tol.assert_close(out, ref, label)
    print(f"{label}: max err / bound {ratio:.3f}", flush=True)
    return ratio


def run_backend(backend: str, small: bool, same_bits: bool = False) -> float:
    """Worst err/bound of the backend's cases; same_bits: every fa3 output must also equal the shipped tiling's."""
    # Pages of 64 and 128 heads: whole tiles by TMA (the last, partial one
    # gathered), in a causal chunk of two tokens (four row tiles a request).
    cases = [(torch.bfloat16, 16, 16, 1, False, [70, 0, 200]),
             (torch.float16, 128, 3, 4, True, [5, 130]),
             (torch.bfloat16, 128, 64, 2, True, [130, 64])]
    if not small:
        cases += [(torch.bfloat16, 128, 64, 1, False, [1, 64, 65, 1000]),
                  (torch.bfloat16, 16, 1, 4, True, [4, 17, 300]),
                  (torch.float16, 32, 16, 2, True, [2, 2000])]
    worst = 0.0
    for dtype, heads, page_size, qo_len, causal, kv_lens in cases:
        worst = max(worst, case(backend, dtype, heads, page_size, qo_len, causal, kv_lens, same_bits))
    worst = max(worst, case(backend, torch.bfloat16, 16, 16, 1, False, [3000, 1, 700], same_bits,
                            fixed_split_size=4))
    return max(worst, case(backend, torch.bfloat16, 128, 64, 1, False, [300, 1, 129], same_bits,
                           fixed_split_size=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["fa2", "fa3"])
    parser.add_argument("--small", action="store_true", help="five cases per backend (for compute-sanitizer)")
    parser.add_argument("--fa3-tiling", metavar="EXPR", help="run fa3 on this Fa3MlaTiling(...)")
    parser.add_argument("--same-bits", action="store_true", help="its outputs bit for bit the shipped tiling's")
    args = parser.parse_args()
    tiling = parse_fa3_mla_tiling(args.fa3_tiling) if args.fa3_tiling else None
    torch.manual_seed(0)
    worst = 0.0
    for backend in args.backends:
        with fa3_mla_tiling(tiling if backend == "fa3" else None):
            worst = max(worst, run_backend(backend, args.small, args.same_bits and tiling is not None))
    print(f"worst max err / bound: {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
