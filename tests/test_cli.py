"""The `flashjit` command (python -m flashjit), run as a subprocess against a
private cache directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashjit import arch, build, cli, jit
from flashjit.spec import KernelSpec
from helpers_cache import (REPO, copy_cache, entry_dirs, flip_byte, have_nvcc, manifest_of, run_cli, set_cache_env,
                           subprocess_env, tmp_dirs)

PREWARM = ["prewarm", "--preset", "minimal", "--dtype", "bfloat16", "--head-dim", "64", "--arch", "sm_80",
           "--jobs", "2"]
# --preset minimal = every op; --tensor-cores auto = what the ops pick (tensor cores for
# bf16 prefill, CUDA cores for decode); --causal defaults to both (decode has no causal
# variant); the batch wrappers always build their LSE variant; append has no variants.
EXPECTED = [
    KernelSpec.make("single_prefill", "bfloat16", 64, use_tensor_cores=True),
    KernelSpec.make("single_prefill", "bfloat16", 64, use_tensor_cores=True, causal=True),
    KernelSpec.make("single_decode", "bfloat16", 64),
    KernelSpec.make("batch_prefill_ragged", "bfloat16", 64, use_tensor_cores=True, return_lse=True),
    KernelSpec.make("batch_prefill_ragged", "bfloat16", 64, use_tensor_cores=True, causal=True, return_lse=True),
    KernelSpec.make("batch_prefill_paged", "bfloat16", 64, use_tensor_cores=True, return_lse=True),
    KernelSpec.make("batch_prefill_paged", "bfloat16", 64, use_tensor_cores=True, causal=True, return_lse=True),
    KernelSpec.make("batch_decode_paged", "bfloat16", 64, return_lse=True),
    KernelSpec.make("append_paged", "bfloat16", 64),
]


def test_info(tmp_path):
    root = tmp_path / "cache"
    out = run_cli("info", root=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^flashjit\s+\d+\.\d+", out.stdout, re.M)
    assert re.search(rf"^cache dir\s+{re.escape(str(root))}$", out.stdout, re.M)
    nvcc = arch.find_nvcc()
    if nvcc:
        version = arch.nvcc_version(nvcc)
        assert re.search(rf"^nvcc\s+\S*nvcc \({re.escape(version)}\)$", out.stdout, re.M), out.stdout
    else:
        assert "not found" in out.stdout and "CUDA_HOME" in out.stdout
    assert re.search(r"^arch list\s+sm_80$", out.stdout, re.M)
    import torch

    if not torch.cuda.is_available():
        assert re.search(r"^gpu\s+none visible$", out.stdout, re.M)
    assert "single_prefill" in out.stdout and "mla_paged" in out.stdout and "planned:" not in out.stdout
    assert not root.exists(), "`flashjit info` must not create the cache"


def test_prewarm_selection_matches_the_flags():
    args = cli.build_parser().parse_args(PREWARM)
    assert cli.specs_from_args(args) == EXPECTED


def _backends_of(argv) -> dict:
    specs = cli.specs_from_args(cli.build_parser().parse_args(argv))
    return {(s.op, s.use_tensor_cores): sorted({t.backend for t in specs if (t.op, t.use_tensor_cores) ==
                                                (s.op, s.use_tensor_cores)}) for s in specs}


def test_prewarm_backends_follow_the_target_arches(monkeypatch, recwarn):
    """auto builds what the ops pick on each target: fa2 for sm_80 / sm_89, fa3
    for sm_90a's tensor-core prefill; an explicit fa3 that a target cannot run
    builds fa2 for it, with the ops' warning, or fails under the strict switch."""
    monkeypatch.setattr(arch, "_warned_fallbacks", set())
    monkeypatch.delenv("FLASHJIT_STRICT_BACKEND", raising=False)
    base = ["prewarm", "--preset", "minimal", "--arch"]
    fat = _backends_of([*base, "sm_80", "sm_89", "sm_90a"])
    prefill = [("single_prefill", True), ("batch_prefill_ragged", True), ("batch_prefill_paged", True)]
    assert [fat[key] for key in prefill] == [["fa2", "fa3"]] * 3
    assert fat[("single_decode", False)] == fat[("batch_decode_paged", False)] == ["fa2"]
    hopper = _backends_of([*base, "sm_90a"])
    assert [hopper[key] for key in prefill] == [["fa3"]] * 3
    assert hopper[("single_decode", False)] == ["fa2"]
    assert all(v == ["fa2"] for v in _backends_of([*base, "sm_89"]).values())
    explicit = _backends_of([*base, "sm_80", "--backend", "fa3"])
    assert all(v == ["fa2"] for v in explicit.values())
    assert any("backend='fa3'" in str(w.message) and "sm_80" in str(w.message) for w in recwarn)
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", "1")
    with pytest.raises(ValueError, match=r"^--backend fa3: fa3 needs wgmma .* the target is sm_80; choose --backend "
                                         r"fa2 or auto, or unset FLASHJIT_STRICT_BACKEND"):
        _backends_of([*base, "sm_80", "--backend", "fa3"])


def test_default_preset_is_the_serving_set_and_flags_replace_its_switches():
    """default: bf16 causal ragged/paged prefill, decode on both core types,
    append and MLA; --causal / --tensor-cores on the command line replace its
    parts' switches, and a named --op takes the switches' own defaults."""
    def names(*flags):
        return {s.name for s in cli.specs_from_args(cli.build_parser().parse_args(
            ["prewarm", *flags, "--arch", "sm_80", "sm_89", "sm_90a"]))}

    default = names()
    assert len(default) == 30
    # The FP8 (e4m3) cache at head dim 128: paged prefill, decode on both core types, the append into it.
    assert {n for n in default if "_kv" in n} == {
        "batch_prefill_paged_bf16_kve4m3_d128_fa2_tc_causal_lse", "batch_prefill_paged_bf16_kve4m3_d128_fa3_tc_causal_lse",
        "batch_decode_paged_bf16_kve4m3_d128_fa2_cc_lse", "batch_decode_paged_bf16_kve4m3_d128_fa2_tc_lse",
        "append_paged_bf16_kve4m3_d128"}
    default_fp8, default = {n for n in default if "_kv" in n}, {n for n in default if "_kv" not in n}
    assert {n for n in default if "prefill" in n} == {
        f"batch_prefill_{kind}_bf16_d{d}_{b}_tc_causal_lse" for kind in ("ragged", "paged")
        for d in (64, 128, 256) for b in ("fa2", "fa3")}
    assert {n for n in default if "decode" in n} == {
        f"batch_decode_paged_bf16_d{d}_fa2_{c}_lse" for d in (64, 128, 256) for c in ("cc", "tc")}
    assert {n for n in default if n.startswith("mla_paged")} == {
        f"mla_paged_bf16_qk576_vo512_{b}_tc{c}_lse" for b in ("fa2", "fa3") for c in ("", "_causal")}
    both = names("--causal", "both")
    assert default | default_fp8 < both and {n for n in both - default - default_fp8 if "_causal" in n} == set()
    assert names("--dtype", "fp16") == {n.replace("_bf16_", "_f16_") for n in default | default_fp8}
    # --kv-dtype and --head-dim replace the FP8 part's too, as every part's.
    assert {n for n in names("--kv-dtype", "e5m2") if "_kve4m3_" in n} == set()
    assert {n for n in names("--head-dim", "64") if "_kv" in n} == {n.replace("_d128", "_d64") for n in default_fp8}
    assert names("--op", "batch_prefill_ragged") == {
        f"batch_prefill_ragged_bf16_d{d}_{b}_tc{c}_lse" for d in (64, 128, 256) for b in ("fa2", "fa3")
        for c in ("", "_causal")}
    full = names("--preset", "full")
    assert len(full) == 473
    # fa3 builds its head dims; every other head dim's tensor-core prefill is fa2's alone.
    assert {re.search(r"_d(\d+)_", n).group(1) for n in full if "_fa3_" in n and "_d" in n} == {"64", "96", "128",
                                                                                              "192", "256"}
    assert {n for n in full if n.startswith("batch_prefill_ragged_bf16_d96_") and "_tc" in n} == {
        f"batch_prefill_ragged_bf16_d96_{b}_tc{c}_lse" for b in ("fa2", "fa3") for c in ("", "_causal")}
    assert {n for n in full if n.startswith("batch_prefill_ragged_bf16_d112_") and "_tc" in n} == {
        f"batch_prefill_ragged_bf16_d112_fa2_tc{c}_lse" for c in ("", "_causal")}


@pytest.mark.parametrize("flags,expected_count", [
    (["--window", "both"], 17), (["--soft-cap", "on", "--causal", "off"], 5), (["--lse", "both"], 12),
    (["--op", "single_decode", "--dtype", "fp16", "fp32"], 2),
])
def test_prewarm_flags_expand_the_selection(flags, expected_count):
    args = cli.build_parser().parse_args([*PREWARM, *flags])
    specs = cli.specs_from_args(args)
    assert len(specs) == len(set(specs)) == expected_count
    assert all(s.validate() is s for s in specs)


@pytest.fixture(scope="module")
def prewarmed(tmp_path_factory):
    if not have_nvcc():
        pytest.skip("needs nvcc")
    root = tmp_path_factory.mktemp("cli") / "cache"
    out = run_cli(*PREWARM, "-v", root=root)
    return SimpleNamespace(root=root, out=out)


@pytest.mark.nvcc
@pytest.mark.slow
def test_prewarm_prints_a_row_per_configuration(prewarmed):
    out = prewarmed.out
    assert out.returncode == 0, out.stderr
    n = len(EXPECTED)
    assert f"flashjit prewarm: {n} configuration(s) for sm_80 (--arch)" in out.stderr
    assert re.search(rf"^flashjit prewarm: {n} configuration\(s\) ready \({n} built, 0 cached\) in \d+\S+; cache "
                     rf"[\d.]+ [kMG]?B at {re.escape(str(prewarmed.root))}$", out.stderr, re.M), out.stderr
    rows = [ln for ln in out.stdout.splitlines() if ln and not ln.startswith("configuration")]
    assert out.stdout.splitlines()[0].split()[:2] == ["configuration", "built"]
    assert len(rows) == len(EXPECTED)
    entries = {p.parent.name: p for p in entry_dirs(prewarmed.root)}
    for spec, row in zip(sorted(EXPECTED, key=lambda s: s.name), sorted(rows)):
        cells = row.split()
        assert cells[0] == spec.name and cells[1] == "yes"
        assert cells[-1] == str(entries[spec.name]), "the row ends with the entry's cache path"
        assert "rtol" in row and "atol" in row
    assert sorted(entries) == sorted(s.name for s in EXPECTED)
    for path in entries.values():
        assert manifest_of(path)["arches"] == ["sm_80"]
    assert tmp_dirs(prewarmed.root) == []


@pytest.mark.nvcc
@pytest.mark.slow
def test_prewarm_again_is_all_cached(prewarmed, tmp_path):
    """A fully cached prewarm: the selection's lines and the summary, no table, no build line."""
    root = copy_cache(prewarmed.root, tmp_path / "cache")
    out = run_cli(*PREWARM, root=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    n = len(EXPECTED)
    assert f"{n} configuration(s) ready (0 built, {n} cached)" in out.stderr.splitlines()[-1]
    assert len(out.stderr.splitlines()) <= 6, out.stderr
    assert "compiling" not in out.stderr


@pytest.mark.nvcc
@pytest.mark.slow
def test_cache_list(prewarmed):
    out = run_cli("cache", "list", root=prewarmed.root)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["configuration", "arches", "size", "key"]
    assert len(lines) == len(EXPECTED) + 2
    assert re.fullmatch(rf"{len(EXPECTED)} configurations, [\d.]+ [kMG]?B, in {re.escape(str(prewarmed.root))}"
                        rf"/<configuration>/<key>", lines[-1])
    for spec in EXPECTED:
        (line,) = [ln for ln in lines if ln.startswith(f"{spec.name} ")]
        key = next(p for p in entry_dirs(prewarmed.root) if p.parent.name == spec.name).name
        assert " sm_80 " in line and re.search(r" [\d.]+ [kM]?B ", line) and line.endswith(key)


@pytest.mark.nvcc
@pytest.mark.slow
def test_cache_verify_detects_a_corrupt_entry(prewarmed, tmp_path):
    root = copy_cache(prewarmed.root, tmp_path / "cache")
    ok = run_cli("cache", "verify", root=root)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"{len(EXPECTED)} of {len(EXPECTED)} entries verified in {root}" in ok.stdout
    victim = entry_dirs(root)[2]
    flip_byte(victim / manifest_of(victim)["artifact"])
    bad = run_cli("cache", "verify", root=root)
    assert bad.returncode == 1
    (bad_line,) = [ln for ln in bad.stdout.splitlines() if ln.startswith("BAD")]
    assert str(victim) in bad_line and "sha256" in bad_line
    assert f"{len(EXPECTED) - 1} of {len(EXPECTED)} entries verified" in bad.stdout
    listed = run_cli("cache", "list", root=root)
    assert listed.returncode == 1 and f"{len(EXPECTED) - 1} configurations, " in listed.stdout
    assert [ln for ln in listed.stdout.splitlines() if ln.startswith("BAD")] == [bad_line]


@pytest.mark.nvcc
@pytest.mark.slow
def test_cache_clear_empties_it(prewarmed, tmp_path):
    root = copy_cache(prewarmed.root, tmp_path / "cache")
    out = run_cli("cache", "clear", root=root)
    assert out.returncode == 0
    assert f"removed {len(EXPECTED)} configuration(s) from {root}" in out.stdout
    assert entry_dirs(root) == [] and list(root.iterdir()) == []
    listed = run_cli("cache", "list", root=root)
    assert listed.returncode == 0 and listed.stdout == ""
    verified = run_cli("cache", "verify", root=root)
    assert verified.returncode == 0 and "0 of 0 entries verified" in verified.stdout


@pytest.mark.parametrize("argv,names", [
    pytest.param(["--head-dim", "100", "--dtype", "bfloat16"],
                 ["--head-dim: 100 is not generated; choose 96 or 112"], id="head_dim-100"),
    pytest.param(["--dtype", "float64", "--head-dim", "64"], ["--dtype: float64 is not supported", "bf16", "fp16",
                                                               "fp32"], id="dtype-float64"),
    pytest.param(["--dtype", "float32", "--tensor-cores", "on", "--head-dim", "64"],
                 ["the selection is empty", "fp32 has no tensor-core kernel (--tensor-cores on)"],
                 id="fp32-tensor-cores-only"),
])
def test_invalid_selection_exits_2_naming_what_is_supported(tmp_path, argv, names):
    root = tmp_path / "cache"
    out = run_cli("prewarm", *argv, "--arch", "sm_80", root=root, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith("flashjit prewarm: "), out.stderr
    for name in names:
        assert name in out.stderr, f"{name!r} not in {out.stderr!r}"
    assert not root.exists(), "nothing may be built or created for an invalid selection"


def test_unknown_arch_exits_2_with_the_supported_arches(tmp_path):
    args = [a if a != "sm_80" else "sm_75" for a in PREWARM]
    out = run_cli(*args, root=tmp_path / "cache", timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("flashjit prewarm: --arch: sm_75 is not supported (flashjit needs SM80 or newer); "
                                 "choose sm_80, ")
    assert "sm_90a" in out.stderr and len(out.stderr.splitlines()) == 1


def test_prewarm_without_nvcc_exits_1_with_the_fix(tmp_path):
    """No nvcc anywhere (find_nvcc patched in the child: /usr/local/cuda may exist here)."""
    probe = ("import sys; import flashjit.arch as a; a.find_nvcc = lambda: None; "
             "from flashjit.cli import main; sys.exit(main(sys.argv[1:]))")
    root = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-c", probe, *PREWARM], cwd=REPO, env=subprocess_env(root),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "nvcc was not found" in out.stderr and "CUDA_HOME" in out.stderr and "PATH" in out.stderr
    assert "Traceback" not in out.stderr
    assert entry_dirs(root) == []


def test_bad_subcommand_and_missing_action_exit_2(tmp_path):
    for argv in (["frobnicate"], ["cache"], ["cache", "delete"]):
        out = run_cli(*argv, root=tmp_path / "cache", timeout=120)
        assert out.returncode == 2 and "usage:" in out.stderr


# ---------------------------------------------------------------------------
# Prewarm output: the selection in a few lines, a progress line per finished
# configuration, a summary; the table under -v


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """jit.build_many replaced: every configuration built but those named in
    `cached`, each reported as build_many does (build.BuildProgress, the cached
    ones first)."""
    set_cache_env(monkeypatch, tmp_path / "cache")
    cached: set = set()

    def build_many(specs, arches=None, jobs=None, progress=None, root=None, raise_first=True):
        found = [s for s in specs if s.name in cached]
        for done, spec in enumerate(found + [s for s in specs if s.name not in cached], 1):
            progress(build.BuildProgress(done, len(specs), spec.name, 0.0 if spec in found else 1.0, True,
                                         cached=spec in found))
        return [jit.BuildResult(spec, SimpleNamespace(path=root / spec.name), spec.name not in cached, 1.0)
                for spec in specs]

    monkeypatch.setattr(jit, "build_many", build_many)
    return cached


FULL_PRESET = ["prewarm", "--preset", "full", "--arch", "sm_80", "sm_89", "sm_90a", "--jobs", "4"]


def test_prewarm_prints_the_selection_progress_and_a_summary(fake_build, capsys):
    specs = cli.specs_from_args(cli.build_parser().parse_args(FULL_PRESET))
    assert cli.main(FULL_PRESET) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert max(len(line) for line in lines) < 200, "a long line on stderr"
    assert lines[0] == f"flashjit prewarm: {len(specs)} configuration(s) for sm_80, sm_89, sm_90a (--arch)"
    assert re.search(r"^  dtypes +float16, bfloat16, float32$", err, re.M)
    assert re.search(r"^  head_dims +32, 48, 64, 80, .*, 240, 256 \(mla_paged: ckv 512 \+ kpe 64\)$", err, re.M)
    progress = [line for line in lines if line.startswith("[")]
    assert 10 <= len(progress) <= 22, "a log keeps about one line per twentieth"
    assert progress[-1].startswith(f"[{len(specs)}/{len(specs)}] elapsed ") and specs[-1].name in progress[-1]
    assert re.fullmatch(rf"flashjit prewarm: {len(specs)} configuration\(s\) ready \({len(specs)} built, 0 cached\) "
                        rf"in \d+s; cache 0 B at \S+", lines[-1])
    assert len(lines) == 5 + len(progress) + 1
    assert out == "", "the table is for -v"


def test_prewarm_all_cached_prints_the_selection_and_the_summary(fake_build, capsys):
    argv = ["prewarm", "--preset", "minimal", "--arch", "sm_80"]
    fake_build.update(s.name for s in cli.specs_from_args(cli.build_parser().parse_args(argv)))
    n = len(fake_build)
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 6
    assert f"flashjit prewarm: {n} configuration(s) ready (0 built, {n} cached) in 0s" in err.splitlines()[-1]


def test_prewarm_verbose_adds_the_table(fake_build, capsys):
    specs = cli.specs_from_args(cli.build_parser().parse_args(FULL_PRESET))
    assert cli.main([*FULL_PRESET, "-v"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["configuration", "built", "seconds"]
    assert [line.split()[0] for line in out[1:]] == [s.name for s in specs]
