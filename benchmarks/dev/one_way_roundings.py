"""Inputs whose fp32 roundings all go one way, on the GPU kernels, against each
configuration's profile: "sink" (the first key takes the weight, every other
key 2^-24.5 of it) and "flat" (equal logits), both over a constant V, at long
contexts. The CUDA-core emulation (tests/cuda_core_emulation.py) found these
past the sqrt(n) form of the CUDA-core profiles (docs/numerics-fp32.md); this
runs them through every path, the tensor-core ones included, whose P.V adds 16
keys per accumulator rounding (docs/numerics.md, "Why √n and not n"). The
single-request ops split long contexts into chunks of a few thousand keys; the
ragged wrapper planned with disable_split_kv ("ragged unsplit") runs each row's
whole chain in one CTA, as a batch that fills the GPU does.

Usage: python benchmarks/dev/one_way_roundings.py [--kv-lens 32768 131072] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import flashjit
from flashjit.reference import attention_reference
from flashjit.spec import KernelSpec

D, HEADS = 128, 4


def inputs(case: str, n: int, dtype, queries: int):
    """q [queries, HEADS, D], k / v [n, HEADS, D]; V's rows all one random vector."""
    q = torch.zeros(queries, HEADS, D, device="cuda")
    k = torch.zeros(n, HEADS, D, device="cuda")
    if case == "sink":
        # s_0 - s_j = 24.5 ln 2 after sm_scale = 1/sqrt(D): weight ratio 2^-24.5.
        q[..., 0] = 1.0
        k[0, :, 0] = 24.5 * math.log(2.0) * math.sqrt(D)
    v = torch.randn(1, HEADS, D, device="cuda").expand(n, HEADS, D).contiguous()
    return q.to(dtype), k.to(dtype), v.to(dtype)


def ragged_unsplit(q, k, v, tensor_cores: bool, backend: str):
    """One request through the ragged wrapper with split-KV off: each row tile's
    keys in one CTA, one unbroken P.V chain."""
    w = flashjit.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                      backend=backend, strict=True)
    bounds = lambda n: torch.tensor([0, n], dtype=torch.int32)  # noqa: E731
    w.plan(bounds(q.shape[0]), bounds(k.shape[0]), HEADS, HEADS, D, q_data_type=q.dtype, disable_split_kv=True,
           use_tensor_cores=tensor_cores)
    assert w._plan.work.merge_indptr is None, "the plan split the keys"
    return w.run(q, k, v)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-lens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    fa3 = torch.cuda.get_device_capability() == (9, 0)
    paths = [("cc", False, "fa2"), ("fa2", True, "fa2")] + ([("fa3", True, "fa3")] if fa3 else [])
    lines = [f"device: {torch.cuda.get_device_name()}; max |out - ref| / bound of the configuration's profile", "",
             "| op | dtype | path | case | kv_len | max err | err / bound |", "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    worst = 0.0
    for op in ("single_prefill", "single_decode", "ragged_unsplit"):
        for dtype in (torch.float16, torch.bfloat16):
            for name, tc, backend in paths:
                if op == "single_decode" and backend == "fa3":
                    continue  # decode has no fa3 kernel outside batch-invariant mode
                for case in ("sink", "flat"):
                    for n in args.kv_lens:
                        q, k, v = inputs(case, n, dtype, 1 if op == "single_decode" else 16)
                        kw = dict(use_tensor_cores=tc, backend=backend, strict=True)
                        if op == "single_prefill":
                            out = flashjit.single_prefill_with_kv_cache(q, k, v, **kw)
                        elif op == "single_decode":
                            out = flashjit.single_decode_with_kv_cache(q[0], k, v, **kw)[None]
                        else:
                            out = ragged_unsplit(q, k, v, tc, backend)
                        ref, _ = attention_reference(q, k, v)
                        spec = KernelSpec.make("batch_prefill_ragged" if op == "ragged_unsplit" else op, dtype, D,
                                               use_tensor_cores=tc, backend=backend)
                        tol = flashjit.tolerance(spec, q=q, k=k, v=v, kv_len=n)
                        ratio = tol.ratio(out, ref)
                        worst = max(worst, ratio)
                        err = float((out.double() - ref).abs().max())
                        line = f"| {op} | {str(dtype)[6:]} | {name} | {case} | {n} | {err:.2e} | {ratio:.3f} |"
                        lines.append(line)
                        print(line, flush=True)
    lines.append(f"\nworst err / bound: {worst:.3f}")
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
