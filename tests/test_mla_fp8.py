"""MLA over an FP8 ckv / kpe cache without a GPU: the configurations (names
that spell the cache dtype, the rendered traits, tilings whose shared memory is
the 16-bit cache's, fa3's loader kernel at every head count), the backend
choice and the prewarm selection, plan() and run() bad inputs (ValueError
naming the argument before any launch, NotImplementedError for what flashjit
does not take), the scales handed to the launch, the error model's terms, and
builds for sm_80 / sm_89 / sm_90a without spills whose SASS widens the codes
where the source says."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

import flashjit
from flashjit import arch, jit, selection
from flashjit.error_model import U32, mla_tolerance, profile
from flashjit.kernels import fa2, fa3, tiling_for
from flashjit.ops import _batch, _scales, mla as mla_ops
from flashjit.render import render
from flashjit.spec import mla_spec
import helpers_cache
from helpers_cache import needs_nvcc, set_cache_env
from helpers_sass import functions, sass
from test_bad_input_wrappers import _workspace
from test_fp8_kv import _args

no_compile = helpers_cache.no_compile  # a fixture, looked up by name

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SHORT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
SM_SCALE = 1 / math.sqrt(192)


def fp8_id(dtype) -> str:
    return SHORT[dtype]


# ---------------------------------------------------------------------------
# Configurations


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("kv", FP8, ids=fp8_id)
def test_fp8_mla_spec_names_its_cache_dtype_and_renders_it(kv, backend):
    spec = mla_spec("bfloat16", backend=backend, dtype_kv=kv).validate()
    assert spec.name == f"mla_paged_bf16_kv{SHORT[kv]}_qk576_vo512_{backend}_tc_lse"
    plain = mla_spec("bfloat16", backend=backend)
    text = render(spec, ("sm_90a",)).text
    assert f"/*KvType=*/__nv_fp8_{SHORT[kv]}" in text
    assert "/*KvType=*/__nv_bfloat16" in render(plain, ("sm_90a",)).text
    _, tiling = tiling_for(spec, ("sm_90a",))
    if backend == "fa2":
        # Stages of codes take half a 16-bit stage's bytes; the widened tile the other half.
        assert tiling.smem_bytes(spec) == tiling.smem_bytes(plain) == 92160
        assert tiling.wide_smem_bytes(spec) == tiling.wide_smem_bytes(plain)
        assert tiling.wide_min_heads == fa2.MLA_WIDE_MIN_HEADS  # the 64-row kernel takes FP8 too
    else:
        # Codes land in the upper half of the slot they are widened into; no pairs kernel.
        assert tiling.smem_bytes(spec) == tiling.smem_bytes(plain)
        assert tiling.pairs is False and fa3.MLA_TILING.pairs is True
        assert "/*kPairs=*/false" in text


@pytest.mark.parametrize("change,what", [
    ({"dtype_q": "float8_e4m3fn"}, r"FP8 queries or outputs \(dtype_q=float8_e4m3fn"),
    ({"dtype_o": "float8_e5m2"}, r"FP8 queries or outputs .*dtype_o=float8_e5m2"),
    ({"dtype_o": "float16"}, r"dtype_q=bfloat16, dtype_kv=float8_e4m3fn, dtype_o=float16"),
    ({"dtype_q": "float32", "dtype_o": "float32"}, r"float32 on tensor cores"),
])
def test_unsupported_fp8_mla_configurations_name_the_supported_set(change, what):
    spec = mla_spec("bfloat16", dtype_kv="float8_e4m3fn").replace(**change)
    with pytest.raises(ValueError, match=what) as info:
        spec.validate()
    assert "FP8 (float8_e4m3fn or float8_e5m2)" in str(info.value)
    assert str(info.value).endswith("Nearest working choice: mla_paged_bf16_kve4m3_qk576_vo512_fa2_tc_lse")


def test_fnuz_formats_are_another_platforms():
    with pytest.raises(ValueError, match="another platform's FP8 format"):
        mla_spec("bfloat16", dtype_kv="float8_e4m3fnuz")


def test_fp8_mla_runs_fa3_on_sm90a_and_fa2_elsewhere():
    """fa3's FP8 MLA kernel passed the GPU tests on an H100 (docs/mla.md): auto takes it where
    every target has wgmma, fa2 otherwise."""
    for kv in ("float8_e4m3fn", "float8_e5m2"):
        backend, _, reason = arch.choose_backend("mla_paged", "bfloat16", None, "auto", targets=("sm_90a",),
                                                 kv_dtype=kv)
        assert backend == "fa3", reason
        for targets in (("sm_80",), ("sm_89",), ("sm_80", "sm_90a")):
            assert arch.choose_backend("mla_paged", "float16", None, "auto", targets=targets, kv_dtype=kv)[0] == "fa2"


def test_prewarm_kv_dtype_selects_fp8_mla():
    specs = selection.specs_from_args(_args("--op", "mla_paged", "--kv-dtype", "e4m3", "e5m2", "--arch", "sm_89"))
    assert sorted(s.name for s in specs) == sorted(f"mla_paged_bf16_kv{kv}_qk576_vo512_fa2_tc{c}_lse"
                                                   for kv in ("e4m3", "e5m2") for c in ("", "_causal"))
    specs = selection.specs_from_args(_args("--op", "mla_paged", "--kv-dtype", "e5m2", "--arch", "sm_90a"))
    assert {s.backend for s in specs} == {"fa3"} and {s.dtype_kv for s in specs} == {"float8_e5m2"}
    assert "--kv-dtype e5m2" in selection.flag_words(specs[0])


# ---------------------------------------------------------------------------
# plan() and run(): a CPU wrapper with a stand-in kernel module


class _Module(SimpleNamespace):
    """What plan() reads of a kernel module, without one."""


@pytest.fixture
def launches(monkeypatch):
    """plan() with a stand-in module; run() records the scales each launch gets."""
    monkeypatch.setattr(jit, "get_module", lambda spec: _Module(spec=spec, rows_per_cta=16, split_align=32))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    calls = []

    def launch(self, q_nope, q_pe, ckv, kpe, out, lse, scales=(_scales.UNIT, _scales.UNIT)):
        calls.append(scales)

    monkeypatch.setattr(mla_ops.BatchMLAPagedAttentionWrapper, "_launch_mla", launch)
    return calls


def _planned(kv_data_type=torch.float8_e4m3fn, q_data_type=torch.bfloat16, heads=16):
    """Two decode requests: 40 keys in 3 pages of 16, 16 keys in one."""
    wrapper = flashjit.BatchMLAPagedAttentionWrapper(_workspace())
    wrapper._device = torch.device("cpu")
    wrapper.plan(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32),
                 torch.tensor([5, 0, 2, 7], dtype=torch.int32), torch.tensor([40, 16], dtype=torch.int32), heads,
                 512, 64, 16, False, SM_SCALE, q_data_type, kv_data_type)
    return wrapper


def _inputs(kv=torch.float8_e4m3fn, kpe=None, q_dtype=torch.bfloat16, heads=16):
    q_nope = torch.randn(2, heads, 512).to(q_dtype)
    q_pe = torch.randn(2, heads, 64).to(q_dtype)
    return q_nope, q_pe, torch.randn(8, 16, 512).to(kv), torch.randn(8, 16, 64).to(kpe or kv)


@pytest.mark.parametrize("kv", FP8, ids=fp8_id)
def test_plan_selects_the_fp8_configuration_and_run_passes_the_scales(kv, launches):
    wrapper = _planned(kv)
    assert wrapper._plan.module.spec == mla_spec("bfloat16", dtype_kv=kv)
    inputs = _inputs(kv)
    wrapper.run(*inputs)
    wrapper.run(*inputs, ckv_scale=0.5, kpe_scale=torch.tensor([3.0]))
    wrapper.run(*inputs, kpe_scale=0.25)
    assert launches == [(_scales.UNIT, _scales.UNIT), (_scales.ScaleArg(0.5, 0), _scales.ScaleArg(3.0, 0)),
                        (_scales.UNIT, _scales.ScaleArg(0.25, 0))]


def test_a_cuda_tensor_scale_goes_to_the_kernel_by_address():
    key = _scales.TensorScale(256, torch.float32, torch.device("cuda", 0), 1)
    ckv, kpe = mla_ops.check_scales(torch.float8_e4m3fn, (key, 2.0), torch.device("cuda", 0))
    assert ckv == _scales.ScaleArg(1.0, 256) and kpe == _scales.ScaleArg(2.0, 0)
    # The ratio of a tensor scale is the caller's to keep in range: not read on the host.
    assert mla_ops.check_scales(torch.float8_e4m3fn, (key, 1e-30), torch.device("cuda", 0))[1].value == 1e-30


@pytest.mark.usefixtures("no_compile")
@pytest.mark.parametrize("plan_kw,match", [
    (dict(kv_data_type=torch.float8_e4m3fnuz), r"^kv_data_type: .*another platform's FP8 format"),
    (dict(q_data_type=torch.float8_e4m3fn), r"^q_data_type: .*FP8 is supported for the KV cache only"),
    (dict(q_data_type=torch.float32), r"^q_data_type: MLA runs on tensor cores in float16 or bfloat16 with an FP8 "
                                      r"cache \(kv_data_type=torch.float8_e4m3fn\), got torch.float32"),
    (dict(kv_data_type=torch.float16), r"^kv_data_type: expected torch.bfloat16 \(as q_data_type\) or an FP8 "
                                       r"format"),
])
def test_plan_mistakes(plan_kw, match):
    with pytest.raises(ValueError, match=match):
        _planned(**plan_kw)


@pytest.mark.parametrize("plan_kv,inputs,exc,match", [
    (torch.float8_e4m3fn, dict(kv=torch.bfloat16), ValueError,
     r"^ckv_cache: expected a torch.float8_e4m3fn tensor .* got torch.bfloat16 \(8, 16, 512\); plan with "
     r"kv_data_type=torch.bfloat16"),
    (torch.bfloat16, dict(kv=torch.float8_e4m3fn), ValueError,
     r"^ckv_cache: expected a torch.bfloat16 tensor .*; plan with kv_data_type=torch.float8_e4m3fn"),
    (torch.float8_e4m3fn, dict(kpe=torch.float8_e5m2), ValueError,
     r"^kpe_cache: expected a torch.float8_e4m3fn tensor .* got torch.float8_e5m2"),
    (torch.float8_e4m3fn, dict(kv=torch.float8_e4m3fnuz), ValueError,
     r"^ckv_cache: expected dtype .* got torch.float8_e4m3fnuz: another platform's FP8 format"),
    (torch.float8_e4m3fn, dict(q_dtype=torch.float8_e4m3fn), ValueError,
     r"^q_nope: expected dtype .* FP8 is supported for the KV cache only"),
])
def test_caches_against_the_planned_kv_dtype(plan_kv, inputs, exc, match, launches):
    wrapper = _planned(plan_kv)
    with pytest.raises(exc, match=match):
        wrapper.run(*_inputs(**inputs))
    assert launches == []


@pytest.mark.parametrize("kw,exc,match", [
    (dict(ckv_scale=float("nan")), ValueError, r"^ckv_scale: expected a finite positive scale, got nan"),
    (dict(ckv_scale=float("inf")), ValueError, r"^ckv_scale: expected a finite positive scale, got inf"),
    (dict(kpe_scale=0.0), ValueError, r"^kpe_scale: expected a finite positive scale, got 0.0"),
    (dict(kpe_scale=-2.0), ValueError, r"^kpe_scale: expected a finite positive scale, got -2.0"),
    (dict(ckv_scale=1e-300), ValueError, r"^ckv_scale: expected a scale within float32's normal range"),
    (dict(ckv_scale="2"), ValueError, r"^ckv_scale: expected a Python float or a one-element float32 tensor"),
    (dict(kpe_scale=torch.tensor([1.0, 2.0])), ValueError, r"^kpe_scale: expected .* got a torch.float32 tensor of "
                                                           r"2 elements"),
    (dict(ckv_scale=1e30, kpe_scale=1e-30), ValueError, r"^ckv_scale: expected ckv_scale / kpe_scale within "
                                                        r"float32's normal range"),
    (dict(ckv_scale_arr=torch.ones(8, 16, 4)), NotImplementedError, r"^ckv_scale_arr: per-token scales"),
])
def test_scale_mistakes(kw, exc, match, launches):
    wrapper = _planned()
    with pytest.raises(exc, match=match):
        wrapper.run(*_inputs(), **kw)
    assert launches == []


@pytest.mark.parametrize("name", ["ckv_scale", "kpe_scale"])
def test_scales_with_a_16_bit_cache_are_not_taken(name, launches):
    """As paged decode's k_scale / v_scale (ops._scales.check_scales_for)."""
    wrapper = _planned(torch.bfloat16)
    with pytest.raises(NotImplementedError, match=rf"^{name}=0.5: scales apply to an FP8 KV cache only"):
        wrapper.run(*_inputs(torch.bfloat16), **{name: 0.5})
    assert launches == []


# ---------------------------------------------------------------------------
# The error model


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_mla_profile_terms(dtype):
    """Three more logit roundings than a 16-bit cache's MLA (the scale ratio, its
    product with S's ckv part, kpe_scale joining sm_scale), one more on the
    output (ckv_scale); P rounds to q's dtype, as the MMAs run in it."""
    fp8, plain = profile(mla_spec(dtype, dtype_kv="float8_e5m2")), profile(mla_spec(dtype))
    assert fp8["logit_per_s"] - plain["logit_per_s"] == pytest.approx(2 * math.log(2) * 3 * U32)
    assert fp8["rtol"] - plain["rtol"] == pytest.approx(U32)
    assert fp8["p_rounding"] == plain["p_rounding"] == (2.0**-11 if dtype == "float16" else 2.0**-8)
    assert fp8["kv_scales"] and fp8["dtype_mma"] == dtype and fp8["dtype_in"] == "float8_e5m2"
    # The paged ops' FP8 caches add one logit rounding (k_scale), MLA three.
    d128 = profile(flashjit.KernelSpec.make("batch_decode_paged", dtype, 128, use_tensor_cores=True,
                                            dtype_kv="float8_e5m2"))
    plain128 = profile(flashjit.KernelSpec.make("batch_decode_paged", dtype, 128, use_tensor_cores=True))
    assert d128["logit_per_s"] - plain128["logit_per_s"] == pytest.approx(2 * math.log(2) * U32)


def test_fp8_mla_tolerance_measures_the_dequantised_cache():
    gen = torch.Generator().manual_seed(1)
    kv_len, ckv_scale, kpe_scale = 1000, 0.25, 4.0
    q_nope, q_pe = torch.randn(1, 16, 512, generator=gen), torch.randn(1, 16, 64, generator=gen)
    ckv = torch.randn(kv_len, 512, generator=gen).mul(4).to(torch.float8_e4m3fn)
    kpe = torch.randn(kv_len, 64, generator=gen).div(4).to(torch.float8_e4m3fn)
    tol = mla_tolerance("bfloat16", kv_len=kv_len, q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe, sm_scale=SM_SCALE,
                        dtype_kv=torch.float8_e4m3fn, ckv_scale=ckv_scale, kpe_scale=kpe_scale)
    values_ckv, values_kpe = ckv.double() * ckv_scale, kpe.double() * kpe_scale
    same = mla_tolerance("bfloat16", kv_len=kv_len, q_nope=q_nope, q_pe=q_pe, ckv=values_ckv, kpe=values_kpe,
                         sm_scale=SM_SCALE, dtype_kv="e4m3")
    assert tol == same
    vmax = float(values_ckv.abs().max())
    assert 2.0**-8 * vmax <= tol.atol <= 1.7 * 2.0**-8 * vmax  # the P rounding dominates, as with bf16 caches
    assert flashjit.tolerance(op="mla_paged", dtype="bfloat16", dtype_kv="e4m3", kv_len=kv_len, v_absmax=vmax,
                              logit_absmax=30.0).rtol == tol.rtol


# ---------------------------------------------------------------------------
# Builds


def _arch_sections(text: str) -> dict[str, str]:
    """A multi-arch cuobjdump -sass listing cut at each arch's header."""
    parts = re.split(r"\n\s*arch = (sm_\w+)", text)
    out = {}
    for arch_name, body in zip(parts[1::2], parts[2::2]):
        out[arch_name] = out.get(arch_name, "") + body
    return out


def _no_spills(result, kernel: str, arches) -> None:
    assert result.entry is not None, result.error
    usage = result.entry.manifest["resources"]
    assert sorted(u["arch"] for u in usage if kernel in u["kernel"]) == sorted(arches)
    spills = [u for u in usage if u["spill_stores"] or u["spill_loads"] or u["stack"]]
    assert spills == [], spills


@pytest.mark.nvcc
@pytest.mark.slow
@needs_nvcc
def test_fa2_fp8_mla_builds_without_spills_and_widens_codes_in_the_tile_pass(monkeypatch, tmp_path):
    """The 16-row kernel for sm_80, sm_89 and sm_90a in one build; the 64-row
    one in an sm_90a build. sm_89 / sm_90a widen code pairs to fp16 pairs
    (F2FP ... UNPACK_B) and repack them as bf16 for the bf16 MMAs; sm_80 has no
    FP8 conversion instruction (software)."""
    set_cache_env(monkeypatch, tmp_path / "cache")
    narrow = mla_spec("bfloat16", dtype_kv="float8_e4m3fn")
    wide = mla_spec("float16", causal=True, dtype_kv="float8_e5m2")
    (every,) = jit.build_many([narrow], arches=("sm_80", "sm_89", "sm_90a"))
    (hopper,) = jit.build_many([wide], arches=("sm_90a",))
    _no_spills(every, "fa2_mla_kernel", ("sm_80", "sm_89", "sm_90a"))
    _no_spills(hopper, "fa2_mla_kernel", ("sm_90a",))
    assert any("fa2_mla_wide_kernel" in u["kernel"] for u in hopper.entry.manifest["resources"])
    sections = _arch_sections(sass(every.entry.artifact))
    for name in ("sm_89", "sm_90a"):
        assert "F2FP.F16.E4M3.UNPACK_B" in sections[name] and "F2FP.BF16.F32.PACK_AB" in sections[name], name
    assert "UNPACK_B" not in sections["sm_80"]
    kernels = functions(sass(hopper.entry.artifact))
    for name, code in kernels.items():
        if "fa2_mla" in name:
            assert any("F2FP.F16.E5M2.UNPACK_B" in ins for _, ins in code), name


@pytest.mark.nvcc
@pytest.mark.slow
@needs_nvcc
def test_fa3_fp8_mla_builds_without_spills_and_widens_codes_in_the_loader(monkeypatch, tmp_path):
    """The loader kernel alone (no pairs kernel), 168 registers at launch as the
    16-bit one; the loader's nine boxes of codes (UTMALDG.3D) widened to fp16
    pairs; S's wgmma not serialized beyond the wait for its ckv part."""
    set_cache_env(monkeypatch, tmp_path / "cache")
    spec = mla_spec("bfloat16", causal=True, backend="fa3", dtype_kv="float8_e4m3fn")
    (result,) = jit.build_many([spec], arches=("sm_90a",))
    _no_spills(result, "fa3_mla_kernel", ("sm_90a",))
    assert [u["registers"] for u in result.entry.manifest["resources"] if "fa3_mla" in u["kernel"]] == [168]
    kernels = {name: [ins for _, ins in code] for name, code in functions(sass(result.entry.artifact)).items()}
    assert not any("fa3_mla_pairs_kernel" in name for name in kernels)
    code, = [body for name, body in kernels.items() if "fa3_mla_kernel" in name]
    assert sum("UTMALDG.3D" in ins for ins in code) == 9
    assert any("F2FP.F16.E4M3.UNPACK_B" in ins for ins in code)
    hgmma = [ins for ins in code if "HGMMA" in ins]
    waited = sum("gsb0" in ins for ins in hgmma)
    assert len(hgmma) >= 40 and waited <= 6, f"{waited} of {len(hgmma)} HGMMA wait for their own results"
