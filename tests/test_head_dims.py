"""Head dims 32 to 256 in steps of 16 without a GPU: the nearest generated
dims named for one that is not, fa3's own head dims (64, 96, 128, 192, 256) with
every other one falling back to fa2, the prewarm selection, the op-level
checks, rendered fa2 sources, and the error model at head dims 32 and 512.
The GPU sweep of the new dims is tests/test_gpu_head_dims.py; head_dim_vo below
head_dim (192/128) is tests/test_head_dim_vo.py; head dim 512, generated for
decode and paged prefill alone, tests/test_head_dims_512.py."""

from __future__ import annotations

import logging
import math
import re
from unittest import mock

import pytest
import torch

import flashjit
from flashjit import arch, cli, error_model, kernels, render, spec as spec_module
from flashjit.error_model import U32, evaluate, profile
from flashjit.ops import _checks, _launch
from flashjit.ops.prefill import plan_spec
from flashjit.reference import attention_reference
from flashjit.selection import SelectionError
from flashjit.spec import (ATTENTION_OPS, FA3_AUTO_HEAD_DIMS, FA3_HEAD_DIMS, FA3_OPS, HEAD_DIMS, KernelSpec,
                           head_dims_text, nearest_head_dim, nearest_head_dims)
from test_tolerance_reference import emulate_kernel, make_inputs, one_thread  # noqa: F401 (fixture)

FA3_TEXT = ", ".join(map(str, FA3_HEAD_DIMS))  # as the messages list them
NEW_HEAD_DIMS = [d for d in HEAD_DIMS if d not in FA3_HEAD_DIMS]
PREFILL_OPS = [op for op in FA3_OPS if op in ATTENTION_OPS]
# (dtype, use_tensor_cores) of every path: tensor cores take fp16 and bf16.
PATHS = [("float16", False), ("bfloat16", False), ("float32", False), ("float16", True), ("bfloat16", True)]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(arch, "_warned_fallbacks", set())
    monkeypatch.delenv("FLASHJIT_STRICT_BACKEND", raising=False)


# ---------------------------------------------------------------------------
# The generated set and its nearest members


def test_head_dims_are_every_multiple_of_16_from_32_to_256():
    assert HEAD_DIMS == tuple(range(32, 257, 16)) and set(FA3_HEAD_DIMS) < set(HEAD_DIMS)
    assert head_dims_text() == "a multiple of 16 from 32 to 256"
    assert head_dims_text((64, 128, 256)) == "64, 128 or 256"


@pytest.mark.parametrize("value,between,closest", [
    (100, (96, 112), 96), (104, (96, 112), 96), (108, (96, 112), 112), (90, (80, 96), 96), (33, (32, 48), 32),
    (8, (32,), 32), (0, (32,), 32), (257, (256,), 256), (512, (256,), 256), (576, (256,), 256)])
def test_nearest_head_dims_are_the_generated_neighbours(value, between, closest):
    assert nearest_head_dims(value) == between
    assert nearest_head_dim(value) == closest


# ---------------------------------------------------------------------------
# KernelSpec.validate


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_head_dim_validates_on_cuda_cores_and_fa2(head_dim):
    for op in ATTENTION_OPS:
        for dtype, tc in PATHS:
            KernelSpec.make(op, dtype, head_dim, use_tensor_cores=tc, return_lse=True).validate()
    KernelSpec.make("append_paged", "bfloat16", head_dim).validate()
    KernelSpec.make("batch_decode_paged", "bfloat16", head_dim, dtype_kv="float8_e4m3fn").validate()


@pytest.mark.parametrize("field", ["head_dim_qk", "head_dim_vo"])
def test_a_head_dim_not_generated_names_the_nearest(field):
    spec = KernelSpec.make("batch_prefill_ragged", "bfloat16", 96, use_tensor_cores=True).replace(**{field: 100})
    with pytest.raises(ValueError) as info:
        spec.validate()
    assert re.search(rf"{field}=100 is not generated \(nearest: 96 or 112\)\. Supported: head_dim a multiple of 16 "
                     rf"from 32 to 256; 512 for single_decode and batch_decode_paged \(CUDA or tensor cores\) and "
                     rf"batch_prefill_paged \(tensor cores, fa2\)\. Nearest working choice: "
                     rf"batch_prefill_ragged_bf16_d96_fa2_tc$", str(info.value))


@pytest.mark.parametrize("head_dim", NEW_HEAD_DIMS)
def test_fa3_takes_its_own_head_dims_and_names_fa2_for_the_others(head_dim):
    for op in PREFILL_OPS:
        spec = KernelSpec.make(op, "float16", head_dim, backend="fa3", use_tensor_cores=True, causal=True)
        with pytest.raises(ValueError) as info:
            spec.validate()
        message = str(info.value)
        assert f"backend fa3 with head_dim {head_dim}. Supported: fa3 for head dims {FA3_TEXT}; every head dim " \
               f"(a multiple of 16 from 32 to 256) on fa2" in message
        assert message.endswith(f"Nearest working choice: {spec.replace(backend='fa2').validate().name}")
    for d in FA3_HEAD_DIMS:
        KernelSpec.make("single_prefill", "float16", d, backend="fa3", use_tensor_cores=True).validate()


# ---------------------------------------------------------------------------
# Backend choice: fa3 where it generates the head dim, fa2 with the reason elsewhere


@pytest.mark.parametrize("head_dim", NEW_HEAD_DIMS)
@pytest.mark.parametrize("op", PREFILL_OPS)
def test_auto_falls_back_to_fa2_for_head_dims_fa3_lacks(op, head_dim):
    backend, tc, reason = arch.choose_backend(op, "bfloat16", None, "auto", targets=("sm_90a",), head_dim=head_dim)
    assert (backend, tc) == ("fa2", True)
    assert reason.endswith(f"; fa2 (mma.sync), as fa3 does not generate head_dim {head_dim} (it does {FA3_TEXT})")


def test_fa3_head_dims_and_mla_keep_fa3():
    for d in FA3_AUTO_HEAD_DIMS:
        assert arch.choose_backend("batch_prefill_paged", "bfloat16", None, "auto", targets=("sm_90a",),
                                   head_dim=d)[0] == "fa3"
    assert arch.choose_backend("mla_paged", "bfloat16", None, "auto", targets=("sm_90a",), head_dim=576)[0] == "fa3"
    # Without wgmma the arch is the reason, whatever the head dim.
    assert "fa3 needs wgmma" in arch.choose_backend("single_prefill", "bfloat16", None, "auto", targets=("sm_80",),
                                                    head_dim=96)[2]


@pytest.mark.parametrize("op", PREFILL_OPS)
def test_fa3_head_dims_auto_leaves_run_when_asked_for(op, monkeypatch):
    """A head dim fa3 generates but auto does not take yet (one left out of spec.FA3_AUTO_HEAD_DIMS until
    a same-run table has fa3 ahead of fa2: here 96, as it was) runs fa2, with the reason, and fa3 when
    backend="fa3" asks for it."""
    assert set(FA3_AUTO_HEAD_DIMS) <= set(FA3_HEAD_DIMS) and 96 in FA3_AUTO_HEAD_DIMS
    monkeypatch.setattr(spec_module, "FA3_AUTO_HEAD_DIMS", tuple(d for d in FA3_AUTO_HEAD_DIMS if d != 96))
    backend, tc, reason = arch.choose_backend(op, "bfloat16", None, "auto", targets=("sm_90a",), head_dim=96)
    assert (backend, tc) == ("fa2", True)
    assert reason.endswith("as fa3 at head_dim 96 is not yet measured ahead of fa2 (backend='fa3' runs it)")
    assert arch.choose_backend(op, "bfloat16", True, "fa3", targets=("sm_90a",), head_dim=96,
                               strict=True)[0] == "fa3"
    KernelSpec.make(op, "bfloat16", 96, backend="fa3", use_tensor_cores=True).validate()


def test_fa3_reads_no_fp8_cache_at_head_dim_96():
    """fa3's FP8 loader widens whole 64-column blocks: an FP8 cache at 96 runs fa2, with the reason."""
    spec = KernelSpec.make("batch_prefill_paged", "bfloat16", 96, dtype_kv="float8_e4m3fn", backend="fa3",
                           use_tensor_cores=True)
    with pytest.raises(ValueError, match="an FP8 KV cache at head_dim 96 on backend fa3 is not yet generated") as info:
        spec.validate()
    assert str(info.value).endswith(spec.replace(backend="fa2").validate().name)
    backend, _, reason = arch.choose_backend("batch_prefill_paged", "bfloat16", None, "auto", targets=("sm_90a",),
                                             kv_dtype="float8_e4m3fn", head_dim=96)
    assert backend == "fa2" and reason.endswith("fa3 reads an FP8 KV cache at head dims 64, 128, 192, 256 only")


def test_explicit_fa3_for_another_head_dim_warns_and_runs_fa2_or_raises_when_strict():
    with pytest.warns(UserWarning, match=r"backend='fa3' requested for single_prefill, but fa3 does not generate "
                                         rf"head_dim 80 \(it does {FA3_TEXT}\): running fa2"):
        backend, _, reason = arch.choose_backend("single_prefill", "float16", True, "fa3", targets=("sm_90a",),
                                                 head_dim=80)
    assert backend == "fa2" and "fa3 was requested but fa3 does not generate head_dim 80" in reason
    with pytest.raises(ValueError, match=r"^backend='fa3' cannot run here: fa3 does not generate head_dim 80"):
        arch.choose_backend("single_prefill", "float16", True, "fa3", targets=("sm_90a",), head_dim=80, strict=True)


def test_the_ops_log_the_fallback_reason_once(monkeypatch, caplog):
    """select_spec (every op's path to its kernel) hands choose_backend the head dim."""
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(arch, "device_arch", lambda: None)
    kw = dict(backend="auto", use_tensor_cores=None, causal=True, window=False, soft_cap=False, return_lse=True)
    with caplog.at_level(logging.INFO, logger="flashjit"):
        spec = _launch.select_spec("batch_prefill_ragged", torch.bfloat16, 112, **kw)
        again = _launch.select_spec("batch_prefill_ragged", torch.bfloat16, 112, **kw)
    assert spec == again and spec.name == "batch_prefill_ragged_bf16_d112_fa2_tc_causal_lse"
    lines = [r.getMessage() for r in caplog.records if "d112" in r.getMessage()]
    assert lines == ["flashjit: batch_prefill_ragged -> batch_prefill_ragged_bf16_d112_fa2_tc_causal_lse (bfloat16 "
                     "batch_prefill_ragged runs on tensor cores; fa2 (mma.sync), as fa3 does not generate head_dim "
                     f"112 (it does {FA3_TEXT}))"]
    assert _launch.select_spec("batch_prefill_ragged", torch.bfloat16, 128, **kw).backend == "fa3"
    spec, _, _ = plan_spec("batch_prefill_paged", "auto", 8, 2, 160, None, causal=True, q_data_type=torch.float16)
    assert (spec.head_dim_qk, spec.backend, spec.use_tensor_cores) == (160, "fa2", True)


# ---------------------------------------------------------------------------
# Prewarm selection and op-level checks


def _prewarm_names(*flags, arches=("sm_80", "sm_90a")):
    args = cli.build_parser().parse_args(["prewarm", *flags, "--arch", *arches])
    cli.check_selectors(args)
    return {s.name for s in cli.specs_from_args(args)}


def test_prewarm_builds_fa3_only_for_its_head_dims():
    names = _prewarm_names("--op", "batch_prefill_ragged", "--dtype", "bf16", "--causal", "on", "--head-dim", "80",
                           "96", "128")
    assert names == {f"batch_prefill_ragged_bf16_{name}_tc_causal_lse"
                     for name in ("d80_fa2", "d96_fa2", "d96_fa3", "d128_fa2", "d128_fa3")}


def test_prewarm_strict_fa3_for_another_head_dim_names_the_flag(monkeypatch):
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", "1")
    with pytest.raises(SelectionError, match=rf"^--backend fa3: fa3 does not generate head_dim 160 \(it does "
                                             rf"{FA3_TEXT}\); choose --backend fa2 or auto"):
        _prewarm_names("--op", "single_prefill", "--dtype", "fp16", "--head-dim", "160", "--backend", "fa3",
                       arches=("sm_90a",))


def test_op_level_head_dim_check_names_the_nearest():
    for d in HEAD_DIMS:
        _checks.check_head_dim("head_dim", d)
    with pytest.raises(ValueError, match=r"^head_dim_qk: expected a head_dim that is a multiple of 16 from 32 to 256, "
                                         r"got 136 \(nearest generated: 128 or 144\)$"):
        plan_spec("batch_prefill_ragged", "auto", 8, 2, 136, None, q_data_type=torch.bfloat16)


@pytest.mark.parametrize("head_dim", [48, 80, 240])
def test_single_ops_on_fake_tensors_at_new_head_dims(head_dim):
    """The torch.compile operators' fake implementations take every generated head dim."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v, q1 = (torch.empty(*shape, head_dim, dtype=torch.bfloat16, device="cuda")
                       for shape in ((7, 8), (40, 2), (40, 2), (8,)))
        o, lse = flashjit.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
        d = flashjit.single_decode_with_kv_cache(q1, k, v)
    assert (o.shape, lse.shape, d.shape) == ((7, 8, head_dim), (7, 8), (8, head_dim))


# ---------------------------------------------------------------------------
# Rendered sources and profiles


@pytest.mark.parametrize("head_dim", [32, 48, 80, 96, 112, 160, 192, 240])
def test_fa2_sources_render_with_the_head_dim(head_dim):
    for op in ATTENTION_OPS:
        spec = KernelSpec.make(op, "bfloat16", head_dim, use_tensor_cores=True, causal=op not in ("single_decode",
                               "batch_decode_paged"), return_lse=True).validate()
        for arches in (None, ("sm_90a",)):
            text = render.render(spec, arches).text
            assert re.findall(r"/\*kHeadDim=\*/\s*(\d+)", text) == [str(head_dim)], spec.name
            assert re.findall(r"/\*kHeadDimVo=\*/\s*(\d+)", text) == [str(head_dim)], spec.name
            assert kernels.tiling_for(spec, arches)[1].smem_bytes(spec) <= kernels.common.SMEM_BUDGET


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_every_configuration_has_a_finite_profile(head_dim):
    for op in ATTENTION_OPS:
        for dtype, tc in PATHS:
            tol = flashjit.tolerance(KernelSpec.make(op, dtype, head_dim, use_tensor_cores=tc), kv_len=4096,
                                     v_absmax=4.0)
            assert 0 < tol.rtol < 1e-2 and 0 < tol.atol < 0.1 and math.isfinite(tol.atol), (op, dtype, tc)


# ---------------------------------------------------------------------------
# The error model at head dims 32 and 512


def _profile(spec: KernelSpec) -> dict:
    """The profile of `spec`; at 512, where single prefill is not generated,
    that of the paged prefill 512 takes on tensor cores (fa2's column-split
    kernel), and on CUDA cores (which run no prefill at 512) the d256 tiling's
    rescale counts and chains taken for the spec's own head dim."""
    if spec.head_dim_qk in HEAD_DIMS:
        return profile(spec)
    if spec.use_tensor_cores:
        return profile(spec.replace(op="batch_prefill_paged").validate())
    stand_in = kernels.tiling_for(spec.replace(head_dim_qk=256, head_dim_vo=256))[1]
    with mock.patch.object(error_model, "tiling_for", lambda s, arches=None: ("stand-in", stand_in)):
        return profile(spec)


@pytest.mark.parametrize("use_tensor_cores", [False, True], ids=["cc", "tc"])
def test_model_terms_follow_the_head_dim_from_32_to_512(use_tensor_cores):
    """The logit term is 2 ln2 (lam sqrt(D) + 3) u per unit of S and the Q.K
    chain D long (CUDA-core prefill's worst case); at fixed magnitudes the
    bound grows with D, at most in proportion from 32 to 512 (CUDA cores), and
    by less than half where P's rounding dominates (tensor cores)."""
    atols = []
    for d in (32, 64, 128, 256, 512):
        prof = _profile(KernelSpec.make("single_prefill", "bfloat16", d, use_tensor_cores=use_tensor_cores))
        assert prof["logit_per_s"] == pytest.approx(2 * math.log(2) * (2 * math.sqrt(d) + 3) * U32, rel=1e-12)
        if not use_tensor_cores:
            assert prof["dot_chain"] == d
        atols.append(evaluate(prof, kv_len=2048, v_absmax=1.0, logit_absmax=20.0).atol)
    assert atols == sorted(atols) and all(math.isfinite(a) for a in atols)
    assert atols[-1] < (1.5 if use_tensor_cores else 512 / 32) * atols[0], atols


@pytest.mark.parametrize("kind", ["randn", "peaked_outliers"])
@pytest.mark.parametrize("dtype,tensor_cores", [(torch.float16, False), (torch.bfloat16, False),
                                                (torch.float32, False), (torch.float16, True),
                                                (torch.bfloat16, True)], ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("head_dim", [32, 512])
def test_emulated_error_within_the_bound_at_32_and_512(one_thread, head_dim, dtype, tensor_cores, kind):
    """Sound on the kernels' arithmetic emulated on the CPU (test_tolerance_reference's
    emulation) at both ends of the head dims, and tight on peaked inputs (within
    20x of the worst error; fp32's worst-case profile is not, as there)."""
    q, k, v = make_inputs(kind, dtype, 40, 1000, 2, head_dim, seed=head_dim + len(kind))
    out = emulate_kernel(q, k, v, causal=False, tensor_cores=tensor_cores)
    ref, _ = attention_reference(q, k, v)
    spec = KernelSpec.make("single_prefill", dtype, head_dim, use_tensor_cores=tensor_cores)
    magnitudes = error_model.measure(q, k, v, 1 / math.sqrt(head_dim))
    tol = evaluate(_profile(spec), kv_len=1000, v_absmax=magnitudes[0], logit_absmax=magnitudes[1])
    ratio = tol.ratio(out, ref)
    assert ratio <= 1.0, f"err/bound {ratio:.3f}"
    if kind == "peaked_outliers" and (tensor_cores or head_dim == 32) and dtype != torch.float32:
        assert ratio >= 1 / 20, f"the bound is {1 / ratio:.0f}x the worst error"
