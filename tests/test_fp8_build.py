"""The CUDA-core FP8 KV-cache configurations the GPU tests use at d128, the
decode variants with the most registers (window, soft-cap, LSE), and fa2's
tensor-core FP8 kernels at d128 (decode, causal paged prefill, the soft-cap),
compiled by nvcc for sm_80, sm_89 and sm_90a in one build: no register spills
on any arch (ptxas -v, the manifest's resources), and the SASS converts where
the source says (codes widened by F2FP ... UNPACK_B in decode and in fa2's tile
pass; the append packs with saturation; sm_89 and sm_90a have the instructions,
sm_80 converts in software). fa3's FP8 prefill (sm_90a alone): its loader widens
with F2FP ... UNPACK_B, its wgmma stay in q's dtype (HGMMA), normal mode's kernel
spills nothing, and its tile loop gives each slot back before the softmax as the
16-bit kernels' does."""

from __future__ import annotations

import re

import pytest

import flashjit
from flashjit import kernels, render
from flashjit.spec import KernelSpec
from helpers_sass import functions, innermost_loop, sass
from sweep import fp8_specs, fp8_tensor_core_specs
from test_fa3_tile_loop import EXP, WAIT, exponentials_before_release

pytestmark = [pytest.mark.nvcc, pytest.mark.slow]

ARCHES = ("sm_80", "sm_89", "sm_90a")
# The register-hungriest decode variants (window, soft-cap, LSE) at every head dim, and each op's
# plain FP8 configuration the GPU tests use at head dim 128 (the GPU run builds the rest of them).
SPECS = [s for s in fp8_specs() if s.head_dim_qk == 128 and s.dtype_q == "bfloat16"
         and not (s.sliding_window or s.soft_cap) and not s.use_tensor_cores] + \
    [KernelSpec.make(op, "bfloat16", head_dim, dtype_kv=kv, sliding_window=True, soft_cap=True, return_lse=True)
     for op in ("single_decode", "batch_decode_paged") for kv in ("e4m3", "e5m2") for head_dim in (64, 128, 256)] + \
    [s for s in fp8_tensor_core_specs() if s.head_dim_qk == 128 and s.dtype_q == "bfloat16" and (
        s.op == "batch_decode_paged" or (s.op == "batch_prefill_paged" and s.causal and s.dtype_kv == "float8_e4m3fn")
        or s.soft_cap)]
FORMAT = {"float8_e4m3fn": "E4M3", "float8_e5m2": "E5M2"}
# fa3 (built for sm_90a alone): paged prefill, the main target, and ragged and single prefill at other head
# dims, q dtypes and formats.
FA3_SPECS = [KernelSpec.make("batch_prefill_paged", "bfloat16", 128, dtype_kv="e4m3", use_tensor_cores=True,
                             backend="fa3", causal=True, return_lse=True),
             KernelSpec.make("batch_prefill_ragged", "float16", 256, dtype_kv="e5m2", use_tensor_cores=True,
                             backend="fa3", return_lse=True),
             KernelSpec.make("single_prefill", "bfloat16", 64, dtype_kv="e5m2", use_tensor_cores=True,
                             backend="fa3", causal=True)]
# The batch-invariant chunk-fold kernel (Fa3Traits' kChunkFold) beside normal mode's.
FA3_FOLD = re.compile(r"ELb1ELi\d+EEE13__nv_fp8")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-cache")
    results = flashjit.build_many(SPECS + FA3_SPECS, ARCHES, root=root)
    return {r.spec: r for r in results}


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_fp8_configuration_builds_without_spills(built, spec):
    result = built[spec]
    assert result.entry is not None, result.error
    usage = result.entry.manifest["resources"]
    main = "append_quantize_kernel" if spec.op == "append_paged" else \
        "fa2_attention_kernel" if spec.use_tensor_cores else "cuda_core_decode_attention_kernel"
    assert any(main in u["kernel"] for u in usage), f"no {main} in the ptxas report"
    assert {u["arch"] for u in usage} == set(ARCHES)
    spills = [u for u in usage if u["spill_stores"] or u["spill_loads"] or u["stack"]]
    assert spills == [], f"{spec.name} spills: {spills}"
    assert result.entry.manifest["tolerance"] == flashjit.error_model.profile(spec)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.head_dim_qk == 128 and (s.op != "single_decode"
                                                                               or s.return_lse)],
                         ids=lambda s: s.name)
def test_fp8_conversions_in_the_sm90a_sass(built, spec):
    kind = FORMAT[spec.dtype_kv]
    code = sass(built[spec].entry.artifact)
    if spec.op == "append_paged":
        assert f"F2FP.SATFINITE.{kind}.F32.PACK_AB" in code, "quantise with saturation, two codes an instruction"
    elif spec.use_tensor_cores:  # fa2_fp8.cuh: code pairs widened to fp16 pairs, then (bf16 q) packed as bf16
        assert f"F2FP.F16.{kind}.UNPACK_B" in code, "code pairs widened to fp16 pairs in the tile pass"
        assert "F2FP.BF16.F32.PACK_AB" in code, "fp16 pairs repacked as bf16 for the bf16 MMAs"
        assert "KvType=*/__nv_fp8" in render.render(spec).text
    else:
        assert f"F2FP.F16.{kind}.UNPACK_B" in code, "codes widened to fp16 pairs where the loop reads them"
        text = render.render(spec).text
        assert "DTypeKV=*/__nv_fp8" in text


@pytest.mark.parametrize("spec", FA3_SPECS, ids=lambda s: s.name)
def test_fa3_fp8_widens_for_wgmma_in_q_dtype_without_spills(built, spec):
    result = built[spec]
    assert result.entry is not None, result.error
    text = render.render(spec).text
    assert "Fa3Fp8Traits<" in text and "/*KvType=*/__nv_fp8_" + FORMAT[spec.dtype_kv].lower() in text
    usage = [u for u in result.entry.manifest["resources"] if "fa3_attention_kernel" in u["kernel"]]
    assert {u["arch"] for u in usage} == {"sm_90a"} and len(usage) == 2, usage  # normal mode's and the fold's
    # The fold kernels at d192 and d256 spill, as the 16-bit ones do (docs/fa3.md); normal mode's never.
    spills = [u for u in usage if (u["spill_stores"] or u["spill_loads"] or u["stack"])
              and (spec.head_dim_qk <= 128 or not FA3_FOLD.search(u["kernel"]))]
    assert spills == [], f"{spec.name} spills: {spills}"
    code = sass(result.entry.artifact)
    keys = kernels.tiling_for(spec)[1].keys_per_tile
    assert f"F2FP.F16.{FORMAT[spec.dtype_kv]}.UNPACK_B" in code, "code pairs widened to fp16 pairs by the loader"
    # Q.K^T's wgmma: fp16 operands print as HGMMA.64xNx16.F32, bf16 ones with .BF16 after it.
    forms = set(re.findall(rf"HGMMA\.64x{keys}x16\.F32(\.\w+)?", code))
    assert forms == {".BF16" if spec.dtype_q == "bfloat16" else ""}, f"Q.K^T's wgmma in q's dtype: {forms}"
    assert "QGMMA" not in code, "no FP8 wgmma: the keys are widened to q's dtype"
    by_name = functions(code)
    for name in (n for n in by_name if "fa3_attention_kernel" in n):
        loop = innermost_loop(by_name[name], must_hold=("HGMMA", WAIT, EXP))
        assert exponentials_before_release(loop) == [0, 0, 0, 0], name
