"""The CUDA-core FP8 KV-cache configurations the GPU tests use at d128, the
decode variants with the most registers (window, soft-cap, LSE), and fa2's
tensor-core FP8 kernels at d128 (decode, causal paged prefill, the soft-cap),
compiled by nvcc for sm_80, sm_89 and sm_90a in one build: no register spills
on any arch (ptxas -v, the manifest's resources), and the SASS converts where
the source says (codes widened by F2FP ... UNPACK_B in decode and in fa2's tile
pass; the append packs with saturation; sm_89 and sm_90a have the instructions,
sm_80 converts in software)."""

from __future__ import annotations

import pytest

import flashjit
from flashjit import render
from flashjit.spec import KernelSpec
from helpers_sass import sass
from sweep import fp8_specs, fp8_tensor_core_specs

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


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-cache")
    results = flashjit.build_many(SPECS, ARCHES, root=root)
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


def test_sixteen_dim_lanes_build_without_spills(tmp_path, monkeypatch):
    """The CUDA-core FP8 variant benchmarks/dev/decode_tilings.py times (16 dims a lane, two
    CTAs per SM; no shipped tiling uses it yet): its heaviest flags build without spills."""
    from flashjit import kernels
    from flashjit.kernels.cuda_core import CudaDecodeTiling

    variant = CudaDecodeTiling(4, 4, 3, 2, dims_per_lane=16)
    monkeypatch.setattr(kernels.cuda_core, "cuda_decode_tiling", lambda spec: variant)
    specs = [KernelSpec.make("batch_decode_paged", "bfloat16", 128, dtype_kv=kv, sliding_window=True, soft_cap=True,
                             return_lse=True) for kv in ("e4m3", "e5m2")]
    for result in flashjit.build_many(specs, ("sm_80", "sm_90a"), root=tmp_path):
        assert result.entry is not None, result.error
        assert "kDimsPerLane=*/16" in render.render(result.spec).text
        usage = [u for u in result.entry.manifest["resources"] if "cuda_core_decode_attention_kernel" in u["kernel"]]
        assert usage and not [u for u in usage if u["spill_stores"] or u["spill_loads"] or u["stack"]], usage
