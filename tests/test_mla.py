"""MLA (mla_paged) without a GPU: its configuration and validation, the rendered
source of each backend, plan()'s argument checks, the backend choice and fa3
fallback, its tolerance profile, and builds: fa2 for sm_80 / sm_89 (0 spills,
no wgmma in the SASS), fa3 for sm_90a (0 spills, wgmma not serialized)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import flashjit
from flashjit import arch, jit
from flashjit.error_model import mla_tolerance, profile
from flashjit.kernels import common, fa2, fa3, tiling_for
from flashjit.render import render
from flashjit.spec import KernelSpec, mla_spec
import helpers_cache
from helpers_cache import needs_nvcc, set_cache_env
from helpers_sass import functions, sass
from test_bad_input_wrappers import _on_fake_cuda, _workspace

# A fixture: pytest looks fixtures up by name in the test module.
no_compile = helpers_cache.no_compile

SM_SCALE = 1 / math.sqrt(192)


# ---------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_mla_spec_validates_renders_and_fits_the_smem_budget(dtype, causal):
    spec = mla_spec(dtype, causal=causal).validate()
    assert spec.name == f"mla_paged_{'f16' if dtype == 'float16' else 'bf16'}_qk576_vo512_fa2_tc" + \
        ("_causal" if causal else "") + "_lse"
    template, tiling = tiling_for(spec)
    assert template == fa2.MLA_TEMPLATE and tiling.rows_per_cta == 16
    assert tiling.smem_bytes(spec) <= common.SMEM_BUDGET
    text = render(spec).text
    assert "flashjit::MlaTraits<" in text and "flashjit/fa2/fa2_mla.cuh" in text
    assert f"/*kKeysPerTile=*/{tiling.keys_per_tile}" in text and f"/*kCausal=*/{str(causal).lower()}" in text


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_mla_spec_renders_its_own_template_and_fits_sm90(causal):
    spec = mla_spec("bfloat16", causal=causal, backend="fa3").validate()
    assert spec.name == "mla_paged_bf16_qk576_vo512_fa3_tc" + ("_causal" if causal else "") + "_lse"
    template, tiling = tiling_for(spec)
    assert template == fa3.MLA_TEMPLATE and (tiling.rows_per_cta, tiling.keys_per_tile) == (64, 64)
    assert tiling.smem_bytes(spec) + common.SMEM_RESERVED_PER_CTA <= common.SMEM_PER_SM["sm_90a"]
    text = render(spec).text
    assert "flashjit::Fa3MlaTraits<" in text and "flashjit/fa3/fa3_mla.cuh" in text
    assert f"/*kCausal=*/{str(causal).lower()}" in text
    assert profile(spec)["keys_per_rescale"] == 64


@pytest.mark.parametrize("change,what", [
    ({"head_dim_qk": 128, "head_dim_vo": 128}, "head_dim_qk=128"),
    ({"head_dim_vo": 576}, "head_dim_vo=576"),
    ({"dtype_q": "float32", "dtype_kv": "float32", "dtype_o": "float32"}, "float32"),
    ({"use_tensor_cores": False}, "on CUDA cores"),
    ({"sliding_window": True}, "sliding window"),
    ({"soft_cap": True}, "soft-cap"),
])
def test_unsupported_mla_configurations_name_the_supported_set(change, what):
    spec = mla_spec("bfloat16").replace(**change)
    with pytest.raises(ValueError) as info:
        spec.validate()
    message = str(info.value)
    assert what in message and "head_dim_qk=576" in message and "ckv 512 + kpe 64" in message
    nearest = message.rsplit("Nearest working choice: ", 1)[1]
    assert nearest in {mla_spec(d, causal=spec.causal).name for d in ("float16", "bfloat16")}


def test_mla_is_available_and_public():
    assert "mla_paged" in flashjit.spec.OPS and "mla_paged" not in flashjit.spec.PLANNED_OPS
    assert "BatchMLAPagedAttentionWrapper" in dir(flashjit)


# ---------------------------------------------------------------------------
# Backend choice


def test_auto_runs_fa3_on_sm90a_and_fa2_elsewhere(monkeypatch):
    """The seed's failure: an fa3 MLA kernel picked on an SM89 GPU. auto picks
    fa3 only where every target is sm_90a; an explicit fa3 elsewhere runs fa2
    with a one-time warning, or raises under strict."""
    monkeypatch.setattr(arch, "_warned_fallbacks", set())
    assert arch.choose_backend("mla_paged", "bfloat16", None, "auto", targets=("sm_90a",))[:2] == ("fa3", True)
    assert arch.choose_backend("mla_paged", "bfloat16", None, "fa3", targets=("sm_90a",))[:2] == ("fa3", True)
    for targets in (("sm_89",), ("sm_80",), ("sm_80", "sm_90a")):
        assert arch.choose_backend("mla_paged", "float16", None, "auto", targets=targets)[:2] == ("fa2", True)
    with pytest.warns(UserWarning, match=r"fa3 needs wgmma \(sm_90a"):
        assert arch.choose_backend("mla_paged", "float16", None, "fa3", targets=("sm_89",))[0] == "fa2"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per (op, targets)
        arch.choose_backend("mla_paged", "float16", None, "fa3", targets=("sm_89",))
    with pytest.raises(ValueError, match="backend='fa3' cannot run here: fa3 needs wgmma"):
        arch.choose_backend("mla_paged", "bfloat16", None, "fa3", targets=("sm_89",), strict=True)
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", "1")
    with pytest.raises(ValueError, match="fa3 needs wgmma"):
        arch.choose_backend("mla_paged", "bfloat16", None, "fa3", targets=("sm_89",))


# ---------------------------------------------------------------------------
# plan() checks (a CPU workspace that claims to be on cuda:0; nothing is compiled)


def _i32(values) -> torch.Tensor:
    return _on_fake_cuda(torch.tensor(values, dtype=torch.int32))


def _plan_args(**changes) -> dict:
    # Two requests: 3 pages of 16 holding 40 keys, 1 page holding 16.
    args = dict(qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32), kv_indptr=torch.tensor([0, 3, 4], dtype=torch.int32),
                kv_indices=_i32([5, 0, 2, 7]), kv_len_arr=torch.tensor([40, 16], dtype=torch.int32), num_heads=16,
                head_dim_ckv=512, head_dim_kpe=64, page_size=16, causal=False, sm_scale=SM_SCALE,
                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    args.update(changes)
    return args


@pytest.mark.usefixtures("no_compile")
@pytest.mark.parametrize("changes,exc,match", [
    ({"head_dim_ckv": 256}, ValueError, r"^head_dim_ckv / head_dim_kpe: expected 512 / 64 .* got 256 / 64"),
    ({"head_dim_kpe": 128}, ValueError, r"^head_dim_ckv / head_dim_kpe: expected 512 / 64"),
    ({"num_heads": 0}, ValueError, r"^num_heads: expected a positive int"),
    ({"page_size": 0}, ValueError, r"^page_size: expected a positive int"),
    ({"q_data_type": torch.float32, "kv_data_type": torch.float32}, ValueError,
     r"^q_data_type: MLA runs on tensor cores in float16 or bfloat16, got torch.float32"),
    ({"kv_data_type": torch.float16}, ValueError, r"^kv_data_type: expected torch.bfloat16"),
    ({"q_data_type": torch.int8}, ValueError, r"^q_data_type: expected float16, bfloat16 or float32"),
    ({"sm_scale": -1.0}, ValueError, r"^sm_scale: expected a finite positive number"),
    ({"kv_indptr": torch.tensor([0, 3], dtype=torch.int32)}, ValueError, r"^kv_indptr: expected 3 elements"),
    ({"kv_indptr": torch.tensor([0, 3, 2], dtype=torch.int32)}, ValueError, r"^kv_indptr: expected non-decreasing"),
    ({"kv_len_arr": torch.tensor([40], dtype=torch.int32)}, ValueError, r"^kv_len_arr: expected 2 elements"),
    ({"kv_len_arr": torch.tensor([40, 16], dtype=torch.int64)}, ValueError, r"^kv_len_arr: expected a 1-D int32"),
    ({"kv_len_arr": torch.tensor([49, 16], dtype=torch.int32)}, ValueError,
     r"^kv_len_arr: request 0 has 3 pages of 16 \(kv_indptr\), which hold 33..48 keys, got 49"),
    ({"kv_len_arr": torch.tensor([40, 17], dtype=torch.int32)}, ValueError, r"^kv_len_arr: request 1 has 1 pages"),
    # Extra trailing pages: FlashInfer 0.7.2 refuses them as well.
    ({"kv_len_arr": torch.tensor([32, 16], dtype=torch.int32)}, ValueError,
     r"^kv_len_arr: request 0 has 3 pages of 16 \(kv_indptr\), which hold 33..48 keys, got 32"),
    ({"kv_len_arr": torch.tensor([40, 0], dtype=torch.int32)}, ValueError,
     r"^kv_len_arr: request 1 has 1 pages of 16 \(kv_indptr\), which hold 1..16 keys, got 0"),
    ({"kv_indices": _i32([5, 0, 2])}, ValueError, r"^kv_indices: expected at least 4 elements"),
    ({"kv_indices": _i32([5, -1, 2, 7])}, ValueError, r"^kv_indices: expected page ids >= 0, got -1"),
    ({"kv_indices": torch.tensor([5, 0, 2, 7], dtype=torch.int32)}, ValueError, r"^kv_indices: expected a tensor on cuda:0"),
    ({"use_profiler": True}, NotImplementedError, r"^use_profiler=True"),
])
def test_plan_rejects_bad_arguments_naming_them(changes, exc, match):
    wrapper = flashjit.BatchMLAPagedAttentionWrapper(_workspace())
    with pytest.raises(exc, match=match):
        wrapper.plan(**_plan_args(**changes))


@pytest.mark.usefixtures("no_compile")
def test_run_before_plan_and_unsupported_run_options():
    wrapper = flashjit.BatchMLAPagedAttentionWrapper(_workspace())
    with pytest.raises(RuntimeError, match="before plan"):
        wrapper.run(None, None, None, None)
    with pytest.raises(NotImplementedError, match="^profiler_buffer"):
        wrapper.run(None, None, None, None, profiler_buffer=torch.empty(1))
    with pytest.raises(NotImplementedError, match="^return_lse_base_on_e"):
        wrapper.run(None, None, None, None, return_lse_base_on_e=True)


# ---------------------------------------------------------------------------
# Tolerance


def test_mla_profile_uses_its_576_wide_qk():
    spec = mla_spec("bfloat16")
    prof, d128 = profile(spec), profile(KernelSpec.make("batch_decode_paged", "bfloat16", 128, use_tensor_cores=True))
    assert prof["head_dim_qk"] == 576 and prof["p_rounding"] == 2.0**-8
    # lambda sqrt(D) + 3: 51 for D = 576 against 25.6 for 128.
    assert prof["logit_per_s"] / d128["logit_per_s"] == pytest.approx((2 * 24 + 3) / (2 * math.sqrt(128) + 3))
    assert prof["keys_per_rescale"] == fa2.MLA_TILING.keys_per_tile and prof["merge_rescales"] == 0


@pytest.mark.parametrize("dtype,low,high", [("bfloat16", 1.5e-2, 2.6e-2), ("float16", 2.0e-3, 5.0e-3)])
def test_mla_atol_at_unit_normal_inputs(dtype, low, high):
    """docs/numerics.md (MLA): u_in * max|ckv| dominates; bf16 comes out near 2e-2."""
    gen = torch.Generator().manual_seed(0)
    kv_len, heads = 4096, 16
    q_nope, q_pe = torch.randn(1, heads, 512, generator=gen), torch.randn(1, heads, 64, generator=gen)
    ckv, kpe = torch.randn(kv_len, 512, generator=gen), torch.randn(kv_len, 64, generator=gen)
    tol = mla_tolerance(dtype, kv_len=kv_len, q_nope=q_nope, q_pe=q_pe, ckv=ckv, kpe=kpe, sm_scale=SM_SCALE)
    assert low <= tol.atol <= high
    u = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    vmax = float(ckv.abs().max())
    subnormal = kv_len * 2.0**-25 * vmax if dtype == "float16" else 0.0  # weights below fp16's normal range
    # The P rounding term, plus at most 70% for the rest.
    assert u * vmax + subnormal <= tol.atol <= 1.7 * u * vmax + subnormal
    assert tol.rtol == pytest.approx(u + 4 * 2.0**-24)


# ---------------------------------------------------------------------------
# Build


@pytest.mark.nvcc
@needs_nvcc
def test_mla_builds_for_sm80_and_sm89_without_spills_or_wgmma(monkeypatch, tmp_path):
    set_cache_env(monkeypatch, tmp_path / "cache")
    specs = [mla_spec("bfloat16", causal=True), mla_spec("float16")]
    results = jit.build_many(specs, arches=("sm_80", "sm_89"))
    for spec, result in zip(specs, results):
        assert result.entry is not None, spec.name
        usage = result.entry.manifest["resources"]
        mla = [u for u in usage if "fa2_mla_kernel" in u["kernel"]]
        assert sorted(u["arch"] for u in mla) == ["sm_80", "sm_89"]
        for u in usage:
            assert 0 < u["registers"] <= 255 and u["spill_stores"] == 0 and u["spill_loads"] == 0, (spec.name, u)
    text = sass(results[0].entry.artifact)
    assert "sm_89" in text and "HMMA.16816.F32.BF16" in text and "GMMA" not in text


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("key_groups, early_release, tma, pairs", [(1, False, False, False), (3, False, False, False),
                                                                     (3, True, False, False), (3, True, True, False),
                                                                     (1, False, True, False), (3, True, True, True)])
def test_fa3_mla_builds_for_sm90a_without_spills_or_serialized_wgmma(monkeypatch, tmp_path, key_groups,
                                                                     early_release, tma, pairs):
    """S by 64x64 wgmma, P.V by 64x256 with V transposed; a wgmma whose
    accumulators ptxas cannot track gets a wait of its own (C7515): every
    HGMMA would then carry gsb0. Here only the last of each group does. With
    key groups, S's k-steps wait for each group at a named barrier between
    its HGMMA, which leaves them unserialized too; with early release the
    softmax consumer waits for its P.V alone (one group still in flight)
    before it gives the slot back; with TMA the loader also issues a tile's
    nine boxes (UTMALDG). Both kernels copy their output rows out of shared
    memory by bulk copies (UBLKCP). With pairs, the module also holds the pairs
    kernel (fa3_mla_pairs.cuh): each 64-column block of S a group of four
    k-steps behind an mbarrier wait, its own P.V with P from registers."""
    set_cache_env(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(fa3, "MLA_TILING", dataclasses.replace(fa3.MLA_TILING, key_groups=key_groups,
                                                               early_release=early_release, tma=tma, pairs=pairs))
    spec = mla_spec("bfloat16", causal=True, backend="fa3")
    result, = jit.build_many([spec], arches=("sm_90a",))
    assert result.entry is not None
    for u in result.entry.manifest["resources"]:
        assert u["spill_stores"] == 0 and u["spill_loads"] == 0, u
        if "fa3_mla" in u["kernel"]:
            # setmaxnreg moves registers within the CTA's pool from launch: 3 x 168 holds
            # the loader's 56 and 2 x 224, or the producer's 24 and 2 x 240; with fewer
            # at launch the increase would wait forever.
            assert u["registers"] == 168, u
    kernels = {name: "\n".join(ins for _, ins in code) for name, code in functions(sass(result.entry.artifact)).items()}
    text, = [body for name, body in kernels.items() if "fa3_mla_kernel" in name]
    hgmma = [line for line in text.splitlines() if "HGMMA" in line]
    assert any("HGMMA.64x64x16.F32.BF16" in line for line in hgmma)
    assert any("HGMMA.64x256x16.F32.BF16" in line and "tnspB" in line for line in hgmma)
    waited = sum("gsb0" in line for line in hgmma)
    assert len(hgmma) >= 40 and waited <= 4, f"{waited} of {len(hgmma)} HGMMA wait for their own results"
    # Named-barrier waits inside an S (between its first 64x64 HGMMA and its last):
    # key_groups - 1 of them in each of the kernel's S sequences.
    inside, in_s = 0, False
    for line in text.splitlines():
        if "HGMMA.64x64x16" in line:
            in_s = "gsb0" not in line
        elif in_s and "BAR.SYNC" in line:
            inside += 1
    assert inside == 2 * (key_groups - 1), inside
    assert ("WARPGROUP.DEPBAR.LE gsb0, 0x1" in text) == early_release
    assert text.count("UTMALDG") == (9 if tma else 0)
    # The output rows leave by bulk copies from shared memory (fa3_mla_store.cuh).
    assert "UBLKCP.G.S" in text
    pair_kernels = [body for name, body in kernels.items() if "fa3_mla_pairs_kernel" in name]
    assert len(pair_kernels) == pairs
    for text in pair_kernels:
        hgmma = [line for line in text.splitlines() if "HGMMA" in line]
        s_steps = [line for line in hgmma if "HGMMA.64x64x16.F32.BF16" in line]
        assert any("HGMMA.64x256x16.F32.BF16 R" in line and ", R" in line.split("gdesc")[0] and "tnspB" in line
                   for line in hgmma), "own P.V with P from registers"
        assert any("HGMMA.64x256x16.F32.BF16" in line and "gdesc" in line.split(",")[1] for line in hgmma)
        waited = sum("gsb0" in line for line in hgmma)
        # One commit group of four k-steps per 64-column block of S, one per P.V: no HGMMA alone.
        assert len(s_steps) % 4 == 0 and waited * 4 <= len(hgmma), f"{waited} of {len(hgmma)} HGMMA carry gsb0"
        assert "UTMALDG" in text
        assert "UBLKCP.G.S" in text


@pytest.mark.usefixtures("no_compile")
def test_plan_selects_the_mla_configuration(monkeypatch):
    """plan() resolves the one MLA configuration (Q.K^T 576 wide, V 512) and hands it to the batch planner."""
    from flashjit.ops import _batch

    seen = []
    monkeypatch.setattr(_batch.BatchAttention, "_plan_batch", lambda self, spec, *a, **kw: seen.append((spec, kw)))
    wrapper = flashjit.BatchMLAPagedAttentionWrapper(_workspace())
    wrapper.plan(**_plan_args(causal=True))
    (spec, kw), = seen
    assert spec == mla_spec("bfloat16", causal=True)
    assert (spec.head_dim_qk, spec.head_dim_vo, kw["num_kv_heads"], kw["page_size"]) == (576, 512, 1, 16)


def test_prewarm_default_preset_builds_fa3_mla_for_sm90a_and_op_mla_paged_anywhere():
    from flashjit import cli

    def mla(argv):
        return sorted((s.backend, s.dtype_q, s.causal) for s in cli.specs_from_args(cli.build_parser().parse_args(argv))
                      if s.op == "mla_paged")

    default = ["prewarm", "--preset", "default", "--arch"]
    assert mla([*default, "sm_90a"]) == [("fa3", "bfloat16", c) for c in (False, True)]
    assert mla([*default, "sm_80", "sm_90a"]) == sorted(
        (b, "bfloat16", c) for b in ("fa2", "fa3") for c in (False, True))
    assert mla([*default, "sm_80", "sm_89"]) == []
    full = ["prewarm", "--preset", "full", "--arch"]
    assert mla([*full, "sm_90a"]) == [("fa3", d, c) for d in ("bfloat16", "float16") for c in (False, True)]
    assert mla(["prewarm", "--op", "mla_paged", "--arch", "sm_89"]) == [("fa2", "bfloat16", c) for c in (False, True)]
    assert mla(["prewarm", "--op", "mla_paged", "--dtype", "fp16", "bf16", "--arch", "sm_89"]) == [
        ("fa2", d, c) for d in ("bfloat16", "float16") for c in (False, True)]
