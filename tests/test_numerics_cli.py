"""`flashjit numerics` and flashjit.numerics: its arguments and selection, its
one-line error without a GPU, the reports and the exit status from synthetic
rows, the case generators and the error statistics on CPU tensors, and on a GPU
a small selection end to end within its bounds (MLA's: test_numerics_mla.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types
from unittest import mock

import pytest
import torch

import flashjit
from flashjit import cli, numerics
from flashjit.numerics import cases, catalog, report, runner
from flashjit.spec import ATTENTION_OPS, KernelSpec
from helpers_cache import REPO, subprocess_env

SMALL = ["--op", "single_prefill", "batch_decode_paged", "append_paged", "--dtype", "bf16", "--head-dim", "128"]


def parse(*argv):
    return cli.build_parser().parse_args(["numerics", *argv])


def test_arguments():
    args = parse()
    assert (args.cases, args.seeds, args.seed, args.long, args.json, args.plot, args.out, args.arch) == \
        (None, 3, 0, False, None, None, None, None)
    assert args.func is cli.cmd_numerics
    args = parse("--cases", "peaked", "skewed", "--seeds", "5", "--long", "--json", "r.json", "--plot", "r.png",
                 "--out", "r.md", "--seed", "7")
    assert (args.cases, args.seeds, args.seed, args.long, args.json, args.plot, args.out) == \
        (["peaked", "skewed"], 5, 7, True, "r.json", "r.png", "r.md")


@pytest.mark.parametrize("argv", [["--cases", "bogus"], ["--seeds", "0"], ["--arch", "sm_80"]])
def test_bad_arguments_exit_2(argv, capsys):
    """--arch too: the measurement runs this GPU's backends, whatever the cache is built for.
    (A bad selector value is checked after parsing: test_cli_input.py.)"""
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("arch,backend", [("sm_90a", "fa3"), ("sm_80", "fa2")])
def test_selection_is_prewarms(arch, backend):
    """The same selectors select the same configurations as prewarm for one target arch."""
    specs = cli.specs_from_args(parse(*SMALL), (arch,))
    assert specs == cli.specs_from_args(cli.build_parser().parse_args(["prewarm", *SMALL]), (arch,))
    assert [s.name for s in specs] == [f"single_prefill_bf16_d128_{backend}_tc",
                                       f"single_prefill_bf16_d128_{backend}_tc_causal",
                                       "batch_decode_paged_bf16_d128_fa2_cc_lse", "append_paged_bf16_d128"]


def test_case_list():
    assert numerics.case_list() == list(catalog.DEFAULT_CASES) and "long128k" not in catalog.DEFAULT_CASES
    assert numerics.case_list(["skewed", "normal"], long=True) == ["normal", "long128k", "skewed"]
    with pytest.raises(ValueError, match="bogus"):
        numerics.case_list(["bogus"])


def test_no_gpu_is_one_line_and_exit_2(tmp_path):
    """CUDA_VISIBLE_DEVICES='' hides any GPU, so this runs the same everywhere."""
    report_file = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "flashjit", "numerics", "--json", str(report_file)], cwd=REPO,
                         env=subprocess_env(tmp_path / "cache", CUDA_VISIBLE_DEVICES=""), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if "NumPy" not in line and "_conversion_method" not in line]
    assert len(lines) == 1 and lines[0].startswith("flashjit numerics: ") and "GPU" in lines[0], run.stderr
    assert run.stdout == "" and not report_file.exists() and not (tmp_path / "cache").exists()


def row(config="single_prefill_bf16_d128_fa2_tc", case="normal", ratio=0.2, status=None, **extra):
    """A synthetic measured row as runner.measure_spec writes one; op, dtype and path read off the name."""
    op = next(op for op in ATTENTION_OPS if config.startswith(op))
    dtype = "float32" if "_f32_" in config else "bfloat16"
    path = "cc" if "_cc" in config else "fa3" if "_fa3_" in config else "fa2"
    base = {"config": config, "op": op, "dtype": dtype, "head_dim": 128, "path": path, "causal": False,
            "window": False, "soft_cap": False, "case": case, "seeds": 3, "calls": 3, "elements": 1000,
            "max_err": 2e-3 * ratio * 5, "p999_err": 1e-3, "mean_err": 1e-4, "ratio": ratio, "lse_ratio": None,
            "nan": 0, "worst_err": 1e-3 * ratio, "worst_bound": 1e-3, "atol": 5e-4, "rtol": 4e-3, "kv_len": 1024,
            "seconds": 0.1, "status": status or ("over" if ratio > 1 else "ok")}
    return {**base, **extra}


ROWS = [row(case="normal", ratio=0.3), row(case="peaked", ratio=0.6, lse_ratio=0.01),
        row("batch_decode_paged_bf16_d128_fa2_cc_lse", "skewed", 0.01),
        {**catalog.describe(KernelSpec.make("single_prefill", "bfloat16", 128, backend="fa3", use_tensor_cores=True)),
         "case": "-", "status": "skipped", "reason": "backend='fa3' cannot run here"}]


def test_table_has_a_row_per_case_and_the_numbers():
    lines = report.table(ROWS).splitlines()
    assert len(lines) == 2 + len(ROWS)
    peaked = next(line for line in lines if "| peaked |" in line)
    assert peaked.startswith("| single_prefill_bf16_d128_fa2_tc | peaked | 3 | 6.00e-03 | 1.00e-03 | 1.00e-04 | "
                             "0.600 | 0.010 | ok |"), peaked
    assert "| skipped: backend='fa3' cannot run here |" in lines[-1]


def test_summary_names_loose_and_worst_by_dtype_and_path():
    text = "\n".join(report.summary(ROWS))
    assert "3 (configuration, case) rows measured, 1 configuration(s) skipped, 0 error(s); over the bound: 0" in text
    # Decode's only case reached 1/100 of its bound: looser than 20x; prefill's worst is 0.6.
    assert "LOOSE batch_decode_paged_bf16_d128_fa2_cc_lse: worst err/bound 0.010 (skewed)" in text
    assert "bf16 cc 0.010; 0.010, bf16 fa2 0.600; 0.600" in text
    assert report.exit_code(ROWS) == 0


@pytest.mark.parametrize("bad", [row(case="v_outliers", ratio=1.3),
                                 row(case="long", ratio=0.5, lse_ratio=1.01, status="over"),
                                 row(case="near_empty", ratio=math.inf, nan=4, status="over"),
                                 {**row(case="long"), "status": "error", "reason": "RuntimeError: boom"}])
def test_any_case_over_its_bound_or_failed_exits_1_and_is_named(bad, capsys):
    rows = ROWS + [bad]
    assert report.exit_code(rows) == 1
    assert numerics.final_status(rows) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"single_prefill_bf16_d128_fa2_tc ({bad['case']}, {bad['status']})" in last
    tag = "ERROR" if bad["status"] == "error" else "OVER "
    assert any(line.startswith(f"{tag} single_prefill_bf16_d128_fa2_tc {bad['case']}") for line in report.summary(rows))


def test_within_bounds_exits_0_with_a_count(capsys):
    assert numerics.final_status(ROWS) == 0
    assert "every case within its bound (3 measured)" in capsys.readouterr().err


def test_json_round_trip(tmp_path):
    results = {"meta": {"device": "test"}, "rows": ROWS + [row(case="near_empty", ratio=math.inf, nan=2)]}
    report.write_json(results, tmp_path / "r.json")
    back = report.read_json(tmp_path / "r.json")
    assert back == results and back["rows"][-1]["ratio"] == math.inf


def test_plot_without_matplotlib_is_a_message_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert report.write_png(ROWS, tmp_path / "p.png") == report.MATPLOTLIB_MISSING
    assert not (tmp_path / "p.png").exists()


def test_plot_draws_a_panel_per_dtype_and_a_series_per_path(tmp_path, monkeypatch):
    rows = ROWS + [row("single_prefill_f32_d128_fa2_cc", ratio=0.1), row(case="long", ratio=0.0, worst_err=0.0)]
    points = report.plot_points(rows)
    assert sorted(points) == ["bf16", "fp32"] and sorted(points["bf16"]) == ["cc", "fa2"]
    # The zero error is left out.
    assert [p for xy in points["bf16"]["fa2"] for p in xy] == pytest.approx([1e-3, 3e-4, 1e-3, 6e-4])
    plt = mock.MagicMock()
    fig, axes = mock.MagicMock(), [[mock.MagicMock(), mock.MagicMock()]]
    plt.subplots.return_value = (fig, axes)
    fake = types.ModuleType("matplotlib")
    fake.use = mock.MagicMock()
    fake.pyplot = plt
    monkeypatch.setitem(sys.modules, "matplotlib", fake)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    assert report.write_png(rows, tmp_path / "p.png") is None
    fig.savefig.assert_called_once_with(tmp_path / "p.png", dpi=110)
    assert [c.kwargs["label"] for c in axes[0][0].scatter.call_args_list] == ["cc", "fa2"]
    assert [c.kwargs["label"] for c in axes[0][1].scatter.call_args_list] == ["cc"]


def fake_gpu(monkeypatch, tmp_path, build_many, measure) -> None:
    """`flashjit numerics` on CPU: a stand-in sm_80 GPU, the cache under tmp_path, and
    build_many / measure (jit's and numerics') replaced by the caller's."""
    import flashjit.bench
    from flashjit import arch, jit

    monkeypatch.setenv("FLASHJIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(flashjit.bench, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(arch, "device_arch", lambda: "sm_80")
    monkeypatch.setattr(arch, "device_name", lambda: "Fake GPU")
    monkeypatch.setattr(jit, "build_many", build_many)
    monkeypatch.setattr(numerics, "measure", measure)
    monkeypatch.setattr(numerics, "_meta", lambda args, seeds: {"device": "Fake GPU", "seeds": seeds})


def recording_gpu(monkeypatch, tmp_path, rows_for) -> dict:
    """fake_gpu whose build and measurement succeed and record the names they
    were given, in {"built": [...], "measured": [...]}; rows_for(spec): the
    row measured for each configuration."""
    seen = {"built": [], "measured": []}

    def build_many(specs, **kw):
        seen["built"] += [s.name for s in specs]
        return [types.SimpleNamespace(spec=s, error=None) for s in specs]

    def measure(specs, cases, seeds, seed=0, progress=None):
        seen["measured"] += [s.name for s in specs]
        return [rows_for(s) for s in specs]

    fake_gpu(monkeypatch, tmp_path, build_many, measure)
    return seen


def test_cli_writes_the_reports_and_exits_1_naming_the_case(tmp_path, monkeypatch, capsys):
    """The command's wiring on CPU: GPU, build and measurement replaced by synthetic ones."""

    seen = {}
    over = row(case="peaked", ratio=1.5)

    def build_many(specs, **kw):
        seen["built"] = [s.name for s in specs]
        return [types.SimpleNamespace(spec=s, error=None) for s in specs]

    def measure(specs, cases, seeds, seed=0, progress=None):
        seen["measured"], seen["cases"], seen["seeds"] = [s.name for s in specs], cases, seeds
        for s in specs:
            progress(s.name)
        return ROWS + [over]

    fake_gpu(monkeypatch, tmp_path, build_many, measure)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    files = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    code = cli.main(["numerics", *SMALL, "--long", "--seeds", "2", "--json", str(files[0]), "--out", str(files[1]),
                     "--plot", str(files[2])])
    out, err = capsys.readouterr()
    assert code == 1
    names = ["single_prefill_bf16_d128_fa2_tc", "single_prefill_bf16_d128_fa2_tc_causal",
             "batch_decode_paged_bf16_d128_fa2_cc_lse"]
    assert seen == {"built": names, "measured": names, "cases": list(catalog.CASES), "seeds": 2}
    assert "1 append_paged left out" in err and "[3/3] batch_decode_paged_bf16_d128_fa2_cc_lse" in err
    assert "| single_prefill_bf16_d128_fa2_tc | peaked | 3 | 1.50e-02 |" in out and "OVER" in out
    assert report.read_json(files[0])["rows"][-1] == over
    assert out == files[1].read_text() + "\n"  # the file holds what was printed
    assert not files[2].exists() and "png       not written: matplotlib is not installed" in err
    assert err.strip().splitlines()[-1].startswith("flashjit numerics: 1 case(s) over their bound, 0 failed: "
                                                   "single_prefill_bf16_d128_fa2_tc (peaked, over)")


@pytest.mark.parametrize("flag,path", [("--out", "missing/r.md"), ("--json", "."), ("--plot", "missing/r.png")])
def test_report_paths_are_checked_before_anything_is_built(tmp_path, monkeypatch, capsys, flag, path):
    import flashjit.bench
    from flashjit import jit

    monkeypatch.setattr(flashjit.bench, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(jit, "build_many", lambda *a, **k: pytest.fail("built before the report paths were checked"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["numerics", *SMALL, flag, path]) == 2
    assert f"{flag}: expected a file in an existing folder, got {path}" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# The cases, on CPU tensors


def draw(case, op, dtype=torch.float32, seed=3, head_dim=64):
    return cases.make_problems(case, op, head_dim, dtype, generator=torch.Generator().manual_seed(seed), device="cpu")


@pytest.mark.parametrize("op", ["single_prefill", "single_decode", *cases.BATCH_OPS])
def test_problem_shapes_follow_the_lengths(op):
    for case in ("normal", "peaked", "v_outliers", "long", "skewed", "near_empty"):
        for p in draw(case, op):
            assert p.q.shape == (sum(p.qo_lens), *cases.HEADS[:1], 64)
            assert p.k.shape == p.v.shape == (sum(p.kv_lens), cases.HEADS[1], 64)
            assert p.q.dtype == p.k.dtype == torch.float32
            if op in cases.BATCH_OPS:  # every batch case carries the op's empty request
                assert (p.qo_lens[-1], p.kv_lens[-1]) == cases.EMPTY_REQUEST[op]
            if op in ("single_decode", "batch_decode_paged"):
                assert set(p.qo_lens) == {1}
    assert bool(draw("skewed", op)) == (op in cases.BATCH_OPS)


def test_peaked_scales_q_and_nothing_else():
    normal, peaked = draw("normal", "batch_prefill_ragged")[0], draw("peaked", "batch_prefill_ragged")[0]
    assert torch.equal(peaked.q, normal.q * catalog.PEAKED_SCALE)
    assert torch.equal(peaked.k, normal.k) and torch.equal(peaked.v, normal.v)


@pytest.mark.parametrize("op", ["single_prefill", "batch_decode_paged"])
def test_outliers_are_one_percent_of_vs_vectors_times_20(op):
    normal, outl = draw("normal", op)[0], draw("v_outliers", op)[0]
    ratio = (outl.v / normal.v.where(normal.v != 0, 1.0))
    scaled = (ratio - catalog.OUTLIER_SCALE).abs().amax(-1) < 1e-4   # [tokens, heads]: whole vectors
    kept = (ratio - 1).abs().amax(-1) < 1e-6
    rows = normal.v.shape[0] * normal.v.shape[1]
    assert int(scaled.sum()) == outl.outlier_rows == max(1, round(catalog.OUTLIER_FRACTION * rows))
    assert bool((scaled | kept).all()) and torch.equal(outl.q, normal.q)


def test_long_and_near_empty_lengths():
    assert draw("long", "single_prefill")[0].kv_lens == [catalog.LONG_KV] and catalog.LONG_KV == 32768
    assert cases._shapes("long128k", "single_decode") == [([1], [131072])]
    assert cases._shapes("long128k", "batch_decode_paged")[0][1][0] == catalog.LONG_KV_MAX
    skewed = cases._shapes("skewed", "batch_prefill_paged")[0]
    assert max(skewed[1]) >= 32 * sorted(skewed[1])[len(skewed[1]) // 2] and len(skewed[1]) >= 16
    single = cases._shapes("near_empty", "single_prefill")
    assert ([1], [1]) in single and any(kv == [1] and qo[0] > 1 for qo, kv in single)
    assert any(qo == [1] and kv[0] > 1 for qo, kv in single)
    for op in cases.BATCH_OPS:
        qo, kv = cases._shapes("near_empty", op)[0]
        assert 1 in kv[:-1] and qo.count(1) >= 2


def test_pages_hold_each_requests_keys_in_order():
    p = draw("near_empty", "batch_decode_paged", dtype=torch.bfloat16)[0]
    pages = cases.paged(p, torch.Generator().manual_seed(0), page_size=2)
    kv_indptr = cases.indptr(p.kv_lens)
    for r, n in enumerate(p.kv_lens):
        ids = pages.indices[int(pages.indptr[r]):int(pages.indptr[r + 1])].long()
        got = pages.cache[ids, 0].reshape(-1, *p.k.shape[1:])[:n]
        assert torch.equal(got, p.k[kv_indptr[r]:kv_indptr[r] + n])
        assert int(pages.last_page_len[r]) == ((n - 1) % 2 + 1 if n else 0)


def test_seeds_are_fresh_per_draw_and_case_and_stable():
    spec = KernelSpec.make("single_prefill", "bfloat16", 128)
    seeds = {runner.seed_for(0, spec, c, d) for c in ("normal", "peaked") for d in range(3)}
    assert len(seeds) == 6 and runner.seed_for(0, spec, "normal", 1) == runner.seed_for(0, spec, "normal", 1)
    assert runner.seed_for(1, spec, "normal", 1) != runner.seed_for(0, spec, "normal", 1)


# ---------------------------------------------------------------------------
# The statistics, on CPU tensors


def problem_and_ref(spec, case="normal"):
    p = draw(case, spec.op, dtype=getattr(torch, spec.dtype_q), head_dim=spec.head_dim_qk)[0]
    return (p, *runner.reference(spec, p))


def test_rounded_reference_is_within_its_bound_and_a_shift_past_it_is_not():
    spec = KernelSpec.make("batch_decode_paged", "bfloat16", 64, return_lse=True)
    check_accumulator_bounds(spec, *problem_and_ref(spec))


def check_accumulator_bounds(spec, p, ref, ref_lse):
    """The reference rounded to bf16 is within its bound; shifted by 3 atol it is not."""
    acc = runner.Accumulator()
    acc.add(spec, p, ref.to(torch.bfloat16), ref_lse.float(), ref, ref_lse)
    good = acc.row()
    assert good["status"] == "ok" and 0 < good["ratio"] <= 1 and good["lse_ratio"] <= 1 and good["nan"] == 0
    assert good["elements"] == ref.numel() and good["worst_err"] <= good["worst_bound"]
    bad = runner.Accumulator()
    bad.add(spec, p, ref + 3 * good["atol"], ref_lse.float(), ref, ref_lse)
    assert bad.row()["status"] == "over" and bad.row()["ratio"] > 1


def test_statistics_of_known_errors_and_nan():
    spec = KernelSpec.make("single_decode", "float32", 64)
    p, ref, _ = problem_and_ref(spec)
    n = ref.numel()
    errors = torch.arange(n, dtype=torch.float64).view(ref.shape) * 1e-9
    acc = runner.Accumulator()
    acc.add(spec, p, ref + errors, None, ref, None)
    stats = acc.row()
    assert stats["max_err"] == pytest.approx((n - 1) * 1e-9, rel=1e-6)
    assert stats["mean_err"] == pytest.approx((n - 1) / 2 * 1e-9, rel=1e-6)
    assert stats["p999_err"] == pytest.approx((math.ceil(0.999 * n) - 1) * 1e-9, rel=1e-6)
    assert stats["lse_ratio"] is None
    poisoned = ref.clone()
    poisoned[0, 0, 0] = math.nan
    acc.add(spec, p, poisoned, None, ref, None)
    stats = acc.row()
    assert stats["status"] == "over" and stats["nan"] == 1 and stats["ratio"] == math.inf and stats["calls"] == 2


# ---------------------------------------------------------------------------
# On a GPU


@pytest.mark.gpu
def test_small_selection_within_its_bounds():
    from flashjit import arch

    args = parse("--op", "single_prefill", "batch_decode_paged", "--dtype", "bf16", "--head-dim", "128")
    specs = cli.specs_from_args(args, (arch.device_arch(),))
    assert all(r.error is None for r in flashjit.build_many(specs, raise_first=False))
    lines = []
    rows = flashjit.numerics.measure(specs, ["normal", "peaked"], seeds=2, progress=lines.append)
    assert len(lines) == len(specs) and {r["config"] for r in rows} == {s.name for s in specs}
    assert sorted((r["config"], r["case"]) for r in rows) == sorted((s.name, c) for s in specs
                                                                   for c in ("normal", "peaked"))
    for r in rows:
        assert r["status"] == "ok", r
        assert r["calls"] == 2 and r["nan"] == 0 and 0 < r["ratio"] <= 1 and r["max_err"] > 0
        assert r["p999_err"] <= r["max_err"] and r["mean_err"] <= r["max_err"]
        assert (r["lse_ratio"] is not None) == (r["op"] == "batch_decode_paged")


@pytest.mark.gpu
def test_cli_on_a_gpu_writes_json_and_exits_0(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "flashjit", "numerics", "--op", "single_decode", "--dtype", "bf16",
                          "--head-dim", "64", "--cases", "near_empty", "normal", "--seeds", "1", "--json", str(out)],
                         cwd=REPO, env=subprocess_env(tmp_path / "cache", arches=None), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["case"], r["status"]) for r in rows] == [
        ("single_decode_bf16_d64_fa2_cc", "normal", "ok"), ("single_decode_bf16_d64_fa2_cc", "near_empty", "ok")]
    assert "| single_decode_bf16_d64_fa2_cc | near_empty | 1 |" in run.stdout
