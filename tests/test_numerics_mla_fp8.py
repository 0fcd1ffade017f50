"""`flashjit numerics --op mla_paged --kv-dtype`: MLA over an FP8 cache on the CPU.
The per-tensor quantisation of ckv and kpe (a scale each, FlashInfer's ckv_scale /
kpe_scale), the pages of codes, the two references (dequantised cache: pass/fail
within the profile; unquantised ckv / kpe: the end-to-end error), the bound, the
wrapper call handed the codes and both scales (a stand-in launch), the report's
FP8 column for an MLA row, and the command's selection of the FP8 MLA
configurations (measured, none skipped). The GPU run: tests/test_numerics_fp8.py."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

import flashjit
from flashjit import cli, numerics
from flashjit.error_model import mla_tolerance
from flashjit.numerics import catalog, cases, mla, report, runner
from flashjit.ops import _scales
from flashjit.reference import attention_reference
from flashjit.spec import mla_spec
import helpers_cache
from test_numerics_cli import parse, recording_gpu, row
from test_numerics_fp8 import FP8, FP8_ROW, f32

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KV_NAMES = {E4M3: "float8_e4m3fn", E5M2: "float8_e5m2"}
no_compile = helpers_cache.no_compile  # a fixture, looked up by name


def draw(case, kv_dtype=None, causal=False, seed=5, page_size=16, dtype=torch.bfloat16):
    return mla.make_problems(case, causal, dtype, generator=torch.Generator().manual_seed(seed), device="cpu",
                             page_size=page_size, kv_dtype=kv_dtype)[0]


def fp8_mla(kv_dtype=E4M3, **kw):
    return mla_spec("bfloat16", dtype_kv=KV_NAMES[kv_dtype], **kw)


# ---------------------------------------------------------------------------
# The quantisation and the pages


@pytest.mark.parametrize("causal", [False, True], ids=["decode", "causal"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=str)
def test_fp8_problems_quantise_the_draw_of_q_dtype(kv_dtype, causal):
    largest, _ = FP8[kv_dtype]
    for case in ("normal", "v_outliers", "near_empty"):
        plain, p = draw(case, causal=causal), draw(case, kv_dtype, causal)
        assert not plain.fp8 and p.fp8
        assert torch.equal(p.q_nope, plain.q_nope) and torch.equal(p.q_pe, plain.q_pe), "quantising draws nothing"
        assert torch.equal(p.ckv_full, plain.ckv) and torch.equal(p.kpe_full, plain.kpe)
        assert torch.equal(p.kv_indices, plain.kv_indices) and torch.equal(p.kv_indptr, plain.kv_indptr)
        for codes, full, scale in ((p.ckv, p.ckv_full, p.ckv_scale), (p.kpe, p.kpe_full, p.kpe_scale)):
            assert codes.dtype == kv_dtype and codes.shape == full.shape and full.dtype == torch.bfloat16
            assert 0 < scale < math.inf and scale == f32(float(full.abs().amax()) / largest)
            assert float(codes.float().abs().max()) == largest, "amax lands on the largest finite code"
        ckv, kpe = p.dequantised()
        assert ckv.dtype == kpe.dtype == torch.float64
        assert torch.equal(ckv, p.ckv.double() * p.ckv_scale) and torch.equal(kpe, p.kpe.double() * p.kpe_scale)
        # The pages: the plain pages' values by the rows' scales, saturated at the format's largest code.
        for cache, plain_cache, scale in ((p.ckv_cache, plain.ckv_cache, p.ckv_scale),
                                          (p.kpe_cache, plain.kpe_cache, p.kpe_scale)):
            assert cache.dtype == kv_dtype and cache.shape == plain_cache.shape
            assert torch.equal(cache.view(torch.uint8), cases.fp8_codes(plain_cache, scale, kv_dtype).view(torch.uint8))
            assert float(cache.float().abs().max()) <= largest and bool(cache.float().isfinite().all())


def test_codes_saturate_at_the_formats_largest_value():
    for kv_dtype, (largest, _) in FP8.items():
        x = torch.tensor([1e9, -1e9, 3.0, math.inf])
        assert cases.fp8_codes(x, 1.0, kv_dtype).float().tolist() == [largest, -largest, 3.0, largest]


def test_fp8_pages_hold_the_codes_byte_for_byte():
    p = draw("near_empty", E5M2, causal=True, page_size=2)
    start = 0
    for r, n in enumerate(p.kv_lens):
        ids = p.kv_indices[int(p.kv_indptr[r]):int(p.kv_indptr[r + 1])].long()
        for cache, codes in ((p.ckv_cache, p.ckv), (p.kpe_cache, p.kpe)):
            got = cache[ids].reshape(-1, codes.shape[-1])[:n].view(torch.uint8)
            assert torch.equal(got, codes[start:start + n].view(torch.uint8))
        start += n


# ---------------------------------------------------------------------------
# The references and the bound


@pytest.mark.parametrize("causal", [False, True], ids=["decode", "causal"])
def test_the_reference_is_over_the_dequantised_cache_and_the_other_over_the_unquantised(causal):
    spec = fp8_mla(causal=causal)
    p = draw("near_empty", E4M3, causal, page_size=2)
    ref, ref_lse = runner.reference(spec, p)
    ckv, kpe = p.dequantised()
    qs = ks = 0
    for qo, kv in zip(p.qo_lens, p.kv_lens):
        q = torch.cat([p.q_nope[qs:qs + qo], p.q_pe[qs:qs + qo]], dim=-1)
        k = torch.cat([ckv[ks:ks + kv], kpe[ks:ks + kv]], dim=-1)[:, None]
        o, lse = attention_reference(q, k, ckv[ks:ks + kv, None], causal=causal, sm_scale=mla.SM_SCALE)
        assert torch.equal(ref[qs:qs + qo], o) and torch.equal(ref_lse[qs:qs + qo], lse)
        qs, ks = qs + qo, ks + kv
    # Over the unquantised rows: the 16-bit cache's reference on the same draw, bit for bit.
    plain_spec, plain = spec.replace(dtype_kv="bfloat16"), draw("near_empty", None, causal, page_size=2)
    unquantised, unquantised_lse = runner.reference(spec, p, unquantised=True)
    plain_ref, plain_lse = runner.reference(plain_spec, plain)
    assert torch.equal(unquantised, plain_ref) and torch.equal(unquantised_lse, plain_lse)
    assert float((unquantised - ref).abs().max()) > 1e-3, "e4m3 moves the output by more than bf16 rounding"


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=str)
def test_the_bound_is_the_profiles_over_the_dequantised_cache(kv_dtype):
    spec = fp8_mla(kv_dtype, causal=True)
    p = draw("v_outliers", kv_dtype, causal=True)
    kv_len, tol, _ = runner.bounds(spec, p)
    api = mla_tolerance("bfloat16", kv_len=kv_len, q_nope=p.q_nope, q_pe=p.q_pe, ckv=p.ckv, kpe=p.kpe,
                        sm_scale=mla.SM_SCALE, backend=spec.backend, dtype_kv=kv_dtype, ckv_scale=p.ckv_scale,
                        kpe_scale=p.kpe_scale)
    assert kv_len == 2000 and tol == api
    plain = mla_tolerance("bfloat16", kv_len=kv_len, q_nope=p.q_nope, q_pe=p.q_pe, ckv=p.ckv_full, kpe=p.kpe_full,
                          sm_scale=mla.SM_SCALE)
    assert tol.rtol > plain.rtol, "the profile's FP8 terms (ckv_scale's rounding)"


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=str)
def test_accumulator_passes_on_the_kernel_error_and_reports_the_end_to_end_one(kv_dtype):
    spec = fp8_mla(kv_dtype)
    p = draw("normal", kv_dtype)
    ref, ref_lse = runner.reference(spec, p)
    unquantised, _ = runner.reference(spec, p, unquantised=True)
    acc = runner.Accumulator()
    acc.add(spec, p, ref.to(torch.bfloat16), ref_lse.float(), ref, ref_lse, None, unquantised)
    good = acc.row()
    assert good["status"] == "ok" and 0 < good["ratio"] <= 1 and good["lse_ratio"] <= 1 and "data_ratio" not in good
    e2e = (ref.to(torch.bfloat16).double() - unquantised).abs()
    assert good["e2e_max_err"] == pytest.approx(float(e2e.max())) and good["e2e_max_err"] > good["max_err"]
    assert 0 < good["e2e_mean_err"] <= good["e2e_p999_err"] <= good["e2e_max_err"]
    bad = runner.Accumulator()
    bad.add(spec, p, ref + 3 * good["atol"], ref_lse.float(), ref, ref_lse, None, unquantised)
    assert bad.row()["status"] == "over"


# ---------------------------------------------------------------------------
# The call


@pytest.mark.parametrize("causal", [False, True], ids=["decode", "causal"])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=str)
def test_run_op_hands_the_wrapper_the_codes_and_both_scales(kv_dtype, causal, monkeypatch, tmp_path):
    """plan() for the FP8 cache, run() with the codes and ckv_scale / kpe_scale (a
    stand-in kernel module; a launch that records them and writes the dequantised
    reference), on sm_90a, where fa2 runs an FP8 MLA cache."""
    from flashjit import arch, jit
    from flashjit.ops import _batch
    from helpers_cache import set_cache_env
    from test_bad_input_wrappers import _workspace

    set_cache_env(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(jit, "get_module", lambda s: types.SimpleNamespace(spec=s, rows_per_cta=16, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    monkeypatch.setattr(runner, "poison_allocator", lambda: None)
    monkeypatch.setattr(arch, "backend_targets", lambda: ("sm_90a",))
    spec = fp8_mla(kv_dtype, causal=causal)
    generator = torch.Generator().manual_seed(2)
    (p,) = runner.problems(spec, "near_empty", generator, device="cpu")
    assert p.fp8 and p.ckv_cache.dtype == kv_dtype

    class HostWrapper(flashjit.BatchMLAPagedAttentionWrapper):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._device = torch.device("cpu")  # the plan's metadata and page ids stay on the host

    seen = []

    def launch(self, q_nope, q_pe, ckv, kpe, out, lse, scales=(_scales.UNIT, _scales.UNIT)):
        seen.append((self._plan.module.spec, ckv, kpe, scales))
        ref, ref_lse = mla.reference(spec, p)
        out.copy_(ref)
        lse.copy_(ref_lse)
    monkeypatch.setattr(flashjit, "BatchMLAPagedAttentionWrapper", HostWrapper)
    monkeypatch.setattr(HostWrapper, "_launch_mla", launch)
    out, lse, kv_chunk = runner.run_op(spec, p, _workspace(), generator)
    ((ran, ckv, kpe, scales),) = seen
    assert ran == spec and kv_chunk is None
    assert ckv is p.ckv_cache and kpe is p.kpe_cache
    assert scales == (_scales.ScaleArg(p.ckv_scale, 0), _scales.ScaleArg(p.kpe_scale, 0))
    assert p.ckv_scale != p.kpe_scale, "two scales, not one twice"
    acc = runner.Accumulator()
    acc.add(spec, p, out, lse, *runner.reference(spec, p), kv_chunk, runner.reference(spec, p, unquantised=True)[0])
    got = acc.row()
    assert got["status"] == "ok" and got["lse_ratio"] <= 1 and got["e2e_max_err"] > got["max_err"]


# ---------------------------------------------------------------------------
# The report and the command


MLA_ROW = {**row(case="v_outliers", ratio=0.3, lse_ratio=0.02, max_err=4e-3, e2e_max_err=6.2e-2,
                 e2e_p999_err=2e-2, e2e_mean_err=3e-3),
           **catalog.describe(fp8_mla())}


def test_the_table_and_summary_report_an_fp8_mla_row():
    lines = report.table([FP8_ROW, MLA_ROW]).splitlines()
    assert "| FP8: max err vs unquantised K/V |" in lines[0] and all(line.count("|") == 11 for line in lines)
    assert lines[-1].startswith("| mla_paged_bf16_kve4m3_qk576_vo512_fa2_tc_lse | v_outliers | 3 | 4.00e-03 |")
    assert lines[-1].endswith("| 0.300 | 0.020 | 6.20e-02 | ok |")
    text = "\n".join(report.summary([FP8_ROW, MLA_ROW]))
    assert "bf16/e4m3 cc 3.10e-02 (4.00e-03), bf16/e4m3 fa2 6.20e-02 (4.00e-03)" in text
    assert "ckv_scale / kpe_scale" in report.markdown({"meta": {}, "rows": [MLA_ROW]})


def test_fp8_mla_configurations_are_measured_not_skipped(no_compile, monkeypatch):
    """Selected (fa2; fa3 on sm_90a), generated, and run exactly by the ops: no
    configuration of them is a skipped row."""
    from flashjit import arch
    from flashjit.selectors import check_selectors

    for targets, backend in ((("sm_80",), "fa2"), (("sm_90a",), "fa3")):
        args = parse("--op", "mla_paged", "--dtype", "bf16", "fp16", "--kv-dtype", "e4m3", "e5m2")
        check_selectors(args)
        specs = cli.specs_from_args(args, targets)
        assert sorted(specs, key=lambda s: s.name) == sorted(
            (mla_spec(q, causal=c, dtype_kv=kv, backend=backend) for q in ("bfloat16", "float16")
             for c in (False, True) for kv in ("float8_e4m3fn", "float8_e5m2")), key=lambda s: s.name)
        assert numerics.fp8_left_out(args, targets, specs) == []
        monkeypatch.setattr(arch, "backend_targets", lambda: targets)
        assert all(numerics.not_generated_row(s) is None and runner.not_runnable(s) is None for s in specs)


def test_the_command_builds_and_measures_fp8_mla(tmp_path, monkeypatch, capsys):
    seen = recording_gpu(monkeypatch, tmp_path, lambda s: {**MLA_ROW, **catalog.describe(s)})
    out_json = tmp_path / "r.json"
    code = cli.main(["numerics", "--op", "mla_paged", "--dtype", "bf16", "--kv-dtype", "e4m3", "e5m2",
                     "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    names = [f"mla_paged_bf16_kv{kv}_qk576_vo512_fa2_tc{c}_lse" for kv in ("e4m3", "e5m2") for c in ("", "_causal")]
    assert sorted(seen["built"]) == sorted(seen["measured"]) == sorted(names)
    assert "flashjit numerics: 4 configuration(s) on Fake GPU" in err and "skipped" not in err
    rows = json.loads(out_json.read_text())["rows"]
    assert {r["status"] for r in rows} == {"ok"} and {r["kv_dtype"] for r in rows} == {"float8_e4m3fn", "float8_e5m2"}
    assert f"| {names[0]} | v_outliers | 3 |" in out and "| 6.20e-02 | ok |" in out
    assert "bf16/e4m3 fa2 6.20e-02" in out and "bf16/e5m2 fa2 6.20e-02" in out
