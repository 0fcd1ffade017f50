"""MLA (mla_paged) in `flashjit numerics`: the selection reaches the measurement,
the cases' lengths and inputs, the pages, the float64 reference over them, the
bound (the MLA error model's), and the statistics, on CPU tensors; on a GPU,
the MLA configurations within their bounds on every default case."""

from __future__ import annotations

import math
import types

import pytest
import torch

import flashjit
from flashjit import cli
from flashjit.error_model import evaluate_lse, measure_mla, mla_tolerance, profile
from flashjit.numerics import catalog, mla, runner
from flashjit.reference import attention_reference
from flashjit.spec import mla_spec
from test_numerics_cli import check_accumulator_bounds, fake_gpu, parse

SPECS = [mla_spec("bfloat16"), mla_spec("bfloat16", causal=True)]
FA3_SPECS = [mla_spec("bfloat16", backend="fa3"), mla_spec("float16", causal=True, backend="fa3")]
ALL_CASES = list(catalog.CASES)


def draw(case, spec=SPECS[0], dtype=torch.float32, seed=5, page_size=mla.PAGE_SIZE):
    return mla.make_problems(case, spec.causal, dtype, generator=torch.Generator().manual_seed(seed), device="cpu",
                             page_size=page_size)


def test_selection_is_measured(tmp_path, monkeypatch, capsys):
    """--op mla_paged selects one configuration per dtype and mask, all of which are built and measured."""
    seen = {}

    def build_many(specs, **kw):
        seen["built"] = [s.name for s in specs]
        return [types.SimpleNamespace(spec=s, error=None) for s in specs]

    def measure(specs, cases, seeds, seed=0, progress=None):
        seen["measured"] = [s.name for s in specs]
        return []

    fake_gpu(monkeypatch, tmp_path, build_many, measure)
    assert cli.main(["numerics", "--op", "mla_paged", "append_paged", "--dtype", "bf16"]) == 0
    names = [s.name for s in SPECS]
    assert seen == {"built": names, "measured": names}
    err = capsys.readouterr().err
    assert "flashjit numerics: 2 configuration(s) on Fake GPU" in err and "mla_paged left out" not in err
    assert cli.specs_from_args(parse("--op", "mla_paged", "--dtype", "bf16"), ("sm_80",)) == SPECS
    # On an H100/H200 the ops pick the fa3 kernel, and the default preset includes MLA there.
    fa3 = [s.replace(backend="fa3") for s in SPECS]
    assert cli.specs_from_args(parse("--op", "mla_paged", "--dtype", "bf16"), ("sm_90a",)) == fa3
    assert set(fa3) <= set(cli.specs_from_args(parse("--dtype", "bf16"), ("sm_90a",)))
    assert cli.main(["numerics", "--op", "append_paged", "--dtype", "bf16"]) == 2
    assert "no configuration this command measures (attention ops and mla_paged" in capsys.readouterr().err


def test_the_ops_run_exactly_the_selected_configurations(monkeypatch):
    """The selection check asks for the MLA geometry (V 512 wide), not head_dim_vo = 576;
    fa3 only where it runs (strict: never fa2 in its place)."""
    from flashjit import arch

    monkeypatch.setattr(arch, "backend_targets", lambda: ("sm_90a",))
    assert all(runner.not_runnable(s) is None for s in SPECS + FA3_SPECS + [mla_spec("float16")])
    monkeypatch.setattr(arch, "backend_targets", lambda: ("sm_89",))
    assert all(runner.not_runnable(s) is None for s in SPECS)
    assert all("fa3 needs wgmma" in runner.not_runnable(s) for s in FA3_SPECS)


@pytest.mark.parametrize("causal", [False, True], ids=["decode", "causal"])
def test_lengths_of_each_case(causal):
    qo_len = mla.CAUSAL_QO if causal else 1
    assert mla.CAUSAL_QO > 1
    for case in ALL_CASES:
        assert mla.applies(case) and runner.applies_to(case, SPECS[causal])
        (qo, kv), = mla.shapes(case, causal)
        assert len(qo) == len(kv) and (qo[-1], kv[-1]) == (qo_len, 0)  # the request with no keys
        if case != "near_empty" or not causal:
            assert set(qo) == {qo_len}
    assert mla.shapes("long", causal)[0][1][0] == catalog.LONG_KV
    assert mla.shapes("long128k", causal)[0][1][0] == catalog.LONG_KV_MAX
    skewed = mla.shapes("skewed", causal)[0][1]
    assert max(skewed) >= 32 * sorted(skewed)[len(skewed) // 2] and len(skewed) >= 16
    normal = mla.shapes("normal", causal)[0][1]
    assert {mla.PAGE_SIZE - 1, mla.PAGE_SIZE, mla.PAGE_SIZE + 1, 1} <= set(normal)
    qo, kv = mla.shapes("near_empty", causal)[0]
    assert 1 in kv[:-1] and qo.count(1) >= 2
    if causal:  # many queries against one key: all but the last see none
        assert any(q > 1 and k == 1 for q, k in zip(qo, kv))
    assert mla.shapes("bogus", causal) == []


@pytest.mark.parametrize("spec", SPECS, ids=["decode", "causal"])
def test_problems_hold_each_requests_rows_in_their_pages(spec):
    for case in ("normal", "near_empty", "skewed"):
        (p,) = draw(case, spec, dtype=torch.bfloat16, page_size=16)
        tokens, keys = sum(p.qo_lens), sum(p.kv_lens)
        assert (p.q_nope.shape, p.q_pe.shape) == ((tokens, mla.HEADS, 512), (tokens, mla.HEADS, 64))
        assert (p.ckv.shape, p.kpe.shape) == ((keys, 512), (keys, 64))
        assert {t.dtype for t in (p.q_nope, p.q_pe, p.ckv, p.kpe, p.ckv_cache, p.kpe_cache)} == {torch.bfloat16}
        pages = [math.ceil(n / 16) for n in p.kv_lens]
        assert p.kv_indptr.tolist() == [sum(pages[:i]) for i in range(len(pages) + 1)]
        assert p.ckv_cache.shape == (sum(pages) + 3, 16, 512) and p.kpe_cache.shape[1:] == (16, 64)
        assert len(set(p.kv_indices.tolist())) == p.kv_indices.numel() == sum(pages)
        start = 0
        for r, n in enumerate(p.kv_lens):
            ids = p.kv_indices[int(p.kv_indptr[r]):int(p.kv_indptr[r + 1])].long()
            assert torch.equal(p.ckv_cache[ids].reshape(-1, 512)[:n], p.ckv[start:start + n])
            assert torch.equal(p.kpe_cache[ids].reshape(-1, 64)[:n], p.kpe[start:start + n])
            start += n


def test_peaked_scales_the_queries_and_outliers_scale_ckv_rows():
    normal, peaked, outl = (draw(case)[0] for case in ("normal", "peaked", "v_outliers"))
    assert torch.equal(peaked.q_nope, normal.q_nope * catalog.PEAKED_SCALE)
    assert torch.equal(peaked.q_pe, normal.q_pe * catalog.PEAKED_SCALE)
    assert torch.equal(peaked.ckv, normal.ckv) and torch.equal(peaked.kpe, normal.kpe)
    ratio = outl.ckv / normal.ckv.where(normal.ckv != 0, 1.0)
    scaled = (ratio - catalog.OUTLIER_SCALE).abs().amax(-1) < 1e-4  # whole 512-wide rows
    kept = (ratio - 1).abs().amax(-1) < 1e-6
    assert int(scaled.sum()) == outl.outlier_rows == max(1, round(catalog.OUTLIER_FRACTION * normal.ckv.shape[0]))
    assert bool((scaled | kept).all())
    assert torch.equal(outl.kpe, normal.kpe) and torch.equal(outl.q_nope, normal.q_nope)


@pytest.mark.parametrize("spec", SPECS, ids=["decode", "causal"])
def test_reference_over_the_pages_is_attention_over_the_packed_rows(spec):
    """mla_reference on the paged cache against attention_reference on [ckv | kpe] per request."""
    (p,) = draw("near_empty", spec, dtype=torch.bfloat16, page_size=2)
    ref, ref_lse = runner.reference(spec, p)
    qs = ks = 0
    for qo, kv in zip(p.qo_lens, p.kv_lens):
        q = torch.cat([p.q_nope[qs:qs + qo], p.q_pe[qs:qs + qo]], dim=-1)
        k = torch.cat([p.ckv[ks:ks + kv], p.kpe[ks:ks + kv]], dim=-1)[:, None]
        o, lse = attention_reference(q, k, p.ckv[ks:ks + kv, None], causal=spec.causal, sm_scale=mla.SM_SCALE)
        assert torch.equal(ref[qs:qs + qo], o) and torch.equal(ref_lse[qs:qs + qo], lse)
        qs, ks = qs + qo, ks + kv
    assert ref.dtype == torch.float64 and ref.shape == p.q_nope.shape
    assert (ref_lse == -math.inf).any() and not ref.isnan().any()  # rows that see no key: 0 and LSE -inf


@pytest.mark.parametrize("spec", SPECS + [mla_spec("float16", causal=True)] + FA3_SPECS,
                         ids=["bf16", "bf16_causal", "f16", "fa3_bf16", "fa3_f16_causal"])
def test_bounds_are_mla_tolerance_at_the_rows_read(spec):
    (p,) = draw("v_outliers", spec, dtype=getattr(torch, spec.dtype_q))
    kv_len, tol, lse_tol = runner.bounds(spec, p)
    assert kv_len == max(p.kv_lens) == 2000
    assert tol == mla_tolerance(spec.dtype_q, kv_len=kv_len, q_nope=p.q_nope, q_pe=p.q_pe, ckv=p.ckv, kpe=p.kpe,
                                sm_scale=mla.SM_SCALE, backend=spec.backend)
    _, logit_absmax = measure_mla(p.q_nope, p.q_pe, p.ckv, p.kpe, mla.SM_SCALE)
    assert lse_tol == evaluate_lse(profile(spec), kv_len=kv_len, logit_absmax=logit_absmax)
    u = 2.0**-8 if spec.dtype_q == "bfloat16" else 2.0**-11
    assert tol.atol >= u * float(p.ckv.abs().max())  # the P rounding at max|ckv|, outliers included


@pytest.mark.parametrize("spec", SPECS, ids=["decode", "causal"])
def test_rounded_reference_is_within_its_bound_and_a_shift_past_it_is_not(spec):
    (p,) = draw("near_empty", spec, dtype=torch.bfloat16)
    ref, ref_lse = runner.reference(spec, p)
    check_accumulator_bounds(spec, p, ref, ref_lse)
    lse_off = runner.Accumulator()
    lse_off.add(spec, p, ref.to(torch.bfloat16), ref_lse.float() + 0.01, ref, ref_lse)
    assert lse_off.row()["status"] == "over" and lse_off.row()["lse_ratio"] > 1


@pytest.mark.parametrize("spec", SPECS + FA3_SPECS, ids=["decode", "causal", "fa3_decode", "fa3_f16_causal"])
def test_run_op_plans_the_problem(spec, monkeypatch, tmp_path):
    """run_op's plan() and run() arguments, without a GPU: a stand-in kernel module,
    and a launch that checks the plan and writes the rounded reference."""
    from types import SimpleNamespace

    from flashjit import arch, jit
    from flashjit.ops import _batch
    from helpers_cache import set_cache_env
    from test_bad_input_wrappers import _workspace

    set_cache_env(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(jit, "get_module", lambda s: SimpleNamespace(spec=s, rows_per_cta=16, split_align=64))
    monkeypatch.setattr(_batch, "resident_ctas", lambda module, device: 132)
    monkeypatch.setattr(runner, "poison_allocator", lambda: None)
    monkeypatch.setattr(arch, "backend_targets", lambda: ("sm_90a",))  # where fa3 runs

    class HostWrapper(flashjit.BatchMLAPagedAttentionWrapper):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._device = torch.device("cpu")  # the plan's metadata and page ids stay on the host
            seen.update(backend=self._backend, strict=self._strict)

    (p,) = draw("near_empty", spec, dtype=getattr(torch, spec.dtype_q))
    seen = {}

    def launch(self, q_nope, q_pe, ckv, kpe, out, lse):
        plan = self._plan
        seen.update(spec=plan.module.spec, tokens=plan.qo_tokens, heads=plan.num_qo_heads, page=plan.page_size,
                    scale=plan.scalars[0], max_page=plan.max_page, inputs=(q_nope, q_pe, ckv, kpe))
        ref, ref_lse = mla.reference(spec, p)
        out.copy_(ref)
        lse.copy_(ref_lse)
    monkeypatch.setattr(flashjit, "BatchMLAPagedAttentionWrapper", HostWrapper)
    monkeypatch.setattr(HostWrapper, "_launch_mla", launch)
    out, lse, kv_chunk = runner.run_op(spec, p, _workspace(), None)
    assert kv_chunk is None  # the data-dependent bound models the CUDA-core kernels only
    assert seen.pop("inputs") == (p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache)
    assert seen == {"backend": spec.backend, "strict": True, "spec": spec, "tokens": sum(p.qo_lens), "heads": mla.HEADS,
                    "page": mla.PAGE_SIZE, "scale": mla.SM_SCALE, "max_page": int(p.kv_indices.max())}
    acc = runner.Accumulator()
    acc.add(spec, p, out, lse, *runner.reference(spec, p))
    assert acc.row()["status"] == "ok" and acc.row()["lse_ratio"] <= 1


# ---------------------------------------------------------------------------
# On a GPU


@pytest.mark.gpu
def test_mla_configurations_within_their_bounds():
    from flashjit import arch

    # The backends the ops pick here (fa3 on sm_90a), and fa2 as well.
    specs = cli.specs_from_args(parse("--op", "mla_paged", "--dtype", "bf16", "fp16", "--backend", "auto", "fa2"),
                                (arch.device_arch(),))
    assert {s.op for s in specs} == {"mla_paged"} and len(specs) in (4, 8)
    backend = {s.name: s.backend for s in specs}
    assert all(r.error is None for r in flashjit.build_many(specs, raise_first=False))
    rows = flashjit.numerics.measure(specs, seeds=1)
    assert sorted((r["config"], r["case"]) for r in rows) == sorted(
        (s.name, c) for s in specs for c in catalog.DEFAULT_CASES)
    for r in rows:
        assert r["status"] == "ok", r
        assert r["calls"] == 1 and r["nan"] == 0 and 0 < r["ratio"] <= 1 and r["max_err"] > 0
        assert r["lse_ratio"] is not None and r["lse_ratio"] <= 1
        assert r["head_dim"] == 576 and r["path"] == backend[r["config"]]
