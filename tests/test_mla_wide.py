"""The fa2 MLA library's second kernel for large head counts
(fa2/fa2_mla_wide.cuh): which builds carry it, from how many heads it runs,
and the shape the host plans it with (loader.KernelModule.for_group)."""

from __future__ import annotations

import pytest

from flashjit import jit, loader
from flashjit.kernels import common, fa2, tiling_for
from flashjit.render import render
from flashjit.spec import mla_spec
from helpers_cache import needs_nvcc, set_cache_env
from test_backend_choice import sass


@pytest.mark.parametrize("arches, wide", [(("sm_90a",), True), (("sm_80", "sm_89", "sm_90a"), False),
                                          (("sm_80",), False), (None, False)])
def test_wide_kernel_only_where_every_target_holds_its_cta(arches, wide):
    spec = mla_spec("bfloat16", causal=True)
    _, tiling = tiling_for(spec, arches)
    assert tiling.wide_min_heads == (fa2.MLA_WIDE_MIN_HEADS if wide else 0)
    assert (tiling.rows_per_cta, tiling.keys_per_tile) == (16, 32)  # the narrow kernel, unchanged
    assert tiling.rescales(spec) == (32, 0)  # the narrow count bounds the wide kernel's (one per 64 keys)
    size = tiling.wide_smem_bytes(spec) + common.SMEM_RESERVED_PER_CTA
    assert common.SMEM_PER_SM["sm_80"] < size <= common.SMEM_PER_SM["sm_90a"]
    assert f"/*kWideMinHeads=*/{tiling.wide_min_heads}>" in render(spec, arches).text


@pytest.mark.nvcc
@needs_nvcc
def test_sm90a_library_carries_both_kernels_and_plans_each_with_its_shape(monkeypatch, tmp_path):
    """Both kernels without spills; 16 and 32 heads plan 16-row CTAs, 64 and up
    64-row CTAs in 64-key split chunks; a build that also targets sm_80 has no
    wide kernel and one shape for every head count."""
    set_cache_env(monkeypatch, tmp_path / "cache")
    spec = mla_spec("bfloat16", causal=True)
    result, = jit.build_many([spec], arches=("sm_90a",))
    kernels = {u["kernel"]: u for u in result.entry.manifest["resources"] if "mla" in u["kernel"]}
    assert len(kernels) == 2 and any("fa2_mla_wide_kernel" in k for k in kernels)
    for u in kernels.values():
        assert 0 < u["registers"] <= 255 and u["spill_stores"] == 0 and u["spill_loads"] == 0, u
    assert sass(result.entry.artifact).count("Function : ") >= 2

    module = loader.load_library(spec, result.entry.artifact, result.entry.manifest)
    assert module.for_group(16) is module and module.for_group(32) is module
    for heads in (64, 128):
        view = module.for_group(heads)
        assert (view.rows_per_cta, view.split_align, view.launcher) == (64, 64, module.launcher)
    assert module.for_group(128) is module.for_group(128)  # one view per head count
    narrow, = jit.build_many([mla_spec("bfloat16")], arches=("sm_80", "sm_90a"))
    assert not any("wide" in u["kernel"] for u in narrow.entry.manifest["resources"])
    plain = loader.load_library(narrow.spec, narrow.entry.artifact, narrow.entry.manifest)
    assert plain.for_group(128) is plain and plain.rows_per_cta == 16
