"""`flashjit bench`: its arguments, the reports it writes (from synthetic
results, no GPU), its one-line error where no GPU is visible, the benchmark
scripts' imports that benchmarks/dev/ rely on, and on a GPU the three reports of
a quick run."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys

import pytest

from flashjit import cli
from flashjit.bench import decode, host, prefill, report
from helpers_cache import REPO, subprocess_env


def parse(*argv):
    return cli.build_parser().parse_args(["bench", *argv])


def test_arguments():
    args = parse()
    assert (args.quick, args.out, args.only, args.peers, args.rounds, args.reps) == \
        (False, "flashjit-bench", None, None, 3, 50)
    args = parse("--quick", "--only", "decode", "--peers", "--out", "x", "--rounds", "2", "--reps", "7")
    assert (args.quick, args.out, args.only, args.peers, args.rounds, args.reps) == (True, "x", ["decode"], [], 2, 7)
    assert parse("--peers", "sdpa", "flashinfer").peers == ["sdpa", "flashinfer"]
    assert args.func is cli.cmd_bench


@pytest.mark.parametrize("argv", [["--only", "mla"], ["--peers", "cudnn"], ["--rounds", "0"], ["--reps", "x"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert "flashjit bench: error:" in capsys.readouterr().err


def test_no_gpu_is_one_line_and_exit_2(tmp_path):
    """CUDA_VISIBLE_DEVICES='' hides any GPU, so this runs the same everywhere."""
    out = tmp_path / "reports"
    run = subprocess.run([sys.executable, "-m", "flashjit", "bench", "--quick", "--out", str(out)], cwd=REPO,
                         env=subprocess_env(tmp_path / "cache", CUDA_VISIBLE_DEVICES=""), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if "NumPy" not in line and "_conversion_method" not in line]
    assert len(lines) == 1 and lines[0].startswith("flashjit bench: ") and "GPU" in lines[0], run.stderr
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_out_naming_a_file_is_exit_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    import flashjit.bench

    target = tmp_path / "a-file"
    target.write_text("")
    monkeypatch.setattr(flashjit.bench, "no_gpu_reason", lambda: None)
    assert cli.main(["bench", "--quick", "--out", str(target)]) == 2
    assert f"--out: expected a folder (made if missing), got the file {target}" in capsys.readouterr().err


def test_rows_keep_the_tables_rows():
    quick = prefill.rows(quick=True)
    assert [(r["head_dim"], r["label"], r.get("causal")) for r in quick] == [
        (128, "16 x 1024", False), (128, "16 x 1024", True), (128, "4 x 4096", False), (128, "4 x 4096", True),
        (128, prefill.SKEWED_LABEL, True), (128, "single_decode", None)]
    full = prefill.rows()
    assert len(full) == 3 * 3 * 2 + 2 and full[-2]["label"] == prefill.SKEWED_LABEL
    assert all(r["heads"] * r["head_dim"] == 2048 for r in full if "heads" in r)
    assert len(prefill.rows(head_dims=[64], seqlens=[2048], skewed=False)) == 2
    assert [r["label"] for r in decode.rows(quick=True)] == ["read/copy bandwidth", *decode.QUICK_ROWS]
    assert [r["kind"] for r in decode.rows()] == ["baselines"] + ["decode"] * len(decode.ROWS) + ["append"] * 2


def test_prebuilt_specs_are_what_prewarm_selects():
    """The configurations bench builds before timing are those `flashjit
    prewarm` selects for the same ops (which ops always load LSE, and so on)."""
    impls = {"flashjit fa2": None, "flashjit fa3": None, "sdpa-flash": None}
    built = set(prefill.specs(prefill.rows(quick=True, skewed=False), impls))
    args = cli.build_parser().parse_args(["prewarm", "--op", "batch_prefill_ragged", "--dtype", "bf16", "--head-dim",
                                          "128", "--backend", "fa2", "fa3", "--tensor-cores", "on", "--arch", "sm_90a"])
    assert built == set(cli.specs_from_args(args))
    args = cli.build_parser().parse_args(["prewarm", "--op", "batch_decode_paged", "append_paged", "--dtype", "bf16",
                                          "--head-dim", "128", "--tensor-cores", "both", "--arch", "sm_90a"])
    assert set(decode.specs(decode.rows())) == set(cli.specs_from_args(args))
    assert len(decode.specs(decode.rows(quick=True))) == 2  # quick: no append rows


def test_head_dims_choose_the_prefill_rows_and_fa3_only_where_it_generates_them(monkeypatch):
    from flashjit import arch

    monkeypatch.setattr(arch, "_warned_fallbacks", set())  # the prewarm's warning, seen anew
    monkeypatch.delenv("FLASHJIT_STRICT_BACKEND", raising=False)
    assert parse("--head-dim", "96", "192").head_dim == ["96", "192"] and parse().head_dim is None
    rows = prefill.rows(head_dims=[80, 96, 128], seqlens=[1024], skewed=False)
    assert [(r["head_dim"], r["heads"], r["causal"]) for r in rows] == [
        (80, 25, False), (80, 25, True), (96, 21, False), (96, 21, True), (128, 16, False), (128, 16, True)]
    built = set(prefill.specs(rows, {"flashjit fa2": None, "flashjit fa3": None}))
    assert {s.name for s in built if s.backend == "fa3"} == {
        f"batch_prefill_ragged_bf16_d{d}_fa3_tc{c}_lse" for d in (96, 128) for c in ("", "_causal")}
    args = cli.build_parser().parse_args(["prewarm", "--op", "batch_prefill_ragged", "--dtype", "bf16", "--head-dim",
                                          "80", "96", "128", "--backend", "fa2", "fa3", "--tensor-cores", "on",
                                          "--arch", "sm_90a"])
    with pytest.warns(UserWarning, match="fa3 does not generate head_dim 80"):
        assert built == set(cli.specs_from_args(args))


def test_benchmark_scripts_keep_what_dev_instruments_import():
    """benchmarks/dev/ put benchmarks/ on sys.path and import from common,
    prefill and decode; those are thin callers of flashjit.bench now."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        for path in sorted((REPO / "benchmarks" / "dev").glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module in ("common", "prefill", "decode"):
                    module = importlib.import_module(node.module)
                    missing = [a.name for a in node.names if not hasattr(module, a.name)]
                    assert not missing, f"{path.name}: {node.module} lacks {missing}"
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def synthetic() -> dict:
    pre = {"kind": "prefill", "device": "NVIDIA H200", "dtype": "bfloat16", "unit": "TFLOP/s", "rounds": 3,
           "impls": ["flashjit fa2", "sdpa-flash"],
           "rows": [{"head_dim": 128, "label": "16 x 1024", "causal": False, "heads": 16,
                     "values": {"flashjit fa2": 401.4, "sdpa-flash": 351.6}, "samples": {}, "errors": {}},
                    {"head_dim": 128, "label": "skewed 1x16k + 64x100", "causal": True, "heads": 16,
                     "values": {"flashjit fa2": 380.0, "sdpa-flash": None}, "samples": {},
                     "errors": {"sdpa-flash": "NotImplementedError: SDPA takes equal-length batches only"}}],
           "single_decode": {"kv_len": 32768, "us": 41.25, "gbps": 3254.2}}
    base = {"row": "GQA 64x4k 32/8", "batch": 64, "kv_len": 4096, "qo_heads": 32, "kv_heads": 8, "bytes": 1 << 29}
    dec = {"kind": "decode", "gpu": "NVIDIA H200", "date": "2026-11-25T10:00:00", "commit": "abc1234",
           "torch": "2.11.0", "flashinfer": None, "reps": 50, "libs": ["flashjit"],
           "impls": ["flashjit tc=False", "flashjit tc=True"],
           "read_gbps": 4400.0, "read_method": "amax(int64 view)",
           "read_all_gbps": {"amax(int64 view)": 4400.0, "sum(bf16->f32)": 4000.0}, "copy_gbps": 4100.0,
           "spec_gbps": None,
           "decode": [dict(base, impl="flashjit tc=False", ok=True, max_err=1e-3, rel_err=1e-4, us=150.25,
                           gbps=3573.2, mode="graph", inner=13, frac_read=0.812),
                      dict(base, impl="flashjit tc=True", ok=False, error="RuntimeError: boom\nsecond line")],
           "append": [{"row": "append 64x1 tok, 8 kv heads", "requests": 64, "tokens_per_request": 1,
                       "impl": "flashjit", "bytes": 524288, "ok": True, "us": 3.456, "gbps": 151.7,
                       "mode": "eager", "inner": 500, "frac_copy": 0.037}],
           "failures": ["flashjit tc=True GQA 64x4k 32/8: error: RuntimeError: boom"]}
    meta = {"device": "NVIDIA H200", "date": "2026-11-25T10:00:00", "commit": "abc1234", "flashjit": "0.1.0",
            "torch": "2.11.0", "cuda": "13.0", "flashinfer": None, "quick": True, "argv": ["--quick"]}
    return {"meta": meta, "sections": {"prefill": pre, "decode": dec}}


def test_prefill_table_is_the_scripts_table():
    text = report.prefill_table(synthetic()["sections"]["prefill"])
    assert text.splitlines() == [
        "device: NVIDIA H200, bf16, TFLOP/s, median of 3 x reps samples per cell, taken in shuffled passes", "",
        "| head_dim | batch x S | causal | flashjit fa2 | sdpa-flash |", "|---|---|---|---|---|",
        "| 128 | 16 x 1024 | False | 401 | 352 |",
        "| 128 | skewed 1x16k + 64x100 | True | 380 | n/a |", "",
        "single_decode bf16 d128 32/8 heads kv_len 32768 (CUDA cores, split-KV): 41.2 us, 3254 GB/s of K/V read"]


def test_decode_table_is_the_scripts_table():
    lines = report.decode_table(synthetic()["sections"]["decode"]).splitlines()
    assert lines[0] == "## Paged decode, bf16, head_dim 128, page 16, NHD, random page order"
    assert lines[2].startswith("GPU: NVIDIA H200; date 2026-11-25T10:00:00; commit abc1234; torch 2.11.0; "
                               "flashinfer not available")
    assert lines[3].startswith("read bandwidth 4400 GB/s (amax(int64 view); amax(int64 view) 4400, sum(bf16->f32) "
                               "4000); copy bandwidth 4100 GB/s") and lines[3].endswith("unknown")
    assert "| GQA 64x4k 32/8 | 512 | 150.2 · 3573 · 81% | error: RuntimeError: boom |" in lines
    assert "| append 64x1 tok, 8 kv heads | 0.50 | 3.46 · 152 · 4% (eager) |" in lines
    assert lines[-2:] == ["FAIL flashjit tc=True GQA 64x4k 32/8: error: RuntimeError: boom",
                          "decode benchmark: 1 flashjit failure(s)"]


def test_cells_for_failures_and_long_errors():
    assert report.decode_cell({"ok": False, "max_err": 0.5, "rel_err": 0.25}, "decode") == \
        "FAIL max err 0.5, rel 0.25"
    assert report.decode_cell({"ok": False}, "append") == "FAIL wrong slots"
    cell = report.short_error("ValueError: " + "x" * 100 + "the reason | here")
    assert cell.startswith("error: ValueError: ...") and cell.endswith("the reason / here") and len(cell) < 110


def test_progress_lines():
    ticks = iter([100.0, 110.0, 130.0])
    lines = []
    progress = report.Progress(3, stream=type("S", (), {"write": lambda self, s: lines.append(s),
                                                        "flush": lambda self: None})(), clock=lambda: next(ticks))
    progress("prefill d128 16 x 1024")
    progress("decode GQA")
    text = "".join(lines).splitlines()
    assert text == ["[1/3] prefill d128 16 x 1024  (10 s elapsed, about 20 s left)",
                    "[2/3] decode GQA  (30 s elapsed, about 15 s left)"]


def test_reports_written_and_png_skipped_without_matplotlib(tmp_path, monkeypatch):
    results = synthetic()
    (tmp_path / "bench.png").write_bytes(b"an earlier run's plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    lines = report.write_all(results, tmp_path)
    assert (tmp_path / "bench.md").read_text() == report.markdown(results)
    assert json.loads((tmp_path / "bench.json").read_text())["sections"]["decode"]["impls"] == \
        ["flashjit tc=False", "flashjit tc=True"]
    assert lines[-1] == f"png       not written: {report.MATPLOTLIB_MISSING}"
    assert not (tmp_path / "bench.png").exists()
    md = report.markdown(results)
    assert md.startswith("# flashjit bench\n\nNVIDIA H200; 2026-11-25T10:00:00; flashjit 0.1.0 (commit abc1234)")
    assert "## Prefill, bf16, TFLOP/s" in md and "| 128 | 16 x 1024 | False | 401 | 352 |" in md
    assert "## Paged decode" in md


def test_host_table():
    section = {"device": "NVIDIA H200", "calls": 3000, "rounds": 3, "target_us": 10.0,
               "rows": [{"op": "single_decode_with_kv_cache", "us": 6.25, "gpu_us": 4.0, "rounds_us": [6.2, 6.25, 7.0],
                         "note": "n"},
                        {"op": "BatchDecodeWithPagedKVCacheWrapper.run", "us": 12.0, "gpu_us": 12.6, "rounds_us": [12.0],
                         "note": "m"},
                        {"op": "BatchMLAPagedAttentionWrapper.run", "us": 8.0, "rounds_us": [8.0], "note": "o"}]}
    results = synthetic()
    results["sections"]["host"] = section
    md = report.markdown(results)
    assert "## Host time per call (NVIDIA H200, bf16, tiny inputs; median of 3 rounds, each the mean of 3000 calls)" in md
    assert "| single_decode_with_kv_cache | 6.2 | < 10 us | 4.0 | n |" in md
    assert "| BatchDecodeWithPagedKVCacheWrapper.run | 12.0 (over) | < 10 us | 12.6 (kernel-paced) | m |" in md
    assert "| BatchMLAPagedAttentionWrapper.run | 8.0 | < 10 us | - | o |" in md  # a report from before the GPU column
    assert [title for title, *_ in report.plot_series(results)][:1] == ["Prefill (0 = not applicable)"]


@pytest.mark.nvcc
def test_host_cases_run_on_the_cpu_stub_and_load_what_bench_builds(tmp_path):
    """benchmarks/host_cost_cpu.py's stub: every case runs (launch stubbed) and
    the configurations they load are host.specs(), which `flashjit bench` builds first."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import host_cost_cpu
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from flashjit import jit

    loaded = []
    with host_cost_cpu.stubbed(host_cost_cpu.build_stub(tmp_path)):  # restores jit.get_module on exit
        stub_module = jit.get_module
        jit.get_module = lambda spec: loaded.append(spec) or stub_module(spec)
        section = host.run(calls=5, device="cpu", workspace=host_cost_cpu._workspace, rounds=1)
        assert set(loaded) == set(host.specs())
    assert [row["op"] for row in section["rows"]] == [label for label, _ in host.CASES]
    assert all(row["us"] > 0 and row["gpu_us"] is None for row in section["rows"])


def test_failed_section_is_reported():
    results = synthetic()
    results["sections"]["decode"] = {"error": "RuntimeError: CUDA out of memory"}
    md = report.markdown(results)
    assert "## decode\n\nfailed: RuntimeError: CUDA out of memory" in md
    assert [title for title, *_ in report.plot_series(results)] == ["Prefill (0 = not applicable)"]


def test_plot_series():
    (pre, labels, series, _), (dec, dlabels, dseries, _) = report.plot_series(synthetic())
    assert labels == ["d128 16 x 1024", "d128 skewed 1x16k + 64x100 causal"]
    assert series == {"flashjit fa2": [401.4, 380.0], "sdpa-flash": [351.6, 0.0]}
    assert dlabels == ["GQA 64x4k 32/8"] and dseries == {"flashjit tc=False": [3573.2], "flashjit tc=True": [0.0]}
    assert "4400 GB/s" in dec


def test_png_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    assert report.write_png(synthetic(), tmp_path / "bench.png") is None
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
def test_bench_quick_writes_three_reports(tmp_path):
    """The quick run beside SDPA alone (FlashInfer's first run may compile for
    minutes); about a minute with the kernels cached."""
    out = tmp_path / "reports"
    run = subprocess.run([sys.executable, "-m", "flashjit", "bench", "--quick", "--peers", "sdpa", "--out", str(out)],
                         cwd=REPO, env=subprocess_env(arches=None), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    md = (out / "bench.md").read_text()
    assert "| head_dim | batch x S | causal | flashjit fa2" in md and "## Paged decode" in md
    assert "## Host time per call" in md
    results = json.loads((out / "bench.json").read_text())
    pre, dec = results["sections"]["prefill"], results["sections"]["decode"]
    assert [row["op"] for row in results["sections"]["host"]["rows"]] == [label for label, _ in host.CASES]
    assert all(row["values"]["flashjit fa2"] > 0 for row in pre["rows"])
    assert all(rec["ok"] and rec["gbps"] > 0 for rec in dec["decode"]) and not dec["failures"]
    assert re.search(r"^\[ *1/\d+\] ", run.stderr, re.M)  # the progress lines (the count right-aligned)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert report.MATPLOTLIB_MISSING in run.stderr and not (out / "bench.png").exists()


def test_gpu_check_parses_and_names_files_that_exist():
    """benchmarks/gpu_check.sh (the one GPU call) is valid bash, and every script and test file its commands
    name exists: a renamed test or instrument fails here, not on a GPU machine's clock."""
    script = REPO / "benchmarks" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    commands = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
    named = set(re.findall(r"(?:benchmarks|tests)/[\w/.-]+\.(?:py|sh)", commands))
    assert {"benchmarks/dev/fa3_walk.py", "tests/test_gpu_head_dims.py"} <= named
    assert [path for path in sorted(named) if not (REPO / path).is_file()] == []
