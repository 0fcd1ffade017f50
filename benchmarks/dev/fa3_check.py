"""First look at the fa3 kernels on an sm_90a GPU, before the full GPU suite:
builds the selected head dims' fa3 configurations, runs each once on a few
small shapes (one request, a ragged batch, a partial last tile, causal and
not), and prints the error against the float64 reference as a fraction of the
tolerance profile, beside fa2 on the same inputs. Meant to run under `timeout`:
a pipeline that deadlocks shows as the command timing out, not as a wrong number.

Usage: timeout 120 python benchmarks/dev/fa3_check.py [--head-dims 64 128 256] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import flashjit
from flashjit.reference import attention_reference
from flashjit.spec import KernelSpec

SHAPES = [(1, 1), (37, 300), (128, 128), (300, 1000), (513, 77), (200, 4096)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    specs = [KernelSpec.make("single_prefill", dtype, d, backend=b, use_tensor_cores=True, causal=c)
             for d in args.head_dims for b in ("fa2", "fa3") for c in (False, True)]
    flashjit.build_many(specs)
    worst = 0.0
    print("| head_dim | causal | qo x kv | heads | fa3 err/bound | fa2 err/bound |")
    print("|---|---|---|---|---|---|")
    for d in args.head_dims:
        for causal in (False, True):
            for qo_len, kv_len in SHAPES:
                for heads in ((4, 4), (8, 2)):
                    q = torch.randn(qo_len, heads[0], d, device="cuda").to(dtype)
                    k = torch.randn(kv_len, heads[1], d, device="cuda").to(dtype)
                    v = torch.randn(kv_len, heads[1], d, device="cuda").to(dtype)
                    ref, _ = attention_reference(q, k, v, causal=causal)
                    ratios = []
                    for backend in ("fa3", "fa2"):
                        out = flashjit.single_prefill_with_kv_cache(q, k, v, causal=causal, backend=backend,
                                                                    use_tensor_cores=True)
                        torch.cuda.synchronize()
                        spec = KernelSpec.make("single_prefill", dtype, d, backend=backend, use_tensor_cores=True,
                                               causal=causal)
                        tol = flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=kv_len, sm_scale=1 / math.sqrt(d))
                        ratio = float(((out.double() - ref).abs() / tol.bound(ref)).max())
                        ratios.append(ratio if not math.isnan(ratio) else float("inf"))
                    worst = max(worst, ratios[0])
                    print(f"| {d} | {causal} | {qo_len} x {kv_len} | {heads[0]}/{heads[1]} | {ratios[0]:.3f} | "
                          f"{ratios[1]:.3f} |", flush=True)
    print(f"worst fa3 err/bound: {worst:.3f}")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
