"""Which backend a call gets, decided without a GPU from the target arches:
auto takes fa3 where every target is sm_90a and it generates the op, fa2
elsewhere; an explicit fa3 that cannot run falls back to fa2 with a warning, or
raises under the strict switch. And what the builds contain: wgmma (HGMMA in
the SASS) in the fa3 library for sm_90a, none in an sm_80 / sm_89 build."""

from __future__ import annotations

import pytest

from flashjit import arch, jit
from flashjit.spec import KernelSpec
from helpers_cache import needs_nvcc, set_cache_env
from helpers_sass import sass

PREFILL_OPS = ["single_prefill", "batch_prefill_ragged", "batch_prefill_paged"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the one-time fallback warning anew; no strict switch from the environment."""
    monkeypatch.setattr(arch, "_warned_fallbacks", set())
    monkeypatch.delenv("FLASHJIT_STRICT_BACKEND", raising=False)


@pytest.mark.parametrize("op", PREFILL_OPS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_auto_takes_fa3_on_sm90a(op, dtype):
    backend, tc, reason = arch.choose_backend(op, dtype, None, "auto", targets=("sm_90a",))
    assert (backend, tc) == ("fa3", True)
    assert "fa3" in reason and "wgmma" in reason


@pytest.mark.parametrize("targets", [("sm_80",), ("sm_89",), ("sm_80", "sm_89", "sm_90a")])
@pytest.mark.parametrize("op", PREFILL_OPS)
def test_auto_takes_fa2_where_a_target_lacks_wgmma(op, targets):
    backend, tc, reason = arch.choose_backend(op, "bfloat16", None, "auto", targets=targets)
    assert (backend, tc) == ("fa2", True)
    assert "wgmma" in reason and targets[0] in reason


@pytest.mark.parametrize("op", ["batch_decode_paged", "single_decode"])
def test_auto_takes_fa2_for_ops_fa3_does_not_generate(op):
    backend, _, reason = arch.choose_backend(op, "bfloat16", True, "auto", targets=("sm_90a",))
    assert backend == "fa2"
    assert f"fa3 does not generate {op}" in reason


@pytest.mark.parametrize("backend", ["auto", "fa3"])
def test_cuda_cores_and_fp32_stay_off_the_tensor_core_backends(backend):
    assert arch.choose_backend("single_prefill", "float32", None, backend, targets=("sm_90a",))[:2] == ("fa2", False)
    assert arch.choose_backend("single_prefill", "bfloat16", False, backend, targets=("sm_90a",))[:2] == ("fa2", False)


def test_explicit_fa3_without_wgmma_warns_once_and_runs_fa2():
    with pytest.warns(UserWarning, match=r"backend='fa3'.*wgmma.*sm_89: running fa2"):
        backend, tc, reason = arch.choose_backend("single_prefill", "bfloat16", True, "fa3", targets=("sm_89",))
    assert (backend, tc) == ("fa2", True) and "fa3 was requested" in reason
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call for the same op and target stays quiet
        assert arch.choose_backend("single_prefill", "bfloat16", True, "fa3", targets=("sm_89",))[0] == "fa2"


def test_explicit_fa3_for_an_op_it_lacks_warns_and_runs_fa2():
    with pytest.warns(UserWarning, match="fa3 does not generate batch_decode_paged"):
        assert arch.choose_backend("batch_decode_paged", "float16", True, "fa3", targets=("sm_90a",))[0] == "fa2"


def test_strict_turns_the_fallback_into_an_error(monkeypatch):
    with pytest.raises(ValueError, match=r"backend='fa3' cannot run here: fa3 needs wgmma.*sm_80.*backend='fa2'"):
        arch.choose_backend("single_prefill", "bfloat16", True, "fa3", targets=("sm_80",), strict=True)
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", "1")
    with pytest.raises(ValueError, match="FLASHJIT_STRICT_BACKEND"):
        arch.choose_backend("single_prefill", "bfloat16", True, "fa3", targets=("sm_80",))
    # Strict leaves a backend that runs alone.
    assert arch.choose_backend("single_prefill", "bfloat16", True, "fa3", targets=("sm_90a",))[0] == "fa3"


@pytest.mark.parametrize("value", ["2", "maybe", "yes please"])
def test_strict_switch_rejects_other_values(monkeypatch, value):
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", value)
    with pytest.raises(ValueError, match=r"FLASHJIT_STRICT_BACKEND: expected 0 or 1"):
        arch.strict_backend()


def test_the_arch_list_decides_without_a_gpu(monkeypatch):
    monkeypatch.setattr(arch, "device_arch", lambda: None)
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a")
    assert arch.choose_backend("single_prefill", "bfloat16", None, "auto")[0] == "fa3"
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "8.9")
    assert arch.choose_backend("single_prefill", "bfloat16", None, "auto")[0] == "fa2"


def test_fa3_for_other_ops_or_cores_is_a_clear_error():
    with pytest.raises(ValueError, match=r"backend fa3 for batch_decode_paged.*Nearest working choice: "
                                         r"batch_decode_paged_bf16_d128_fa2_tc"):
        KernelSpec.make("batch_decode_paged", "bfloat16", 128, backend="fa3", use_tensor_cores=True).validate()
    with pytest.raises(ValueError, match="fa3 is a tensor-core backend"):
        KernelSpec.make("single_prefill", "bfloat16", 128, backend="fa3").validate()


def test_fa3_build_for_arches_without_wgmma_fails_before_compiling(monkeypatch, tmp_path):
    set_cache_env(monkeypatch, tmp_path / "cache")
    spec = KernelSpec.make("single_prefill", "bfloat16", 128, backend="fa3", use_tensor_cores=True)
    with pytest.raises(ValueError, match=r"builds for sm_90a only.*sm_80, sm_89.*FLASHJIT_CUDA_ARCH_LIST"):
        jit.build_many([spec], arches=("sm_80", "sm_89"))
    assert not any((tmp_path / "cache").rglob("*.so"))


# ---------------------------------------------------------------------------
# SASS of CPU builds


@pytest.mark.nvcc
@needs_nvcc
def test_only_the_sm90a_fa3_build_holds_wgmma(monkeypatch, tmp_path):
    set_cache_env(monkeypatch, tmp_path / "cache")
    fa2 = KernelSpec.make("batch_prefill_ragged", "bfloat16", 128, use_tensor_cores=True, causal=True)
    fa3 = fa2.replace(backend="fa3")
    fa3_paged = fa3.replace(op="batch_prefill_paged")
    fa2_lib = jit.build_many([fa2], arches=("sm_80", "sm_89"))[0].entry.artifact
    fa3_results = jit.build_many([fa3, fa3_paged], arches=("sm_80", "sm_89", "sm_90a"))
    assert [r.entry.manifest["arches"] for r in fa3_results] == [["sm_90a"], ["sm_90a"]]
    fa2_sass, fa3_sass, paged_sass = sass(fa2_lib), *(sass(r.entry.artifact) for r in fa3_results)
    assert "sm_80" in fa2_sass and "sm_89" in fa2_sass and "GMMA" not in fa2_sass
    # Q.K^T from shared memory, P.V with P from registers and V transposed.
    for text in (fa3_sass, paged_sass):
        assert "HGMMA.64x128x16.F32.BF16" in text and ".tnspB" in text
    # Ragged K/V tiles arrive by TMA (3-D maps); paged ones by TMA over the pages
    # (4-D maps) or gathered by cp.async that arrives on the slot's mbarrier.
    assert "UTMALDG.3D" in fa3_sass and "UTMALDG.4D" not in fa3_sass
    assert "UTMALDG.4D" in paged_sass and "ARRIVES.LDGSTSBAR" in paged_sass


def test_strict_reaches_choose_backend_from_every_entry_point(monkeypatch):
    """strict=True on the single-request functions and the wrappers' constructors
    is what choose_backend sees when the op resolves its backend."""
    import torch

    import flashjit
    from flashjit.ops.prefill import plan_spec

    seen = []

    def record(op, dtype, use_tensor_cores, backend, targets=None, strict=None, kv_dtype=None, head_dim=None,
               head_dim_vo=None, custom_mask=False):
        seen.append((op, backend, strict))
        raise ValueError("stop here")  # no launch: this test has no GPU

    monkeypatch.setattr(arch, "choose_backend", record)
    q = torch.randn(4, 2, 64, dtype=torch.float16)
    for fn in (flashjit.single_prefill_with_kv_cache, flashjit.single_decode_with_kv_cache):
        with pytest.raises(ValueError, match="stop here"):
            fn(q if fn is flashjit.single_prefill_with_kv_cache else q[0], q, q, backend="fa3", strict=True)
    assert seen == [("single_prefill", "fa3", True), ("single_decode", "fa3", True)]
    # The wrappers' plan() resolves through plan_spec with the constructor's strict.
    with pytest.raises(ValueError, match="stop here"):
        plan_spec("batch_prefill_ragged", "fa3", 2, 2, 64, None, q_data_type=torch.float16, strict=True)
    assert seen[-1] == ("batch_prefill_ragged", "fa3", True)
