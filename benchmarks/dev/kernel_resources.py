"""Registers, spills and shared memory of every kernel, from ptxas -v, for the
tensor-core and CUDA-core configurations (one per op, dtype and head_dim, with
the register-hungriest variant flags), on sm_80, sm_89 and sm_90a, and for the
sm_90a-only ones (fa2's wide tilings, the fa3 backend). Needs nvcc, no GPU.
Writes the table that docs/kernels.md holds.

Usage: python benchmarks/dev/kernel_resources.py [--out docs/kernels.md]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

from flashjit import jit, kernels
from flashjit.spec import KernelSpec, mla_spec

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
    out.append(mla_spec("bfloat16", causal=True))
    return out


# Tilings a library takes only when all its targets are sm_90a-class
# (kernels.fa2.FA2_WIDE_TILINGS), built for sm_90a alone, with their heaviest flags.
WIDE_ARCHES = ("sm_90a",)


# The heaviest flag sets of a ragged prefill (it always writes LSE): the mask
# work (causal, window) and the tanh of the soft-cap, each with and without causal.
FLAG_SETS = ({"soft_cap": True, "return_lse": True}, {"sliding_window": True, "return_lse": True},
             {"causal": True, "soft_cap": True, "return_lse": True},
             {"causal": True, "sliding_window": True, "return_lse": True})


def wide_specs() -> list[KernelSpec]:
    return [KernelSpec.make("batch_prefill_ragged", dtype, head_dim, use_tensor_cores=True, **flags)
            for head_dim in sorted(kernels.fa2.FA2_WIDE_TILINGS) for dtype in ("float16", "bfloat16")
            for flags in FLAG_SETS]


# The fa3 backend (kernels.fa3.FA3_TILINGS) builds for sm_90a alone; its
# single and ragged prefill share one kernel, so ragged stands for both; paged
# prefill is the same kernel with the paged loader (other register split).
FA3_ARCHES = tuple(sorted(kernels.fa3.ARCHES))


def fa3_specs() -> list[KernelSpec]:
    prefill = [KernelSpec.make(op, dtype, head_dim, backend="fa3", use_tensor_cores=True, **flags)
               for op in ("batch_prefill_ragged", "batch_prefill_paged")
               for head_dim in sorted(kernels.fa3.FA3_TILINGS) for dtype in ("float16", "bfloat16")
               for flags in FLAG_SETS]
    # Batch-invariant decode (causal=True: one consumer warpgroup, FA3_DECODE_TILINGS), ragged and paged loaders.
    decode = [KernelSpec.make(op, "bfloat16", head_dim, backend="fa3", use_tensor_cores=True, causal=True,
                              return_lse=True, **flags)
              for op in ("single_decode", "batch_decode_paged") for head_dim in sorted(kernels.fa3.FA3_DECODE_TILINGS)
              for flags in ({"soft_cap": True}, {"sliding_window": True})]
    mla = [mla_spec(dtype, causal=True, backend="fa3") for dtype in ("float16", "bfloat16")]
    return prefill + decode + mla


def smem_bytes(spec: KernelSpec, arches) -> int:
    return kernels.tiling_for(spec, arches)[1].smem_bytes(spec)


def kernel_kind(name: str) -> str:
    """The table's name of a kernel, from its mangled one."""
    if "fa3_attention_kernel" in name:  # Fa3Traits' last two arguments: kChunkFold, kHeadDimVo
        return "attention (warp-specialized, chunk fold)" if re.search(r"Lb1ELi\d+EEEEEv", name) \
            else "attention (warp-specialized)"
    fold = re.search(r"merge_fold_states_kernel.*ELi(\d+)EEEv", name)
    if fold:
        return f"batch-invariant fold merge, {fold.group(1)} warp(s) per row"
    return ("MLA attention (warp-specialized)" if "fa3_mla_kernel" in name else
            "MLA attention (tile pairs)" if "fa3_mla_pairs_kernel" in name else
            "MLA attention" if "mla" in name else
            "attention" if "attention_kernel" in name else
            "append" if "append_paged_kernel" in name else
            "split-KV merge, warp per row" if "warp_kernel" in name else
            "split-KV merge, CTA per row")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["FLASHJIT_CACHE_DIR"] = cache_dir
        results = [(r, ARCHES) for r in jit.build_many(specs(), arches=ARCHES)]
        wide = wide_specs()
        results += [(r, WIDE_ARCHES) for r in jit.build_many(wide, arches=WIDE_ARCHES)]
        fa3 = fa3_specs()
        results += [(r, FA3_ARCHES) for r in jit.build_many(fa3, arches=FA3_ARCHES)]
        lines = ["| configuration | kernel | arch | registers | spill stores/loads (B) | stack (B) | "
                 "dynamic smem (B) |", "|---|---|---|---|---|---|---|"]
        spills = 0
        for r, arches in results:
            for row in r.entry.manifest["resources"]:
                kind = kernel_kind(row["kernel"])
                smem = smem_bytes(r.spec, arches) if "attention" in kind else 0
                if "tile pairs" in kind:
                    smem = kernels.tiling_for(r.spec, arches)[1].pairs_smem_bytes(r.spec)
                spills += row["spill_stores"] + row["spill_loads"]
                lines.append(f"| {r.spec.name} | {kind} | {row['arch']} | {row.get('registers', '?')} | "
                             f"{row['spill_stores']}/{row['spill_loads']} | {row['stack']} | {smem} |")
    lines.append("")
    lines.append(f"{len(results) - len(wide) - len(fa3)} configurations x {len(ARCHES)} arches, "
                 f"{len(wide)} sm_90a-only fa2 ones (kernels.fa2.FA2_WIDE_TILINGS, "
                 f"{' and '.join(f'd{d}' for d in sorted(kernels.fa2.FA2_WIDE_TILINGS))}) and {len(fa3)} fa3 ones "
                 f"(kernels.fa3.FA3_TILINGS and FA3_DECODE_TILINGS, built for {', '.join(FA3_ARCHES)} alone); "
                 f"total spilled bytes: {spills}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Kernel resources\n\nFrom `ptxas -v` (nvcc "
                    f"{results[0][0].entry.manifest['key_inputs']['nvcc_version']}), written by "
                    "`python benchmarks/dev/kernel_resources.py --out docs/kernels.md`. Each configuration "
                    "takes the variant flags that cost the most registers (causal, window, soft-cap, LSE); append "
                    "has none.\n\n"
                    "The fa3 rows (`_fa3_`, kernel \"attention (warp-specialized)\", built for sm_90a alone) are "
                    "CTAs of three warpgroups, 384 threads, one CTA per SM: ptxas reports the 168 registers a "
                    "thread holds at entry; after `setmaxnreg` the loader warpgroup runs at 40 and the two "
                    "consumer warpgroups at 232 (128 x (40 + 2 x 232) = 64512 of the SM's 65536); paged prefill's "
                    "loader, which gathers rows by cp.async, at 56 and its consumers at 224. Batch-invariant mode "
                    "runs a kernel of its own (\"chunk fold\", Fa3Traits::kChunkFold): at head dims 192 and 256 it is "
                    "the only build that spills (the totals below), in the fold and epilogue code outside the key "
                    "loop (SASS of the ragged d256 build); no other build spills. "
                    "Their shared memory is dynamic: the K/V ring, Q and the mbarriers from a 1024-byte "
                    "boundary (`Fa3Tiling.smem_bytes`, [fa3.md](fa3.md)). Their SASS holds HGMMA (Q.K^T from "
                    "shared memory, P.V with P from registers and V transposed, `.tnspB`): "
                    "`tests/test_backend_choice.py` checks that with cuobjdump on a bf16 d128 build, and that "
                    "the sm_80/sm_89 fa2 build holds no GMMA. The fa3 MLA rows (`mla_paged_*_fa3_*`) are CTAs of "
                    "the same shape (loader at 56 registers, consumers at 224), 64 rows and two 72 KB slots of "
                    "[ckv | kpe] rows; `tests/test_mla.py` checks their SASS (HGMMA 64x64 and 64x256, not "
                    "serialized). Their \"MLA attention (tile pairs)\" rows are the kernel that launches of more "
                    "than 64 heads run where every tile comes by TMA (fa3/fa3_mla_pairs.cuh): three warpgroups, "
                    "384 threads, 168 registers a thread at entry; after `setmaxnreg` the producer warpgroup runs at "
                    "24 and the two computing warpgroups at 240 (128 x (24 + 2 x 240) = 64512).\n\n"
                    + text + "\n")
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
