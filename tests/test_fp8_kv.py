"""FP8 KV caches without a GPU: configurations and their names, validation
messages, the rendered sources' conversions, the selectors, the tolerance
profile and reference, every bad input raised before a launch, and the
append's quantisation on CPU tensors against a torch model of it."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

import flashjit
from flashjit import cli, error_model, jit, render, selection, selectors
from flashjit.ops import _batch
from flashjit.spec import KernelSpec, canonical_dtype
from helpers_cache import no_compile  # noqa: F401 (a fixture)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SHORT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


# ---------------------------------------------------------------------------
# Configurations


@pytest.mark.parametrize("kv", FP8, ids=str)
def test_names_spell_the_kv_dtype(kv):
    spec = KernelSpec.make("batch_decode_paged", "bfloat16", 128, dtype_kv=kv, return_lse=True).validate()
    assert spec.name == f"batch_decode_paged_bf16_kv{SHORT[kv]}_d128_fa2_cc_lse"
    assert KernelSpec.make("append_paged", "float16", 64, dtype_kv=kv).validate().name == f"append_paged_f16_kv{SHORT[kv]}_d64"
    # Configurations of one dtype keep their names (and so their cache directories).
    assert KernelSpec.make("batch_decode_paged", "bfloat16", 128, return_lse=True).name == \
        "batch_decode_paged_bf16_d128_fa2_cc_lse"


@pytest.mark.parametrize("alias,canonical", [("e4m3", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"),
                                             ("float8_e4m3fn", "float8_e4m3fn"), ("e5m2", "float8_e5m2"),
                                             ("fp8_e5m2", "float8_e5m2"), (torch.float8_e5m2, "float8_e5m2")])
def test_fp8_aliases(alias, canonical):
    assert canonical_dtype(alias) == canonical


@pytest.mark.parametrize("fnuz", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_fnuz_formats_are_named_as_another_platforms(fnuz):
    with pytest.raises(ValueError, match=rf"^dtype: {fnuz} is another platform's FP8 format"):
        canonical_dtype(getattr(torch, fnuz))


@pytest.mark.parametrize("change,match", [
    (dict(op="batch_prefill_paged"),
     r"FP8 KV cache for CUDA-core batch_prefill_paged is not yet generated.*Nearest working choice: "
     r"batch_decode_paged_bf16_kve4m3_d128_fa2_cc$"),
    (dict(op="single_prefill"), r"CUDA-core single_prefill is not yet generated.*single_decode_bf16_kve4m3"),
    (dict(dtype="float32"), r"an FP8 KV cache with dtype_q=float32.*Nearest working choice: "
                            r"batch_decode_paged_bf16_kve4m3_d128_fa2_cc$"),
    (dict(dtype="e4m3"), r"FP8 queries or outputs .* are not supported"),
    (dict(causal=True), r"batch-invariant decode \(causal=True\) is not yet generated"),
])
def test_unsupported_fp8_combinations_name_the_supported_set(change, match):
    args = dict(op="batch_decode_paged", dtype="bfloat16", use_tensor_cores=False)
    args.update(change)
    op, dtype, head_dim = args.pop("op"), args.pop("dtype"), args.pop("head_dim", 128)
    with pytest.raises(ValueError, match=match) as info:
        KernelSpec.make(op, dtype, head_dim, dtype_kv="e4m3", **args).validate()
    assert "Supported: FP8 KV caches (float8_e4m3fn, float8_e5m2) with fp16 or bf16 q and o for single_decode " \
           "(CUDA cores), batch_decode_paged (CUDA cores), append_paged" in str(info.value)
    nearest = str(info.value).rsplit("Nearest working choice: ", 1)[1]
    assert re.fullmatch(r"[a-z0-9_]+", nearest)


@pytest.mark.parametrize("kv", FP8, ids=str)
@pytest.mark.parametrize("op", ["single_decode", "batch_decode_paged"])
def test_decode_source_reads_fp8_codes_and_applies_the_scales(op, kv):
    spec = KernelSpec.make(op, "float16", 128, dtype_kv=kv).validate()
    rendered = render.render(spec)
    ctype = {torch.float8_e4m3fn: "__nv_fp8_e4m3", torch.float8_e5m2: "__nv_fp8_e5m2"}[kv]
    assert f"/*DType=*/__half, /*DTypeKV=*/{ctype}," in rendered.text
    numeric = rendered.headers["flashjit/common/numeric.cuh"].decode()
    assert "__nv_cvt_fp8x2_to_halfraw2" in numeric, "codes widen through fp16 (exact)"
    decode = rendered.headers["flashjit/cuda_core/cuda_core_decode.cuh"].decode()
    for piece in ("unpack8_fp8<typename Traits::DTypeKV>(ld_shared_8(addr), out)", "cp_async_8(dst, src, valid)",
                  "* kv_scale<Traits>(p.k_scale_ptr, p.k_scale)", "o *= kv_scale<Traits>(p.v_scale_ptr, p.v_scale)"):
        assert piece in decode


@pytest.mark.parametrize("kv", FP8, ids=str)
def test_append_source_quantises_with_saturation(kv):
    rendered = render.render(KernelSpec.make("append_paged", "bfloat16", 256, dtype_kv=kv).validate())
    ctype = {torch.float8_e4m3fn: "__nv_fp8_e4m3", torch.float8_e5m2: "__nv_fp8_e5m2"}[kv]
    assert f"launch_append_paged</*TIn=*/__nv_bfloat16, /*TCache=*/{ctype}, /*kHeadDim=*/256>" in rendered.text
    assert "__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE" in \
        rendered.headers["flashjit/common/numeric.cuh"].decode()
    assert "__fdiv_rn(to_float(e[4 * w]), scale)" in rendered.headers["flashjit/append/append_paged.cuh"].decode()


# ---------------------------------------------------------------------------
# Selectors


def _args(*argv):
    args = cli.build_parser().parse_args(["prewarm", *argv])
    selectors.check_selectors(args)
    return args


@pytest.mark.parametrize("words,canonical", [(["e4m3", "e5m2"], ["float8_e4m3fn", "float8_e5m2"]),
                                             (["fp8_e4m3", "float8_e5m2"], ["float8_e4m3fn", "float8_e5m2"]),
                                             (["float8_e4m3fn"], ["float8_e4m3fn"]), (["fp8_e5m2"], ["float8_e5m2"])])
def test_kv_dtype_selector_aliases(words, canonical):
    assert _args("--kv-dtype", *words).kv_dtype == canonical


def test_kv_dtype_selection_on_the_default_preset():
    specs = selection.specs_from_args(_args("--kv-dtype", "e4m3", "e5m2", "--arch", "sm_90a"))
    names = {s.name for s in specs}
    # On sm_90a the prefill parts and MLA run fa3 with an FP8 cache, decode fa2.
    assert names == {f"{op}_bf16_kv{kv}_d{d}{suffix}" for kv in ("e4m3", "e5m2") for d in (64, 128, 256)
                     for op, suffix in (("batch_decode_paged", "_fa2_cc_lse"), ("batch_decode_paged", "_fa2_tc_lse"),
                                        ("batch_prefill_paged", "_fa3_tc_causal_lse"),
                                        ("batch_prefill_ragged", "_fa3_tc_causal_lse"), ("append_paged", ""))} | \
        {f"mla_paged_bf16_kv{kv}_qk576_vo512_fa3_tc{causal}_lse" for kv in ("e4m3", "e5m2") for causal in ("", "_causal")}
    # The default preset's FP8 part: e4m3 at head dim 128 (README's first command, within its time).
    assert {s.name for s in selection.specs_from_args(_args("--arch", "sm_90a")) if s.dtype_kv != s.dtype_q} == {
        "batch_prefill_paged_bf16_kve4m3_d128_fa3_tc_causal_lse", "batch_decode_paged_bf16_kve4m3_d128_fa2_cc_lse",
        "batch_decode_paged_bf16_kve4m3_d128_fa2_tc_lse", "append_paged_bf16_kve4m3_d128"}
    specs = selection.specs_from_args(_args("--op", "single_decode", "--dtype", "fp16", "bf16", "--kv-dtype", "e5m2",
                                            "--head-dim", "128", "--arch", "sm_80"))
    assert [s.name for s in specs] == ["single_decode_f16_kve5m2_d128_fa2_cc", "single_decode_bf16_kve5m2_d128_fa2_cc"]
    assert "--kv-dtype float8_e5m2" in jit.prewarm_command(specs[0], ("sm_80",))
    assert "--kv-dtype e5m2" in selection.flag_words(specs[0])


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "e4m3"], r"^--dtype: e4m3 is an FP8 format, which flashjit reads in KV caches only; give it as "
                          r"--kv-dtype e4m3 beside --dtype fp16 or bf16$"),
    (["--kv-dtype", "bf16"], r"^--kv-dtype: bf16 is not an FP8 KV-cache dtype; choose e4m3 \(float8_e4m3fn, "
                             r"fp8_e4m3, fp8_e4m3fn\) or e5m2 \(float8_e5m2, fp8_e5m2\)"),
    (["--kv-dtype", "float8_e4m3fnuz"], r"^--kv-dtype: float8_e4m3fnuz is not an FP8 KV-cache dtype \(another "
                                        r"platform's FP8 format\)"),
])
def test_bad_kv_dtype_flags_are_named_in_flag_words(argv, message):
    with pytest.raises(selectors.SelectionError, match=message):
        _args(*argv)


@pytest.mark.parametrize("argv,message", [
    (["--op", "batch_prefill_paged", "--tensor-cores", "off"],
     r"^the selection is empty: --kv-dtype e4m3: batch_prefill_paged on CUDA cores is not yet generated for an FP8 "
     r"KV cache; FP8 KV caches run single_decode \(CUDA cores\), batch_decode_paged \(CUDA cores\), append_paged, "
     r"single_decode \(tensor cores\)"),
    (["--op", "single_decode", "--dtype", "fp32"], r"^the selection is empty: an FP8 KV cache \(--kv-dtype\) takes "
                                                   r"--dtype fp16 or bf16 \(not fp32\)$"),
])
def test_fp8_selections_that_name_nothing(argv, message):
    with pytest.raises(selectors.SelectionError, match=message):
        selection.specs_from_args(_args("--kv-dtype", "e4m3", "--arch", "sm_80", *argv))


def test_numerics_takes_the_kv_dtype_selector():
    args = cli.build_parser().parse_args(["numerics", "--kv-dtype", "fp8_e4m3"])
    selectors.check_selectors(args)
    assert args.kv_dtype == ["float8_e4m3fn"]


# ---------------------------------------------------------------------------
# Tolerance profile and reference


def test_profile_terms_of_an_fp8_cache():
    fp8 = error_model.profile(KernelSpec.make("batch_decode_paged", "float16", 128, dtype_kv="e5m2", return_lse=True))
    same = error_model.profile(KernelSpec.make("batch_decode_paged", "float16", 128, return_lse=True))
    u32 = 2.0**-24
    assert fp8["rtol"] == pytest.approx(same["rtol"] + u32, rel=1e-12), "v_scale multiplies the output: one rounding"
    assert fp8["logit_per_s"] > same["logit_per_s"] and fp8["kv_scales"] and fp8["dtype_mma"] == "float16"
    assert fp8["p_rounding"] == 0.0 and fp8["bound"] == "worst_case", "CUDA cores: P stays fp32"
    # An FP8 cache's CUDA-core decode runs lanes of 16 dims (kernels.cuda_core): its fp32 sums chain
    # otherwise than the 16-bit kernel's. With the same chains, the one scale rounding is all it adds.
    chains = ("dot_chain", "pv_chains", "l_chains", "l_tail", "merge_levels", "keys_per_rescale", "merge_rescales")
    assert fp8["dot_chain"] == 16 + 3 and same["dot_chain"] == 8 + 4, "16 dims a lane, 8 lanes a key at d128"
    same = {**same, **{key: fp8[key] for key in chains}}
    kw = dict(kv_len=4096, v_absmax=3.0, logit_absmax=40.0)
    a, b = error_model.evaluate(fp8, **kw), error_model.evaluate(same, **kw)
    assert b.atol < a.atol < 1.05 * b.atol, "only the one scale rounding more than the fp16 cache"
    # Tensor-core profiles round P to q's dtype (the MMA operand), whatever the cache holds.
    tc = error_model.profile(KernelSpec.make("batch_decode_paged", "bfloat16", 128, use_tensor_cores=True,
                                             return_lse=True))
    assert tc["p_rounding"] == 2.0**-8


def test_tolerance_and_reference_dequantise_with_the_scales():
    q = torch.randn(4, 64, dtype=torch.float16)
    k_codes = (torch.randn(50, 2, 64) * 3).to(torch.float8_e4m3fn)
    v_codes = (torch.randn(50, 2, 64) * 3).to(torch.float8_e4m3fn)
    k_scale, v_scale = 0.3, torch.tensor([2.5])
    out, lse = flashjit.attention_reference(q[None], k_codes, v_codes, k_scale=k_scale, v_scale=v_scale)
    scale32 = float(torch.tensor(0.3, dtype=torch.float32))  # the kernel's float
    ref_out, ref_lse = flashjit.attention_reference(q[None], k_codes.double() * scale32, v_codes.double() * 2.5)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    tol = flashjit.tolerance(op="single_decode", dtype="float16", dtype_kv="e4m3", head_dim=64, kv_len=50, q=q[None],
                             k=k_codes, v=v_codes, k_scale=k_scale, v_scale=2.5)
    vmax = float(v_codes.float().abs().max()) * 2.5
    same = flashjit.tolerance(op="single_decode", dtype="float16", dtype_kv="e4m3", head_dim=64, kv_len=50,
                              v_absmax=vmax, logit_absmax=error_model.measure(q, k_codes.double() * 0.3,
                                                                              v_codes.double(), 1 / 8)[1])
    assert tol.atol == pytest.approx(same.atol, rel=1e-6) and tol.rtol == same.rtol


def test_batch_invariant_prewarm_of_an_fp8_cache_runs_fa3_on_sm90a():
    """--batch-invariant picks each spec's backend again per arch: fa3 for FP8 prefill, as the ops do."""
    specs = selection.specs_from_args(_args("--batch-invariant", "--op", "batch_prefill_ragged", "--kv-dtype", "e4m3",
                                            "--head-dim", "128", "--arch", "sm_90a"))
    assert specs and {(s.backend, s.dtype_kv) for s in specs} == {("fa3", "float8_e4m3fn")}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_decode_tilings(head_dim):
    """An FP8 cache's decode: CUDA cores in lanes of 16 dims (16-byte copies of codes), tensor cores
    at d128 three CTAs per SM; a 16-bit cache's tilings stay as they were (docs/fp8.md, "Speed")."""
    from flashjit.kernels import cuda_core, fa2

    cc = KernelSpec.make("batch_decode_paged", "bfloat16", head_dim, dtype_kv="e4m3")
    assert cuda_core.cuda_decode_tiling(cc).dims_per_lane == 16
    assert "kDimsPerLane=*/16" in render.render(cc).text
    assert cuda_core.cuda_decode_tiling(cc.replace(dtype_kv="bfloat16")).dims_per_lane == 8
    tc = cc.replace(use_tensor_cores=True)
    blocks = fa2.tiling(tc).min_blocks_per_sm, fa2.tiling(tc.replace(dtype_kv="bfloat16")).min_blocks_per_sm
    assert blocks == ((3, 2) if head_dim == 128 else (2, 2))
