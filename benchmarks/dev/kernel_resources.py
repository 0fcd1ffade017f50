"""Registers, spills and shared memory of every kernel, from ptxas -v, for the
tensor-core and CUDA-core configurations (one per op, dtype and head_dim, with
the register-hungriest variant flags), on sm_80, sm_89 and sm_90a. Needs nvcc,
no GPU. Writes the table that docs/kernels.md holds.

Usage: python benchmarks/dev/kernel_resources.py [--out docs/kernels.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from flashjit import jit, kernels
from flashjit.spec import KernelSpec

ARCHES = ("sm_80", "sm_89", "sm_90a")


def specs() -> list[KernelSpec]:
    out = []
    for head_dim in (64, 128, 256):
        for dtype in ("float16", "bfloat16"):
            out.append(KernelSpec.make("single_prefill", dtype, head_dim, use_tensor_cores=True, causal=True,
                                       soft_cap=True, return_lse=True))
        for dtype in ("bfloat16", "float32"):
            out.append(KernelSpec.make("single_prefill", dtype, head_dim, causal=True, soft_cap=True,
                                       sliding_window=True, return_lse=True))
            out.append(KernelSpec.make("single_decode", dtype, head_dim, soft_cap=True, sliding_window=True,
                                       return_lse=True))
            out.append(KernelSpec.make("batch_decode_paged", dtype, head_dim, soft_cap=True, sliding_window=True,
                                       return_lse=True))
        out.append(KernelSpec.make("batch_decode_paged", "bfloat16", head_dim, use_tensor_cores=True, soft_cap=True,
                                   sliding_window=True, return_lse=True))
        out.append(KernelSpec.make("batch_prefill_paged", "bfloat16", head_dim, use_tensor_cores=True, causal=True,
                                   soft_cap=True, return_lse=True))
    out += [KernelSpec.make("append_paged", dtype, head_dim) for head_dim in (64, 128, 256)
            for dtype in ("bfloat16", "float32")]
    return out


# Tilings a library takes only when all its targets are sm_90a-class
# (kernels.fa2.FA2_WIDE_TILINGS), built for sm_90a alone, with their heaviest flags.
WIDE_ARCHES = ("sm_90a",)


def wide_specs() -> list[KernelSpec]:
    return [KernelSpec.make("batch_prefill_ragged", dtype, head_dim, use_tensor_cores=True, **flags)
            for head_dim in sorted(kernels.fa2.FA2_WIDE_TILINGS) for dtype in ("float16", "bfloat16")
            for flags in ({"soft_cap": True, "return_lse": True}, {"sliding_window": True, "return_lse": True},
                          {"causal": True, "soft_cap": True, "return_lse": True},
                          {"causal": True, "sliding_window": True, "return_lse": True})]


def smem_bytes(spec: KernelSpec, arches) -> int:
    return kernels.tiling_for(spec, arches)[1].smem_bytes(spec)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["FLASHJIT_CACHE_DIR"] = cache_dir
        results = [(r, ARCHES) for r in jit.build_many(specs(), arches=ARCHES)]
        wide = wide_specs()
        results += [(r, WIDE_ARCHES) for r in jit.build_many(wide, arches=WIDE_ARCHES)]
        lines = ["| configuration | kernel | arch | registers | spill stores/loads (B) | stack (B) | "
                 "dynamic smem (B) |", "|---|---|---|---|---|---|---|"]
        spills = 0
        for r, arches in results:
            for row in r.entry.manifest["resources"]:
                kind = ("attention" if "attention_kernel" in row["kernel"] else
                        "append" if "append_paged_kernel" in row["kernel"] else
                        "split-KV merge, warp per row" if "warp_kernel" in row["kernel"] else
                        "split-KV merge, CTA per row")
                smem = smem_bytes(r.spec, arches) if kind == "attention" else 0
                spills += row["spill_stores"] + row["spill_loads"]
                lines.append(f"| {r.spec.name} | {kind} | {row['arch']} | {row.get('registers', '?')} | "
                             f"{row['spill_stores']}/{row['spill_loads']} | {row['stack']} | {smem} |")
    lines.append("")
    lines.append(f"{len(results) - len(wide)} configurations x {len(ARCHES)} arches, and "
                 f"{len(wide)} sm_90a-only ones (kernels.fa2.FA2_WIDE_TILINGS, "
                 f"{' and '.join(f'd{d}' for d in sorted(kernels.fa2.FA2_WIDE_TILINGS))}); total spilled bytes: {spills}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Kernel resources\n\nFrom `ptxas -v` (nvcc "
                    f"{results[0][0].entry.manifest['key_inputs']['nvcc_version']}), written by "
                    "`python benchmarks/dev/kernel_resources.py --out docs/kernels.md`. Each configuration "
                    "takes the variant flags that cost the most registers (causal, window, soft-cap, LSE); append "
                    "has none.\n\n"
                    + text + "\n")
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
