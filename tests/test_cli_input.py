"""The `flashjit` command's input: every selector checked in the words of its
flag before torch is imported or a GPU probed (exit 2, one line), the help of
every flag, and `cache export` / `cache import` of a path that cannot be one."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from flashjit import arch, cli, jit, selection, selectors
from flashjit.spec import DTYPES, HEAD_DIMS, KV_ONLY_DTYPES, OPS
from helpers_cache import REPO, set_cache_env, subprocess_env

# main() in a fresh interpreter: its exit code and whether torch (or the build) was imported.
PROBE = ("import json, sys\nfrom flashjit.cli import main\ncode = main(sys.argv[1:])\n"
         "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules, 'build': 'flashjit.build' in sys.modules}))")


def run_fresh(tmp_path, *argv: str):
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO, env=subprocess_env(tmp_path / "cache"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


GENERATED = "a multiple of 16 from 32 to 256"
BAD = [
    (["--head-dim", "100"], f"--head-dim: 100 is not generated; choose 96 or 112 (the nearest; generated: "
                            f"{GENERATED})"),
    (["--head-dim", "8"], f"--head-dim: 8 is not generated; choose 32 (the nearest; generated: {GENERATED})"),
    (["--head-dim", "600"], f"--head-dim: 600 is not generated; choose 512 (the nearest; generated: {GENERATED}; 512 "
                            f"for single_decode and batch_decode_paged (CUDA or tensor cores) and batch_prefill_paged "
                            f"(tensor cores, fa2))"),
    (["--op", "single_prefill", "--head-dim", "512"], f"--head-dim: 512 is not generated for single_prefill; choose 256 "
                                                      f"(the nearest; generated: {GENERATED}; 512 for single_decode and "
                                                      f"batch_decode_paged (CUDA or tensor cores) and batch_prefill_paged "
                                                      f"(tensor cores, fa2))"),
    (["--head-dim", "big"], f"--head-dim: big is not a number; choose {GENERATED}"),
    (["--head-dim", "576"], f"--head-dim: 576 is mla_paged's (ckv 512 + kpe 64), which it takes alone; the other ops "
                            f"take {GENERATED}"),
    (["--dtype", "int8"], "--dtype: int8 is not supported; choose fp16 (float16, half, f16), bf16 (bfloat16) or "
                          "fp32 (float32, float, f32)"),
    (["--op", "single_prefil"], "--op: single_prefil is not an op flashjit generates; choose single_prefill, "
                                "single_decode, batch_prefill_ragged, batch_prefill_paged, batch_decode_paged, "
                                "mla_paged or append_paged (did you mean single_prefill?)"),
    (["--backend", "fa4"], "--backend: fa4 is not a choice; choose auto, fa2 or fa3"),
    (["--tensor-cores", "yes"], "--tensor-cores: yes is not a choice; choose auto, on, off or both"),
    (["--causal", "true"], "--causal: true is not a choice; choose on, off or both"),
    (["--window", "1"], "--window: 1 is not a choice; choose on, off or both"),
    (["--soft-cap", "30"], "--soft-cap: 30 is not a choice; choose on, off or both"),
    (["--lse", "yes"], "--lse: yes is not a choice; choose on, off or both"),
    (["--preset", "all"], "--preset: all is not a choice; choose default, full or minimal"),
    (["--arch", "sm_75"], "--arch: sm_75 is not supported (flashjit needs SM80 or newer); choose sm_80, sm_86, sm_89, "
                          "sm_90a, sm_100a or sm_120 (or 8.0, 8.9, 9.0a ...)"),
    (["--arch", "hopper"], "--arch: hopper is not supported; choose sm_80, sm_86, sm_89, sm_90a, sm_100a or sm_120 "
                           "(or 8.0, 8.9, 9.0a ...)"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_selector_is_one_line_in_the_flags_words_before_torch(tmp_path, argv, message):
    """Nothing printed before the error (no arch line), no torch, no build module, no cache."""
    result, err = run_fresh(tmp_path, "prewarm", *argv)
    assert err == f"flashjit prewarm: {message}\n"
    assert result == {"code": 2, "torch": False, "build": False}
    assert not (tmp_path / "cache").exists()


def test_bench_checks_its_head_dims_before_torch(tmp_path):
    result, err = run_fresh(tmp_path, "bench", "--head-dim", "96", "100", "--out", str(tmp_path / "reports"))
    assert err == f"flashjit bench: --head-dim: 100 is not generated; choose 96 or 112 (the nearest; generated: " \
                  f"{GENERATED})\n"
    assert result == {"code": 2, "torch": False, "build": False}
    assert not (tmp_path / "reports").exists()


def test_numerics_checks_its_selectors_before_the_gpu(tmp_path):
    result, err = run_fresh(tmp_path, "numerics", "--op", "attention")
    assert err.startswith("flashjit numerics: --op: attention is not an op flashjit generates; choose single_prefill")
    assert result == {"code": 2, "torch": False, "build": False}


def test_every_generated_head_dim_is_accepted():
    values = [str(d) for d in HEAD_DIMS]
    args = cli.build_parser().parse_args(["prewarm", "--op", "batch_prefill_ragged", "--head-dim", *values])
    selectors.check_selectors(args)
    assert args.head_dim == list(HEAD_DIMS) == list(range(32, 257, 16))


def test_the_messages_follow_the_generated_sets(monkeypatch):
    """The choices come from flashjit.spec: a head dim added there is offered here."""
    monkeypatch.setattr(selectors, "HEAD_DIMS", (*HEAD_DIMS, 512))
    args = cli.build_parser().parse_args(["prewarm", "--head-dim", "400"])
    with pytest.raises(selectors.SelectionError, match=r"^--head-dim: 400 is not generated; choose 256 or 512 \(the "
                                                       r"nearest; generated: 32, 48, .*, 256 or 512\)$"):
        selectors.check_selectors(args)
    assert [names[0] for names in selectors.dtype_names().values()] == ["fp16", "bf16", "fp32"]
    assert list(selectors.dtype_names()) == [d for d in DTYPES if d not in KV_ONLY_DTYPES]
    assert [names[0] for names in selectors.dtype_names(kv_only=True).values()] == ["e4m3", "e5m2"]


def test_a_combination_spec_rejects_is_named_in_flags(monkeypatch):
    """A value the selectors accept but KernelSpec.validate rejects (here: a head
    dim the checks are told exists) is reported as the flags that select it."""
    monkeypatch.setattr(selectors, "HEAD_DIMS", (*HEAD_DIMS, 100))
    args = cli.build_parser().parse_args(["prewarm", "--op", "single_decode", "--dtype", "fp16", "--head-dim", "100"])
    with pytest.raises(selectors.SelectionError) as info:
        selection.specs_from_args(args, ("sm_80",))
    assert str(info.value).startswith("--op single_decode --dtype fp16 --head-dim 100 --backend fa2 --tensor-cores "
                                      "off --causal off --window off --soft-cap off --lse off: not generated (")
    assert "single_decode_f16_d100" not in str(info.value)


def test_strict_fa3_is_named_as_the_backend_flag(monkeypatch, capsys, tmp_path):
    set_cache_env(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", "1")
    monkeypatch.setattr(jit, "build_many", lambda *a, **k: pytest.fail("built despite a bad selection"))
    assert cli.main(["prewarm", "--op", "single_prefill", "--dtype", "bf16", "--head-dim", "128", "--backend", "fa3",
                     "--arch", "sm_80"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashjit prewarm: --backend fa3: fa3 needs wgmma") and len(err.splitlines()) == 1
    assert "backend='fa3'" not in err


@pytest.mark.parametrize("argv,reason", [
    (["--op", "single_decode", "batch_decode_paged", "--causal", "on"],
     "the selection is empty: single_decode has no causal variant (--causal on); choose --causal off or both; "
     "batch_decode_paged has no causal variant (--causal on); choose --causal off or both"),
    (["--op", "mla_paged", "--dtype", "fp32"], "the selection is empty: mla_paged runs fp16 and bf16 only (not fp32)"),
    (["--op", "append_paged", "--lse", "on"], "the selection is empty: append_paged has no --tensor-cores, --causal, "
                                              "--window, --soft-cap or --lse variant (leave them off)"),
])
def test_an_empty_selection_says_why(monkeypatch, capsys, tmp_path, argv, reason):
    set_cache_env(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(jit, "build_many", lambda *a, **k: pytest.fail("built despite an empty selection"))
    assert cli.main(["prewarm", *argv, "--arch", "sm_80"]) == 2
    assert capsys.readouterr().err == f"flashjit prewarm: {reason}\n"


def test_arches_without_a_gpu_are_named_in_the_first_line(fake_build_one, capsys):
    assert cli.main(["prewarm", "--op", "single_decode", "--dtype", "fp16", "--head-dim", "64"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"flashjit prewarm: 1 configuration(s) for {', '.join(arch.DEFAULT_ARCHES)} (no GPU visible)"
    assert not any("compiling for" in line for line in err)


@pytest.fixture
def fake_build_one(monkeypatch, tmp_path):
    set_cache_env(monkeypatch, tmp_path / "cache", arches=None)
    monkeypatch.setattr(arch, "device_arch", lambda: None)
    monkeypatch.setattr(jit, "build_many", lambda specs, **kw: [jit.BuildResult(s, None, False, 0.0) for s in specs])


# ---------------------------------------------------------------------------
# Help


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["prewarm", "numerics", "cache", "bench"])
def test_every_flag_has_help(command):
    parser = _subparser(command)
    missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert missing == []
    assert parser.description


def test_prewarm_help_lists_each_preset_and_the_op_choices_once():
    text = _subparser("prewarm").format_help()
    lines = text[text.index("presets (--preset):"):].splitlines()
    for name, preset in selection.PRESETS.items():
        first = lines.index(next(line for line in lines if line.startswith(f"  {name}: ")))
        more = next(i for i in range(first + 1, len(lines) + 1) if i == len(lines) or not lines[i].startswith("    "))
        block = " ".join(" ".join(lines[first:more]).split())
        assert all(op in block for op in preset["ops"]), block
        assert f"dtypes {', '.join(selectors.short_dtype(d) for d in preset['dtypes'])};" in block
        assert f"head dims {', '.join(map(str, preset['head_dims']))}" in block
    for line in text.splitlines():
        assert all(line.count(op) <= 1 for op in OPS), line
    assert "--op OP [OP ...]" in text and " ".join(OPS[:2]).replace(" ", ", ") in " ".join(text.split())


def test_serve_example_help_names_its_commands():
    out = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv = ['serve.py', '--help']; "
                          "runpy.run_path('examples/serve.py', run_name='__main__')"], cwd=REPO,
                         env=subprocess_env(None), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "flashjit prewarm --op batch_prefill_paged" in out.stdout and "FLASHJIT_DISABLE_JIT=1 python" in out.stdout
    assert "--seed SEED  " in out.stdout and "request stream" in out.stdout


# ---------------------------------------------------------------------------
# cache export / import paths


@pytest.mark.parametrize("argv,message", [
    (["export", "{tmp}/missing/c.tar.gz"], "export: the folder of {tmp}/missing/c.tar.gz does not exist"),
    (["export", "{tmp}"], "export: {tmp} is a folder; name the archive inside it"),
    (["import", "{tmp}/none.tar"], "import: {tmp}/none.tar: no such archive"),
])
def test_cache_archive_path_that_cannot_be_used_exits_2(monkeypatch, capsys, tmp_path, argv, message):
    set_cache_env(monkeypatch, tmp_path / "cache")
    assert cli.main(["cache", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashjit cache: " + message.format(tmp=tmp_path)) and len(err.splitlines()) == 1
    assert not (tmp_path / "cache").exists()
