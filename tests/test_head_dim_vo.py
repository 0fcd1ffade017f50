"""head_dim_vo below head_dim_qk (DeepSeek-V2/V3's 192/128 prefill) without a
GPU: the configurations that validate and what the others say, the backend
choice (fa2: fa3 needs equal dims), the prewarm and numerics selectors, the
rendered fa2 and CUDA-core sources and the float64 reference. The ops:
tests/test_head_dim_vo_ops.py; on a GPU: tests/test_gpu_head_dims.py."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from flashjit import arch, cli, jit, kernels, render
from flashjit.numerics import runner
from flashjit.ops import _invariant
from flashjit.reference import attention_reference
from flashjit.selection import SelectionError, summary_lines
from flashjit.spec import QK_VO_HEAD_DIMS, QK_VO_OPS, KernelSpec, mla_spec

QK, VO = 192, 128
# (dtype, use_tensor_cores) of every path: tensor cores take fp16 and bf16.
PATHS = [("float16", False), ("bfloat16", False), ("float32", False), ("float16", True), ("bfloat16", True)]
SUPPORTED = "head_dim_qk/head_dim_vo 192/128 for single_prefill and batch_prefill_ragged"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(arch, "_warned_fallbacks", set())
    monkeypatch.delenv("FLASHJIT_STRICT_BACKEND", raising=False)


def spec(op="batch_prefill_ragged", dtype="bfloat16", qk=QK, vo=VO, tc=True, **flags) -> KernelSpec:
    return KernelSpec.make(op, dtype, qk, head_dim_vo=vo, use_tensor_cores=tc, **flags)


def _error(s: KernelSpec) -> str:
    with pytest.raises(ValueError) as info:
        s.validate()
    return str(info.value)


# ---------------------------------------------------------------------------
# KernelSpec.validate


def test_the_pair_validates_for_both_prefill_ops_on_every_path():
    assert QK_VO_HEAD_DIMS == ((QK, VO),) and QK_VO_OPS == ("single_prefill", "batch_prefill_ragged")
    for op in QK_VO_OPS:
        for dtype, tc in PATHS:
            for flags in ({}, {"causal": True, "return_lse": True}, {"sliding_window": True, "soft_cap": True}):
                s = spec(op, dtype, tc=tc, **flags).validate()
                assert f"_qk{QK}_vo{VO}_fa2_{'tc' if tc else 'cc'}" in s.name


@pytest.mark.parametrize("op,nearest", [
    ("batch_prefill_paged", "batch_prefill_ragged_bf16_qk192_vo128_fa2_tc"),
    ("batch_decode_paged", "batch_decode_paged_bf16_d192_fa2_tc"),
    ("single_decode", "single_decode_bf16_d192_fa2_tc")])
def test_other_ops_name_the_ops_that_take_it(op, nearest):
    message = _error(spec(op))
    assert f"head_dim_qk=192 != head_dim_vo=128 for {op}. Supported: {SUPPORTED}" in message
    assert message.endswith(f"Nearest working choice: {nearest}")
    assert "Nearest working choice: append_paged_bf16_d192" in _error(spec("append_paged", tc=False))


def test_fa3_generates_the_pair():
    for op in QK_VO_OPS:
        assert spec(op, "float16", backend="fa3", causal=True).validate().name == f"{op}_f16_qk192_vo128_fa3_tc_causal"


@pytest.mark.parametrize("qk,vo,what", [(128, 192, "head_dim_vo=192 > head_dim_qk=128 is not generated"),
                                        (128, 64, "head_dim_qk=128, head_dim_vo=64 is not generated"),
                                        (256, 128, "head_dim_qk=256, head_dim_vo=128 is not generated")])
def test_other_pairs_are_not_generated(qk, vo, what):
    message = _error(spec(qk=qk, vo=vo))
    assert f"{what}. Supported: {SUPPORTED}" in message
    assert message.endswith(f"Nearest working choice: batch_prefill_ragged_bf16_d{qk}_fa2_tc")


def test_an_fp8_cache_and_fp32_tensor_cores_name_what_works():
    message = _error(spec(dtype_kv="float8_e4m3fn"))
    assert "an FP8 KV cache with head_dim_qk=192 != head_dim_vo=128 is not yet generated" in message
    assert message.endswith("Nearest working choice: batch_prefill_ragged_bf16_qk192_vo128_fa2_tc")
    assert _error(spec(dtype="float32")).endswith("Nearest working choice: batch_prefill_ragged_f32_qk192_vo128_fa2_cc")


def test_mla_keeps_its_own_geometry():
    for backend in ("fa2", "fa3"):
        assert mla_spec("bfloat16", backend=backend).validate().name.startswith("mla_paged_bf16_qk576_vo512")
    assert "mla_paged: head_dim_qk=576" in _error(spec("mla_paged"))


# ---------------------------------------------------------------------------
# Backend choice


def test_auto_picks_fa3_on_sm90a_and_fa2_elsewhere():
    for op in QK_VO_OPS:
        assert arch.choose_backend(op, "bfloat16", None, "auto", targets=("sm_90a",), head_dim=QK,
                                   head_dim_vo=VO)[:2] == ("fa3", True)
    assert "fa3 needs wgmma" in arch.choose_backend("single_prefill", "bfloat16", None, "auto", targets=("sm_80",),
                                                    head_dim=QK, head_dim_vo=VO)[2]


def test_explicit_fa3_on_another_pair_warns_and_runs_fa2_or_raises_when_strict():
    with pytest.warns(UserWarning, match=r"backend='fa3' requested for batch_prefill_ragged, but fa3 does not "
                                         r"generate head_dim_qk=256 with head_dim_vo=128: running fa2"):
        assert arch.choose_backend("batch_prefill_ragged", "float16", True, "fa3", targets=("sm_90a",),
                                   head_dim=256, head_dim_vo=VO)[0] == "fa2"
    with pytest.raises(ValueError, match=r"^backend='fa3' cannot run here: fa3 does not generate head_dim_qk=256 "
                                         r"with head_dim_vo=128"):
        arch.choose_backend("single_prefill", "float16", True, "fa3", targets=("sm_90a",), head_dim=256,
                            head_dim_vo=VO, strict=True)
    assert arch.choose_backend("single_prefill", "float16", True, "fa3", targets=("sm_90a",), head_dim=QK,
                               head_dim_vo=VO, strict=True)[0] == "fa3"


def test_the_ops_pick_fa3_on_sm90a(monkeypatch, caplog):
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(arch, "device_arch", lambda: None)
    from flashjit.ops.prefill import plan_spec

    with caplog.at_level(logging.INFO, logger="flashjit"):
        s, _, _ = plan_spec("batch_prefill_ragged", "auto", 8, 2, QK, VO, causal=True, q_data_type=torch.float16)
    assert s.name == "batch_prefill_ragged_f16_qk192_vo128_fa3_tc_causal_lse"
    assert any("; fa3 (sm_90a" in r.getMessage() for r in caplog.records)
    # Batch-invariant mode's kernels for a library that also targets sm_80: fa2's and fa3's.
    invariant = _invariant.prewarm_specs([s.replace(backend="fa2")], ("sm_80", "sm_90a"))
    assert {x.name for x in invariant} == {s.replace(backend="fa2").name, s.name}


# ---------------------------------------------------------------------------
# Prewarm and numerics selectors


def _selected(*flags, command="prewarm", arches=("sm_80", "sm_90a")):
    args = cli.build_parser().parse_args([command, *flags] + (["--arch", *arches] if command == "prewarm" else []))
    cli.check_selectors(args)
    return cli.specs_from_args(args, arches)


def test_head_dim_vo_selects_the_pair():
    names = {s.name for s in _selected("--op", "single_prefill", "batch_prefill_ragged", "--dtype", "bf16", "fp32",
                                       "--head-dim", "192", "--head-dim-vo", "128", "--causal", "on")}
    assert names == {"single_prefill_bf16_qk192_vo128_fa2_tc_causal", "single_prefill_bf16_qk192_vo128_fa3_tc_causal",
                     "single_prefill_f32_qk192_vo128_fa2_cc_causal",
                     "batch_prefill_ragged_bf16_qk192_vo128_fa2_tc_causal_lse",
                     "batch_prefill_ragged_bf16_qk192_vo128_fa3_tc_causal_lse",
                     "batch_prefill_ragged_f32_qk192_vo128_fa2_cc_causal_lse"}
    specs = _selected("--op", "batch_prefill_ragged", "--dtype", "bf16", "--head-dim", "128", "192", "--head-dim-vo",
                      "128", "--causal", "on")
    assert {s.name for s in specs} == {f"batch_prefill_ragged_bf16_{d}_tc_causal_lse"
                                       for d in ("d128_fa2", "d128_fa3", "qk192_vo128_fa2", "qk192_vo128_fa3")}
    assert "  head_dims  128, 192/128" in summary_lines(specs, ("sm_80", "sm_90a"), "--arch")
    numerics = _selected("--op", "batch_prefill_ragged", "--dtype", "bf16", "--head-dim", "192", "--head-dim-vo",
                         "128", command="numerics", arches=("sm_90a",))
    assert {s.name for s in numerics} == {"batch_prefill_ragged_bf16_qk192_vo128_fa3_tc_causal_lse",
                                          "batch_prefill_ragged_bf16_qk192_vo128_fa3_tc_lse"}


@pytest.mark.parametrize("flags,match", [
    (["--head-dim", "64", "--head-dim-vo", "128"], r"^--head-dim-vo: 128 with --head-dim 64 is not generated; choose "
                                                   r"64 \(pairs: 192/128"),
    (["--head-dim-vo", "128"], r"^--head-dim-vo: give --head-dim too"),
    (["--head-dim", "192", "--head-dim-vo", "x"], r"^--head-dim-vo: x is not a number"),
    (["--head-dim", "96", "192", "--head-dim-vo", "128"], r"^--head-dim 96: no --head-dim-vo value is generated"),
    (["--op", "batch_prefill_paged", "--head-dim", "192", "--head-dim-vo", "128"],
     r"^the selection is empty: --head-dim-vo 128: batch_prefill_paged takes V as wide as Q and K \(--head-dim 192\); "
     r"single_prefill and batch_prefill_ragged take 192/128$"),
    (["--kv-dtype", "e4m3", "--head-dim", "192", "--head-dim-vo", "128"],
     r"^the selection is empty: --head-dim-vo 128: an FP8 KV cache \(--kv-dtype\) takes V as wide as Q and K$"),
], ids=["no-pair", "no-head-dim", "not-a-number", "unpaired-head-dim", "paged", "fp8"])
def test_bad_combinations_name_the_flag(flags, match):
    op = [] if "--op" in flags else ["--op", "batch_prefill_ragged"]
    with pytest.raises(SelectionError, match=match):
        _selected(*op, "--dtype", "bf16", *flags)


def test_strict_fa3_selects_the_pair(monkeypatch):
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", "1")
    specs = _selected("--op", "batch_prefill_ragged", "--dtype", "bf16", "--head-dim", "192", "--head-dim-vo", "128",
                      "--backend", "fa3", arches=("sm_90a",))
    assert {s.name for s in specs} == {"batch_prefill_ragged_bf16_qk192_vo128_fa3_tc_causal_lse",
                                       "batch_prefill_ragged_bf16_qk192_vo128_fa3_tc_lse"}


def test_the_prewarm_command_of_a_miss_selects_the_pair():
    import shlex

    s = spec(causal=True, return_lse=True)
    argv = shlex.split(jit.prewarm_command(s, ("sm_90a",)))[1:]
    assert argv[argv.index("--head-dim-vo") + 1] == "128"
    args = cli.build_parser().parse_args(argv)
    cli.check_selectors(args)
    assert cli.specs_from_args(args, ("sm_90a",)) == [s]
    assert "--head-dim-vo" not in jit.prewarm_command(mla_spec("bfloat16"), ("sm_90a",))


def test_numerics_skips_an_fp8_cache_beside_the_pair():
    from flashjit.numerics import fp8_left_out

    flags = ["--op", "batch_prefill_ragged", "--dtype", "bf16", "--kv-dtype", "e4m3", "--head-dim", "128", "192",
             "--head-dim-vo", "128", "--causal", "on"]
    args = cli.build_parser().parse_args(["numerics", *flags])
    cli.check_selectors(args)
    selected = cli.specs_from_args(args, ("sm_80",))
    assert [s.name for s in selected] == ["batch_prefill_ragged_bf16_kve4m3_d128_fa2_tc_causal_lse"]
    (row,) = fp8_left_out(args, ("sm_80",), selected)
    assert (row["config"], row["status"], row["head_dim_vo"]) == (
        "batch_prefill_ragged_bf16_kve4m3_qk192_vo128_fa2_tc_causal_lse", "skipped", VO)
    assert row["reason"] == "an FP8 KV cache with head_dim_qk=192 != head_dim_vo=128 is not yet generated"


def test_numerics_problems_draw_v_of_its_width():
    s = spec("single_prefill", causal=True, return_lse=True)
    (p,) = runner.problems(s, "normal", torch.Generator().manual_seed(0), device="cpu")
    assert (p.q.shape[-1], p.k.shape[-1], p.v.shape[-1]) == (QK, QK, VO)
    (p,) = runner.problems(spec(), "normal", torch.Generator().manual_seed(0), device="cpu")
    assert p.v.shape[1:] == (2, VO) and p.k.shape[1:] == (2, QK)


# ---------------------------------------------------------------------------
# Rendered sources


@pytest.mark.parametrize("op", QK_VO_OPS)
def test_fa2_and_cuda_core_sources_take_both_widths(op):
    for dtype, tc in (("bfloat16", True), ("float16", True), ("float32", False), ("bfloat16", False)):
        s = spec(op, dtype, tc=tc, causal=True, return_lse=True).validate()
        for arches in (None, ("sm_90a",)):
            text = render.render(s, arches).text
            family, tiling = kernels.tiling_for(s, arches)
            if tc:
                assert (re.findall(r"/\*kHeadDim=\*/\s*(\d+)", text), re.findall(r"/\*kHeadDimVo=\*/\s*(\d+)", text)) \
                    == (["192"], ["128"]), s.name
                assert not tiling.tma_kv and not tiling.split_keys  # the kernels that keep the widths equal
            else:
                assert (re.findall(r"/\*kHeadDimQK=\*/\s*(\d+)", text),
                        re.findall(r"/\*kHeadDimVO=\*/\s*(\d+)", text)) == (["192"], ["128"]), s.name
            assert tiling.smem_bytes(s) <= kernels.common.SMEM_BUDGET, (s.name, family)


@pytest.mark.parametrize("op", QK_VO_OPS)
def test_fa3_sources_take_both_widths(op):
    """Fa3Traits' kHeadDim 192 and kHeadDimVo 128, and the shared memory the
    tiling counts: K rows 384 bytes, V rows 256 (Fa3Traits::kSmemBytes)."""
    for dtype in ("bfloat16", "float16"):
        s = spec(op, dtype, backend="fa3", causal=True, return_lse=True).validate()
        text = render.render(s, ("sm_90a",)).text
        assert (re.findall(r"/\*kHeadDim=\*/\s*(\d+)", text), re.findall(r"/\*kHeadDimVo=\*/\s*(\d+)", text)) \
            == (["192"], ["128"]), s.name
        template, tiling = kernels.tiling_for(s, ("sm_90a",))
        assert template == kernels.fa3.TEMPLATE and tiling.smem_bytes(s) == \
            1024 + tiling.stages * tiling.keys_per_tile * (384 + 256) + 128 * 384 + 32 * tiling.stages
        assert tiling.smem_bytes(s) < tiling.smem_bytes(s.replace(head_dim_vo=192))


# ---------------------------------------------------------------------------
# The float64 reference


def test_reference_output_takes_v_width():
    """Each output column is its own weighted sum: V's first 128 columns give
    the first 128 of a 192-wide V's output (to float64 rounding)."""
    q, k, v = torch.randn(9, 4, QK), torch.randn(30, 2, QK), torch.randn(30, 2, QK)
    full, lse = attention_reference(q, k, v, causal=True)
    narrow, narrow_lse = attention_reference(q, k, v[..., :VO].contiguous(), causal=True)
    assert narrow.shape == (9, 4, VO) and torch.equal(narrow_lse, lse)
    torch.testing.assert_close(narrow, full[..., :VO], rtol=1e-12, atol=1e-12)
