"""`flashjit numerics --kv-dtype`: FP8 KV-cache configurations on the CPU. The
per-tensor quantisation of the cases, the pages of codes, the two references
(dequantised cache: pass/fail within the profile; unquantised K/V: the
end-to-end error), the calls handing each wrapper the codes and scales (a
stand-in launch), the report's FP8 column and summary line, and the command's
selection, where configurations not generated for FP8 are skipped rows; on a
GPU, the FP8 configurations the GPU tests build and MLA over an FP8 cache, measured
within their profiles (MLA's CPU tests: test_numerics_mla_fp8.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types

import pytest
import torch

import flashjit
from flashjit import cli, numerics, selection, spec as spec_module
from flashjit.numerics import cases, report, runner
from flashjit.reference import ragged_reference
from flashjit.spec import KernelSpec
import helpers_cache
from helpers_cache import REPO, subprocess_env
from test_numerics_cli import ROWS, draw, recording_gpu, row

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = {E4M3: (448.0, 2.0**-4), E5M2: (57344.0, 2.0**-3)}  # largest finite value, unit roundoff
# The FP8 families before tensor-core FP8: decode on CUDA cores and the append. The CLI
# tests pin them, so that what is skipped does not move as more families are generated.
CUDA_CORE_FAMILIES = (("single_decode", False), ("batch_decode_paged", False), ("append_paged", False))
# A fixture: pytest looks fixtures up by name in the test module.
no_compile = helpers_cache.no_compile


def fp8_draw(case, op, kv_dtype=E4M3, dtype=torch.bfloat16, seed=3, head_dim=64):
    return cases.make_problems(case, op, head_dim, dtype, generator=torch.Generator().manual_seed(seed),
                               device="cpu", kv_dtype=kv_dtype)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


# ---------------------------------------------------------------------------
# The quantisation and the cases


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=str)
def test_quantise_scales_amax_to_the_largest_code(kv_dtype):
    largest, u = FP8[kv_dtype]
    x = (torch.randn(300, 2, 64, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    codes, scale = cases.quantise(x, kv_dtype)
    amax = float(x.abs().amax())
    assert codes.dtype == kv_dtype and codes.shape == x.shape
    assert scale == f32(amax / largest)
    assert float(codes.float().abs().max()) == largest, "amax lands on the largest finite code"
    deq, exact = codes.double() * scale, x.double()
    normal = exact.abs() >= scale * 2.0**-6  # above both formats' smallest normal code
    assert bool(((deq - exact).abs() <= u * exact.abs() * (1 + 2**-10))[normal].all())
    assert cases.quantise(torch.zeros(4, 2), kv_dtype)[1] == 1.0


@pytest.mark.parametrize("op", ["single_prefill", "single_decode", *cases.BATCH_OPS])
def test_fp8_problems_quantise_the_draw_of_q_dtype(op):
    for case in ("normal", "v_outliers", "near_empty"):
        plain, fp8 = draw(case, op, dtype=torch.bfloat16)[0], fp8_draw(case, op)[0]
        assert not plain.fp8 and fp8.fp8
        assert torch.equal(fp8.q, plain.q), "quantising draws no random numbers"
        assert torch.equal(fp8.k_full, plain.k) and torch.equal(fp8.v_full, plain.v)
        assert fp8.k.dtype == fp8.v.dtype == E4M3 and fp8.k_full.dtype == torch.bfloat16
        assert fp8.k_scale == f32(float(plain.k.abs().amax()) / 448)
        assert fp8.v_scale == f32(float(plain.v.abs().amax()) / 448)
        k, v = fp8.dequantised()
        assert k.dtype == torch.float64 and torch.equal(v, fp8.v.double() * fp8.v_scale)


def test_fp8_pages_hold_the_codes_byte_for_byte():
    p = fp8_draw("near_empty", "batch_decode_paged", E5M2)[0]
    pages = cases.paged(p, torch.Generator().manual_seed(0), page_size=2)
    assert pages.cache.dtype == E5M2
    kv_indptr = cases.indptr(p.kv_lens)
    for r, n in enumerate(p.kv_lens):
        ids = pages.indices[int(pages.indptr[r]):int(pages.indptr[r + 1])].long()
        for half, codes in ((0, p.k), (1, p.v)):
            got = pages.cache[ids, half].reshape(-1, *codes.shape[1:])[:n].view(torch.uint8)
            assert torch.equal(got, codes[kv_indptr[r]:kv_indptr[r] + n].view(torch.uint8))


# ---------------------------------------------------------------------------
# The references, the bound and the statistics


def fp8_spec(op="batch_decode_paged", kv_dtype="float8_e4m3fn", **flags):
    flags.setdefault("return_lse", op == "batch_decode_paged")
    return KernelSpec.make(op, "bfloat16", 64, dtype_kv=kv_dtype, **flags)


def test_the_reference_is_over_the_dequantised_cache_and_the_other_over_the_unquantised():
    spec = fp8_spec()
    p = fp8_draw("normal", spec.op)[0]
    ref, ref_lse = runner.reference(spec, p)
    k, v = p.dequantised()
    lens = (cases.indptr(p.qo_lens), cases.indptr(p.kv_lens))
    expected, expected_lse = ragged_reference(p.q, k, v, *lens)
    assert torch.equal(ref, expected) and torch.equal(ref_lse, expected_lse)
    unquantised, _ = runner.reference(spec, p, unquantised=True)
    assert torch.equal(unquantised, ragged_reference(p.q, p.k_full, p.v_full, *lens)[0])
    assert float((unquantised - ref).abs().max()) > 1e-3, "e4m3 moves the output by more than bf16 rounding"


def test_the_bound_is_the_profiles_over_the_dequantised_values():
    spec = fp8_spec()
    p = fp8_draw("v_outliers", spec.op)[0]
    _, tol, _ = runner.bounds(spec, p)
    api = flashjit.tolerance(spec, q=p.q, k=p.k, v=p.v, k_scale=p.k_scale, v_scale=p.v_scale,
                             kv_len=max(p.kv_lens), sm_scale=64**-0.5)
    assert (tol.rtol, tol.atol) == (api.rtol, api.atol)
    plain = flashjit.tolerance(spec.replace(dtype_kv="bfloat16"), q=p.q, k=p.k_full, v=p.v_full,
                               kv_len=max(p.kv_lens), sm_scale=64**-0.5)
    assert tol.rtol > plain.rtol, "the profile's FP8 term (v_scale's rounding)"


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_accumulator_passes_on_the_kernel_error_and_reports_the_end_to_end_one(kv_dtype):
    spec = fp8_spec(kv_dtype=kv_dtype)
    p = fp8_draw("normal", spec.op, getattr(torch, kv_dtype))[0]
    ref, ref_lse = runner.reference(spec, p)
    unquantised, _ = runner.reference(spec, p, unquantised=True)
    acc = runner.Accumulator()
    acc.add(spec, p, ref.to(torch.bfloat16), ref_lse.float(), ref, ref_lse, kv_chunk=0, ref_unquantised=unquantised)
    good = acc.row()
    assert good["status"] == "ok" and 0 < good["ratio"] <= 1 and good["lse_ratio"] <= 1
    assert "data_ratio" not in good, "the data-dependent bound does not model the scales"
    e2e = (ref.to(torch.bfloat16).double() - unquantised).abs()
    assert good["e2e_max_err"] == pytest.approx(float(e2e.max())) and good["e2e_max_err"] > good["max_err"]
    assert 0 < good["e2e_mean_err"] <= good["e2e_p999_err"] <= good["e2e_max_err"]
    bad = runner.Accumulator()
    bad.add(spec, p, ref + 3 * good["atol"], ref_lse.float(), ref, ref_lse, ref_unquantised=unquantised)
    assert bad.row()["status"] == "over"


def test_scale_keywords_of_each_op():
    p = fp8_draw("normal", "single_prefill")[0]
    assert runner._scales(p) == {"k_scale": p.k_scale, "v_scale": p.v_scale}
    assert runner._scales(draw("normal", "single_prefill")[0]) == {}
    names = runner._single_prefill_scale_names()
    import inspect
    assert set(names) <= set(inspect.signature(flashjit.single_prefill_with_kv_cache).parameters)


@pytest.mark.parametrize("op", cases.BATCH_OPS)
def test_run_op_hands_each_wrapper_the_codes_their_dtype_and_the_scales(op, no_compile, monkeypatch):
    """The wrappers planned on the host (a stand-in kernel module and launch): the
    plan is for the FP8 cache, and the launch gets the codes and the problem's scales."""
    from flashjit import jit
    from flashjit.ops import _batch
    from test_bad_input_wrappers import _workspace

    monkeypatch.setattr(jit, "get_module", lambda spec: types.SimpleNamespace(spec=spec, rows_per_cta=64,
                                                                               split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    monkeypatch.setattr(runner, "poison_allocator", lambda: None)
    launched = []

    def launch(self, q, k, v, k_strides, v_strides, out, lse, v_offset=0, scales=None):
        launched.append((k.dtype, v.dtype, tuple(s.value for s in scales)))
        out.zero_()
        lse.zero_()
    monkeypatch.setattr(_batch.BatchAttention, "_launch", launch)
    for name in ("BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
                 "BatchPrefillWithRaggedKVCacheWrapper"):
        class OnTheHost(getattr(flashjit, name)):
            def __init__(self, workspace, *args, **kwargs):
                super().__init__(_workspace(), *args, **kwargs)
                self._device = torch.device("cpu")  # the plan's metadata stays on the host
        monkeypatch.setattr(flashjit, name, OnTheHost)
    tc = op != "batch_decode_paged"
    spec = fp8_spec(op, "float8_e5m2", use_tensor_cores=tc, causal=tc, return_lse=True)
    generator = torch.Generator().manual_seed(0)
    p = runner.problems(spec, "normal", generator, device="cpu")[0]
    out, lse, _ = runner.run_op(spec, p, None, generator)
    assert launched == [(E5M2, E5M2, (p.k_scale, p.v_scale))] and out.shape == p.q.shape and lse is not None


# ---------------------------------------------------------------------------
# Skipped configurations and the report


def test_not_generated_configurations_are_skipped_rows():
    prefill = KernelSpec.make("single_prefill", "bfloat16", 128, dtype_kv="float8_e5m2")
    skipped = numerics.not_generated_row(prefill)
    assert skipped["status"] == "skipped" and skipped["kv_dtype"] == "float8_e5m2" and skipped["case"] == "-"
    assert skipped["reason"] == "an FP8 KV cache for CUDA-core single_prefill is not yet generated"
    assert numerics.not_generated_row(fp8_spec()) is None
    with pytest.raises(ValueError, match="FP8 KV cache with dtype_q=float32"):
        numerics.not_generated_row(KernelSpec.make("single_decode", "float32", 64, dtype_kv="float8_e4m3fn"))


FP8_ROW = row("batch_decode_paged_bf16_kve4m3_d128_fa2_cc_lse", "peaked", 0.4, kv_dtype="float8_e4m3fn",
              e2e_max_err=3.1e-2, e2e_p999_err=1e-2, e2e_mean_err=2e-3)
SKIPPED_FP8 = {"config": "single_prefill_bf16_kve4m3_d128_fa2_tc", "op": "single_prefill", "dtype": "bfloat16",
               "kv_dtype": "float8_e4m3fn", "case": "-", "status": "skipped",
               "reason": "an FP8 KV cache for tensor-core single_prefill is not yet generated"}


def test_the_table_has_an_fp8_column_only_with_fp8_rows():
    plain = report.table(ROWS).splitlines()
    assert "FP8" not in plain[0] and plain[0].count("|") == 10
    lines = report.table(ROWS + [FP8_ROW, SKIPPED_FP8]).splitlines()
    assert lines[0].count("|") == 11 and "| FP8: max err vs unquantised K/V |" in lines[0]
    assert all(line.count("|") == 11 for line in lines)
    assert lines[-2].endswith("| 0.400 | - | 3.10e-02 | ok |")
    assert lines[2].endswith("| - | ok |"), "a row without an FP8 cache has no end-to-end error"
    assert lines[-1].endswith("| - | skipped: an FP8 KV cache for tensor-core single_prefill is not yet generated |")


def test_summary_groups_fp8_apart_and_states_its_cost():
    rows = ROWS + [FP8_ROW, SKIPPED_FP8]
    text = "\n".join(report.summary(rows))
    assert "bf16 cc 0.010; 0.010, bf16 fa2 0.600; 0.600, bf16/e4m3 cc 0.400; 0.400" in text
    assert "FP8 end to end (max err against float64 over the unquantised K/V, no bound" in text
    assert "bf16/e4m3 cc 3.10e-02 (4.00e-03)" in text
    assert "2 configuration(s) skipped" in text and report.exit_code(rows) == 0
    assert "FP8 KV caches: ref is over the dequantised cache" in report.markdown({"meta": {}, "rows": rows})
    assert "FP8" not in report.markdown({"meta": {}, "rows": ROWS})


# ---------------------------------------------------------------------------
# The command


@pytest.fixture
def cli_without_gpu(tmp_path, monkeypatch):
    """The command's wiring on the CPU: GPU, build and measurement replaced; the FP8
    families pinned to CUDA_CORE_FAMILIES. Returns what was built and measured."""
    for module in (spec_module, selection):
        monkeypatch.setattr(module, "FP8_KV_FAMILIES", CUDA_CORE_FAMILIES)
    return recording_gpu(monkeypatch, tmp_path, lambda s: {**FP8_ROW, "config": s.name})


def test_kv_dtype_measures_the_fp8_configurations_and_skips_the_rest(cli_without_gpu, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    code = cli.main(["numerics", "--op", "single_prefill", "batch_decode_paged", "append_paged", "--dtype", "bf16",
                     "--head-dim", "128", "--kv-dtype", "fp8_e4m3", "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    decode = "batch_decode_paged_bf16_kve4m3_d128_fa2_cc_lse"
    assert cli_without_gpu == {"built": [decode], "measured": [decode]}
    rows = json.loads(out_json.read_text())["rows"]
    skipped = {r["config"]: r["reason"] for r in rows if r["status"] == "skipped"}
    assert skipped == {f"single_prefill_bf16_kve4m3_d128_fa2_tc{c}": "an FP8 KV cache for tensor-core single_prefill "
                       "is not yet generated" for c in ("", "_causal")}
    assert "1 append_paged left out" in err and "2 FP8 configuration(s) skipped (not generated yet)" in err
    assert f"| {decode} | peaked | 3 |" in out and "| 3.10e-02 | ok |" in out
    assert err.strip().splitlines()[-1] == ("flashjit numerics: every case within its bound (1 measured); "
                                            "2 configuration(s) skipped")


def test_kv_dtype_with_nothing_generated_reports_skipped_rows_and_exits_0(cli_without_gpu, capsys):
    code = cli.main(["numerics", "--op", "single_prefill", "--dtype", "fp16", "--head-dim", "64", "--kv-dtype",
                     "e5m2", "--causal", "on"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert cli_without_gpu == {"built": [], "measured": []}
    assert "| single_prefill_f16_kve5m2_d64_fa2_tc_causal | - | - |" in out and "not yet generated" in out


def test_a_bad_kv_dtype_is_exit_2_before_any_gpu_probe(tmp_path):
    run = subprocess.run([sys.executable, "-m", "flashjit", "numerics", "--kv-dtype", "float8_e4m3fnuz"], cwd=REPO,
                         env=subprocess_env(tmp_path / "cache", CUDA_VISIBLE_DEVICES=""), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert "--kv-dtype: float8_e4m3fnuz is not an FP8 KV-cache dtype (another platform's FP8 format)" in run.stderr


# ---------------------------------------------------------------------------
# On a GPU: configurations the prewarmed sweep builds (tests/sweep.py fp8_specs)


def _gpu_selection(*argv) -> list[KernelSpec]:
    """The numerics selection of argv for this GPU, less what the GPU sweep does not build."""
    from flashjit import arch
    from sweep import fp8_specs

    try:
        specs = cli.specs_from_args(cli.build_parser().parse_args(["numerics", *argv]), (arch.device_arch(),))
    except selection.SelectionError:  # nothing of it is generated for FP8 yet
        return []
    return [s for s in specs if s in set(fp8_specs())]


def check_gpu_rows(specs, cases_run, kv_dtype: str) -> None:
    rows = numerics.measure(specs, cases_run, seeds=1)
    assert {r["config"] for r in report.measured(rows)} == {s.name for s in specs}
    for r in rows:
        assert r["status"] == "ok" and r["kv_dtype"] == kv_dtype, r
        assert 0 <= r["ratio"] <= 1 and r["nan"] == 0
        # A row of one visible key can come out exact (e5m2 codes times v_scale land on the
        # output's grid); every other case must show the kernel's error, or the check is vacuous.
        assert r["max_err"] > 0 or r["case"] == "near_empty", r
        # What FP8 costs is above what the kernel adds: quantising moves K/V by up to 2^-4 (e4m3) of themselves.
        assert r["max_err"] < r["e2e_max_err"] < math.inf and r["e2e_mean_err"] <= r["e2e_max_err"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_gpu_fp8_cuda_core_decode_within_its_profile(prewarmed, kv_dtype):
    specs = _gpu_selection("--op", "single_decode", "batch_decode_paged", "--dtype", "bf16", "--head-dim", "128",
                           "--tensor-cores", "off", "--kv-dtype", kv_dtype)
    assert len(specs) == 2
    check_gpu_rows(specs, ["normal", "v_outliers", "skewed", "near_empty"], kv_dtype)


@pytest.mark.gpu
def test_gpu_fp8_tensor_core_configurations_within_their_profiles(prewarmed):
    specs = _gpu_selection("--op", "single_prefill", "batch_prefill_ragged", "batch_prefill_paged",
                           "batch_decode_paged", "--dtype", "fp16", "--head-dim", "64", "--tensor-cores", "on",
                           "--backend", "fa2", "--kv-dtype", "e4m3")
    if not specs:
        pytest.skip("no tensor-core FP8 configuration is generated yet")
    check_gpu_rows(specs, ["normal", "peaked", "near_empty"], "float8_e4m3fn")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_gpu_fp8_mla_within_its_profile(kv_dtype):
    """MLA over an FP8 ckv / kpe cache (fa3 on sm_90a, fa2 elsewhere)."""
    from flashjit import arch
    from sweep import build_for_gpu

    specs = cli.specs_from_args(cli.build_parser().parse_args(
        ["numerics", "--op", "mla_paged", "--dtype", "bf16", "fp16", "--kv-dtype", kv_dtype]), (arch.device_arch(),))
    assert len(specs) == 4 and {(s.op, s.dtype_kv) for s in specs} == {("mla_paged", kv_dtype)}
    build_for_gpu(specs)
    check_gpu_rows(specs, ["normal", "peaked", "v_outliers", "skewed", "near_empty"], kv_dtype)
