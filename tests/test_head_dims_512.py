"""Head dim 512 without a GPU: generated for single and paged decode on CUDA
and tensor cores and for paged prefill on fa2's tensor cores
(spec.WIDE_HEAD_DIM_FAMILIES), a clear error everywhere else naming the
argument or flag, where 512 is generated and the nearest head dims; `auto`'s
fa2 on sm_90a with its reason; the prewarm selection; the tilings (fa2's
column-split kernel, CUDA-core decode at 16 dims a lane) and their rendered
sources; the profiles and the float64 reference at 512; and (nvcc) every 512
kernel's heaviest variants built for sm_80, sm_89 and sm_90a without spills.
The GPU tests: test_gpu_head_dims.py and test_gpu_head_dim_512.py."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

import flashjit
from flashjit import arch, cli, error_model, kernels, render, selectors
from flashjit.kernels import common
from flashjit.kernels.cuda_core import cuda_decode_tiling
from flashjit.kernels.fa2 import FA2_COLUMN_SPLIT_512, Fa2ColumnSplitTiling
from flashjit.ops import _launch
from flashjit.reference import attention_reference
from flashjit.selection import SelectionError
from flashjit.spec import (ALL_HEAD_DIMS, ATTENTION_OPS, HEAD_DIMS, WIDE_HEAD_DIM_FAMILIES, WIDE_HEAD_DIMS,
                           KernelSpec, all_head_dims_text, head_dims_for, nearest_head_dims)

D = 512
WHERE = ("512 for single_decode and batch_decode_paged (CUDA or tensor cores) and batch_prefill_paged (tensor cores, "
         "fa2)")
GENERATED = f"a multiple of 16 from 32 to 256; {WHERE}"
# Every 512 configuration's dtypes: (dtype_q, dtype_kv) on CUDA cores, and on tensor cores.
CC_DTYPES = [("float16", None), ("bfloat16", None), ("float32", None), ("bfloat16", "float8_e4m3fn"),
             ("float16", "float8_e5m2")]
TC_DTYPES = [("float16", None), ("bfloat16", None), ("bfloat16", "float8_e4m3fn"), ("float16", "float8_e5m2")]


def wide_specs() -> list[KernelSpec]:
    """Every family of 512 in each of its dtypes, plain and with every flag it takes."""
    specs = []
    for op, tc in WIDE_HEAD_DIM_FAMILIES:
        for dtype, kv in TC_DTYPES if tc else CC_DTYPES:
            flags = [dict(), dict(sliding_window=True, soft_cap=True, return_lse=True)]
            if op == "batch_prefill_paged":
                flags += [dict(causal=True, sliding_window=True, soft_cap=True, return_lse=True)]
                flags += [dict(custom_mask=True, return_lse=True)] if kv is None else []
            specs += [KernelSpec.make(op, dtype, D, dtype_kv=kv, use_tensor_cores=tc, **f) for f in flags]
    return specs


# ---------------------------------------------------------------------------
# The generated set and validation


def test_512_is_generated_for_decode_and_paged_prefill_alone():
    assert WIDE_HEAD_DIMS == (D,) and ALL_HEAD_DIMS == HEAD_DIMS + (D,)
    assert all_head_dims_text() == GENERATED
    for op in ATTENTION_OPS:
        for tc in (False, True):
            assert (D in head_dims_for(op, tc)) == ((op, tc) in WIDE_HEAD_DIM_FAMILIES)
    assert D in head_dims_for("batch_prefill_paged") and D not in head_dims_for("append_paged")
    assert nearest_head_dims(400, ALL_HEAD_DIMS) == (256, D) and nearest_head_dims(576, ALL_HEAD_DIMS) == (D,)


@pytest.mark.parametrize("spec", wide_specs(), ids=lambda s: s.name)
def test_every_512_configuration_validates(spec):
    assert spec.validate() is spec


@pytest.mark.parametrize("spec,where,nearest", [
    (KernelSpec.make("single_prefill", "bfloat16", D, use_tensor_cores=True), "for single_prefill on tensor cores",
     "single_prefill_bf16_d256_fa2_tc"),
    (KernelSpec.make("batch_prefill_ragged", "float16", D, causal=True), "for batch_prefill_ragged on CUDA cores",
     "batch_prefill_ragged_f16_d256_fa2_cc_causal"),
    # CUDA-core paged prefill: the same head dim on tensor cores where the dtype has them.
    (KernelSpec.make("batch_prefill_paged", "bfloat16", D, return_lse=True), "for batch_prefill_paged on CUDA cores",
     "batch_prefill_paged_bf16_d512_fa2_tc_lse"),
    (KernelSpec.make("batch_prefill_paged", "float32", D), "for batch_prefill_paged on CUDA cores",
     "batch_prefill_paged_f32_d256_fa2_cc"),
    (KernelSpec.make("append_paged", "bfloat16", D), "for append_paged", "append_paged_bf16_d256"),
    # Batch-invariant decode on CUDA cores runs the CUDA-core prefill kernel.
    (KernelSpec.make("single_decode", "float32", D, causal=True), "in batch-invariant decode on CUDA cores",
     "single_decode_f32_d256_fa2_cc_causal"),
])
def test_512_elsewhere_names_where_it_is_generated(spec, where, nearest):
    with pytest.raises(ValueError) as info:
        spec.validate()
    assert str(info.value) == (f"unsupported configuration {spec.name}: head_dim_qk={D} is not generated {where} "
                               f"(nearest: 256). Supported: head_dim {GENERATED}. Nearest working choice: {nearest}")


def test_head_dims_between_name_both_neighbours_where_512_is_generated():
    with pytest.raises(ValueError, match=r"head_dim_qk=400 is not generated \(nearest: 256 or 512\)\..* Nearest "
                                         r"working choice: batch_decode_paged_bf16_d512_fa2_tc$"):
        KernelSpec.make("batch_decode_paged", "bfloat16", 400, use_tensor_cores=True).validate()
    with pytest.raises(ValueError, match=r"head_dim_qk=400 is not generated \(nearest: 256\)\..* Nearest working "
                                         r"choice: single_prefill_bf16_d256_fa2_cc$"):
        KernelSpec.make("single_prefill", "bfloat16", 400).validate()
    with pytest.raises(ValueError, match=r"head_dim_qk=512, head_dim_vo=256 is not generated"):
        KernelSpec.make("batch_prefill_paged", "bfloat16", D, head_dim_vo=256, use_tensor_cores=True).validate()


def test_fa3_keeps_its_head_dims_and_auto_runs_fa2_at_512(monkeypatch, caplog):
    spec = KernelSpec.make("batch_prefill_paged", "bfloat16", D, backend="fa3", use_tensor_cores=True, causal=True)
    with pytest.raises(ValueError, match=r"backend fa3 with head_dim 512\. .* Nearest working choice: "
                                         r"batch_prefill_paged_bf16_d512_fa2_tc_causal$"):
        spec.validate()
    backend, tc, reason = arch.choose_backend("batch_prefill_paged", "bfloat16", None, "auto", targets=("sm_90a",),
                                              head_dim=D)
    assert (backend, tc) == ("fa2", True)
    assert reason.endswith("; fa2 (mma.sync), as fa3 does not generate head_dim 512 (it does 64, 96, 128, 192, 256)")
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(arch, "device_arch", lambda: None)
    kw = dict(backend="auto", use_tensor_cores=None, window=False, soft_cap=False, return_lse=True)
    with caplog.at_level(logging.INFO, logger="flashjit"):
        assert _launch.select_spec("batch_prefill_paged", torch.float16, D, causal=True, **kw).name == \
            "batch_prefill_paged_f16_d512_fa2_tc_causal_lse"
    assert any("fa3 does not generate head_dim 512" in r.getMessage() for r in caplog.records)
    # Batch-invariant decode: the prefill kernel's backend and tiling (fa2's column split).
    spec = _launch.select_spec("single_decode", torch.bfloat16, D, causal=False, batch_invariant=True, **kw)
    assert spec.name == "single_decode_bf16_d512_fa2_tc_causal_lse"
    assert kernels.tiling_for(spec)[1] is FA2_COLUMN_SPLIT_512
    with pytest.raises(ValueError, match=r"head_dim_qk=512 is not generated for single_prefill"):
        _launch.select_spec("single_prefill", torch.bfloat16, D, causal=True, **kw)


# ---------------------------------------------------------------------------
# Selectors (prewarm, numerics, bench)


def _names(*flags, arches=("sm_80", "sm_90a")):
    args = cli.build_parser().parse_args(["prewarm", *flags, "--arch", *arches])
    cli.check_selectors(args)
    return {s.name for s in cli.specs_from_args(args)}


def test_prewarm_builds_512_where_it_is_generated():
    names = _names("--head-dim", "512")  # the default preset: ragged prefill and the append are left out
    assert {n for n in names if not n.startswith("mla_paged")} == {
        f"batch_{op}_bf16{kv}_d512_fa2_{suffix}" for kv in ("", "_kve4m3")  # and its e4m3 part
        for op, suffix in (("prefill_paged", "tc_causal_lse"), ("decode_paged", "cc_lse"), ("decode_paged", "tc_lse"))}
    assert _names("--op", "single_decode", "--dtype", "fp32", "bf16", "--kv-dtype", "e4m3", "--head-dim", "512",
                  "--tensor-cores", "both") == {"single_decode_bf16_kve4m3_d512_fa2_cc",
                                                "single_decode_bf16_kve4m3_d512_fa2_tc"}
    assert _names("--op", "single_decode", "--dtype", "bf16", "fp32", "--head-dim", "512", "--batch-invariant") == {
        "single_decode_bf16_d512_fa2_tc_causal"}


@pytest.mark.parametrize("flags,message", [
    (["--head-dim", "400"], f"--head-dim: 400 is not generated; choose 256 or 512 (the nearest; generated: "
                            f"{GENERATED})"),
    (["--op", "batch_prefill_ragged", "single_prefill", "--head-dim", "512"],
     f"--head-dim: 512 is not generated for batch_prefill_ragged and single_prefill; choose 256 (the nearest; "
     f"generated: a multiple of 16 from 32 to 256; {WHERE})"),
    (["--op", "batch_prefill_paged", "--dtype", "fp32", "--head-dim", "512"],
     "the selection is empty: --head-dim 512: batch_prefill_paged runs it on tensor cores only, with fp16 or bf16 "
     "(not fp32)"),
    (["--op", "batch_prefill_paged", "--head-dim", "512", "--tensor-cores", "off"],
     "the selection is empty: --head-dim 512: batch_prefill_paged runs it on tensor cores only; choose "
     "--tensor-cores on, auto or both"),
    (["--op", "single_decode", "--dtype", "fp32", "--head-dim", "512", "--batch-invariant"],
     "the selection is empty: --batch-invariant decode at head dim 512 runs on tensor cores (fp16, bf16) only"),
])
def test_selectors_name_the_flag_and_where_512_is_generated(flags, message):
    with pytest.raises(SelectionError) as info:
        _names(*flags)
    assert str(info.value) == message


def test_bench_and_numerics_take_the_same_check():
    with pytest.raises(SelectionError, match=r"^--head-dim: 512 is not generated for batch_prefill_ragged; choose "
                                             r"256 \(the nearest"):
        selectors.check_head_dims(["512"], ["batch_prefill_ragged"])  # bench's prefill rows
    assert selectors.check_head_dims(["512", "96"], ["batch_decode_paged"]) == [D, 96]
    args = cli.build_parser().parse_args(["numerics", "--op", "batch_decode_paged", "--head-dim", "512"])
    cli.check_selectors(args)
    assert args.head_dim == [D]


# ---------------------------------------------------------------------------
# Tilings and rendered sources


@pytest.mark.parametrize("spec", [s for s in wide_specs() if s.use_tensor_cores], ids=lambda s: s.name)
def test_fa2_512_takes_the_column_split_kernel(spec):
    for arches in (None, ("sm_80",), ("sm_90a",)):
        template, tiling = kernels.tiling_for(spec, arches)
        assert tiling is FA2_COLUMN_SPLIT_512 and isinstance(tiling, Fa2ColumnSplitTiling) and tiling.column_split
    assert tiling.rows_per_cta == 16 and tiling.rescales(spec) == (16, 0)
    # Q (16 rows of 1 KB, later the logit exchange) and two stages of 16-key K/V tiles; FP8: code
    # stages (512 B a row) and the widened pair: 80 KB either way, two CTAs on sm_80 and sm_90a.
    assert tiling.smem_bytes(spec) == 16 * 1024 + 2 * 2 * 16 * 1024 == 81920 <= common.SMEM_BUDGET
    text = render.render(spec).text
    assert '#include "flashjit/fa2/fa2_column_split.cuh"' in text and "Fa2Traits<" not in text
    assert re.findall(r"/\*kHeadDim=\*/(\d+)", text) == ["512"]
    assert "/*kWarps=*/4, /*kKeysPerTile=*/16, /*kStages=*/2" in text
    assert f"/*kPaged=*/{'true' if spec.op != 'single_decode' else 'false'}" in text
    assert f"/*kCustomMask=*/{'true' if spec.custom_mask else 'false'}" in text


@pytest.mark.parametrize("spec", [s for s in wide_specs() if not s.use_tensor_cores], ids=lambda s: s.name)
def test_cuda_core_decode_at_512_takes_16_dims_a_lane(spec):
    template, tiling = kernels.tiling_for(spec)
    assert template == "attention_cuda_decode.cu.jinja" and tiling == cuda_decode_tiling(spec)
    assert (tiling.dims_per_lane, tiling.lanes_per_key(spec), tiling.key_groups(spec)) == (16, 32, 1)
    elt = common.DTYPE_BYTES[spec.dtype_kv]
    assert (tiling.keys_per_group, tiling.stages, tiling.min_blocks_per_sm) == (2 if elt == 4 else 4,
                                                                                 3 if elt == 1 else 2, 2)
    assert tiling.smem_bytes(spec) == (49152 if elt == 1 else 65536) <= common.SMEM_BUDGET
    # Q.K: 16 fmas a lane, then 5 halvings over the 32 lanes; one chain per warp otherwise.
    assert tiling.chains(spec) == {"dot_chain": 21, "pv_chains": 4, "l_chains": 4, "l_tail": 8, "merge_levels": 1}
    assert tiling.rescales(spec) == (4 * tiling.keys_per_group, 1)
    text = render.render(spec).text
    assert "/*kHeadDim=*/512," in text and "/*kDimsPerLane=*/16," in text and "/*kMinBlocksPerSm=*/2," in text


def test_existing_tilings_and_sources_are_untouched():
    """The 512 branch of attention_fa2.cu.jinja renders nothing for the other head dims."""
    spec = KernelSpec.make("batch_decode_paged", "bfloat16", 256, use_tensor_cores=True, return_lse=True)
    text = render.render(spec).text
    assert "fa2_column_split" not in text and "flashjit::Fa2Traits<" in text and text.endswith("exports.cuh\"\n")
    assert not kernels.tiling_for(spec)[1].column_split
    assert cuda_decode_tiling(KernelSpec.make("single_decode", "bfloat16", 256)).dims_per_lane == 8


# ---------------------------------------------------------------------------
# Profiles and the float64 reference at 512


@pytest.mark.parametrize("spec", wide_specs(), ids=lambda s: s.name)
def test_every_512_configuration_has_a_finite_profile(spec):
    prof = error_model.profile(spec)
    lam = error_model.LAMBDA
    fp8 = spec.dtype_kv.startswith("float8")
    assert prof["logit_per_s"] == pytest.approx(
        2 * math.log(2) * (lam * math.sqrt(D) + 3 + 4 * spec.soft_cap + fp8) * error_model.U32, rel=1e-12)
    assert prof["keys_per_rescale"] == kernels.tiling_for(spec)[1].rescales(spec)[0]
    tol = flashjit.tolerance(spec, kv_len=32768, v_absmax=4.0)
    assert 0 < tol.rtol < 1e-2 and 0 < tol.atol < 0.1 and math.isfinite(tol.atol)


@pytest.mark.parametrize("use_tensor_cores", [False, True], ids=["cc", "tc"])
def test_the_bound_at_512_follows_256_by_the_head_dim_terms(use_tensor_cores):
    """Decode at 512 against 256, the same magnitudes: tensor cores' bound (P's
    rounding dominates) moves by less than 10%; CUDA cores' worst case by its
    longer Q.K chain (21 against 13 roundings) and no more than twice."""
    def atol(d):
        spec = KernelSpec.make("batch_decode_paged", "bfloat16", d, use_tensor_cores=use_tensor_cores)
        return flashjit.tolerance(spec, kv_len=4096, v_absmax=1.0, logit_absmax=20.0).atol
    assert atol(256) < atol(D) < (1.1 if use_tensor_cores else 2.0) * atol(256)


def test_reference_at_512_is_softmax_attention():
    """GQA, causal, window, soft-cap and sinks at 512 against a direct float64 formula."""
    g = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(n, h, D, generator=g, dtype=torch.float64) for n, h in ((5, 8), (40, 2), (40, 2)))
    sinks = torch.randn(8, generator=g, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, causal=True, window_left=20, logits_soft_cap=30.0, sinks=sinks)
    kk, vv = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(D)
    s = 30.0 * torch.tanh(s / 30.0)
    i, j = torch.arange(5)[:, None] + 35, torch.arange(40)[None, :]
    s = s.masked_fill(~((j <= i) & (j >= i - 20)), -math.inf)
    full = torch.cat([s, sinks[:, None, None].expand(8, 5, 1)], -1).softmax(-1)
    assert torch.allclose(out, torch.einsum("hqk,khd->qhd", full[..., :-1], vv), rtol=1e-12, atol=1e-12)
    expected = torch.logsumexp(torch.cat([s, sinks[:, None, None].expand(8, 5, 1)], -1), -1) / math.log(2)
    assert out.shape == (5, 8, D) and torch.allclose(lse, expected.transpose(0, 1), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------
# nvcc: every 512 kernel's heaviest variants, without spills


HEAVY_SPECS = [
    KernelSpec.make("batch_decode_paged", "bfloat16", D, use_tensor_cores=True, sliding_window=True, soft_cap=True,
                    return_lse=True),
    KernelSpec.make("single_decode", "float16", D, use_tensor_cores=True, sliding_window=True, soft_cap=True,
                    return_lse=True),
    KernelSpec.make("batch_prefill_paged", "bfloat16", D, use_tensor_cores=True, causal=True, sliding_window=True,
                    soft_cap=True, return_lse=True),
    KernelSpec.make("batch_prefill_paged", "bfloat16", D, use_tensor_cores=True, custom_mask=True,
                    sliding_window=True, soft_cap=True, return_lse=True),
    KernelSpec.make("batch_decode_paged", "bfloat16", D, dtype_kv="float8_e4m3fn", use_tensor_cores=True,
                    sliding_window=True, soft_cap=True, return_lse=True),
    KernelSpec.make("batch_prefill_paged", "float16", D, dtype_kv="float8_e5m2", use_tensor_cores=True, causal=True,
                    soft_cap=True, return_lse=True),
    KernelSpec.make("single_decode", "bfloat16", D, use_tensor_cores=True, causal=True, return_lse=True),
] + [KernelSpec.make(op, dtype, D, dtype_kv=kv, sliding_window=True, soft_cap=True, return_lse=True)
     for op, dtype, kv in (("batch_decode_paged", "float16", None), ("batch_decode_paged", "bfloat16", None),
                           ("single_decode", "float32", None), ("batch_decode_paged", "float32", None),
                           ("single_decode", "bfloat16", "float8_e5m2"),
                           ("batch_decode_paged", "float16", "float8_e4m3fn"))]


@pytest.mark.nvcc
@pytest.mark.slow
def test_512_kernels_build_without_spills(tmp_path):
    arches = ("sm_80", "sm_89", "sm_90a")
    for result in flashjit.build_many(HEAVY_SPECS, arches, root=tmp_path):
        assert result.entry is not None, result.error
        usage = result.entry.manifest["resources"]
        main = "fa2_column_split_attention_kernel" if result.spec.use_tensor_cores else \
            "cuda_core_decode_attention_kernel"
        assert {u["arch"] for u in usage if main in u["kernel"]} == set(arches), result.spec.name
        assert any("merge" in u["kernel"] for u in usage)
        spills = [u for u in usage if u["spill_stores"] or u["spill_loads"] or u["stack"]]
        assert spills == [], f"{result.spec.name} spills: {spills}"
        assert result.entry.manifest["tolerance"] == error_model.profile(result.spec)
