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
    with pytest.raises(ValueError, match="backend='fa3' cannot run here"):
        _backends_of([*base, "sm_80", "--backend", "fa3"])


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
    out = run_cli(*PREWARM, root=root)
    return SimpleNamespace(root=root, out=out)


@pytest.mark.nvcc
@pytest.mark.slow
def test_prewarm_prints_a_row_per_configuration(prewarmed):
    out = prewarmed.out
    assert out.returncode == 0, out.stderr
    n = len(EXPECTED)
    assert f"flashjit prewarm: {n} configuration(s)" in out.stderr
    assert f"{n} ready, 0 failed" in out.stderr
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
    root = copy_cache(prewarmed.root, tmp_path / "cache")
    out = run_cli(*PREWARM, root=root)
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines()[1:] if ln]
    assert len(rows) == len(EXPECTED) and all(r[1] == "cached" for r in rows)
    assert "compiling" not in out.stderr


@pytest.mark.nvcc
@pytest.mark.slow
def test_cache_list(prewarmed):
    out = run_cli("cache", "list", root=prewarmed.root)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(EXPECTED)
    for spec in EXPECTED:
        (line,) = [ln for ln in lines if f" {spec.name} " in ln]
        assert line.startswith("ok ") and " sm_80 " in line and " MB " in line
        assert line.endswith(str(next(p for p in entry_dirs(prewarmed.root) if p.parent.name == spec.name)))


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
    listed_ok = sum(ln.startswith("ok ") for ln in listed.stdout.splitlines())
    assert listed.returncode == 1 and listed_ok == len(EXPECTED) - 1


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
    pytest.param(["--head-dim", "96", "--dtype", "bfloat16"],
                 ["head_dim_qk=96", "Supported: head_dim in (64, 128, 256)", "Nearest working choice", "_d64_"],
                 id="head_dim-96"),
    pytest.param(["--dtype", "float64", "--head-dim", "64"], ["dtype", "bfloat16", "float16", "float32", "float64"],
                 id="dtype-float64"),
    pytest.param(["--dtype", "float32", "--tensor-cores", "on", "--head-dim", "64"], ["the selection is empty"],
                 id="fp32-tensor-cores-only"),
])
def test_invalid_selection_exits_2_naming_what_is_supported(tmp_path, argv, names):
    root = tmp_path / "cache"
    out = run_cli("prewarm", *argv, "--arch", "sm_80", root=root, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert all(line.startswith("flashjit prewarm: ") for line in out.stderr.splitlines()), out.stderr
    for name in names:
        assert name in out.stderr, f"{name!r} not in {out.stderr!r}"
    assert "Traceback" not in out.stderr
    assert not root.exists(), "nothing may be built or created for an invalid selection"


def test_unknown_arch_exits_1_with_the_supported_arches(tmp_path):
    args = [a if a != "sm_80" else "sm_75" for a in PREWARM]
    out = run_cli(*args, root=tmp_path / "cache", timeout=120)
    assert out.returncode == 1
    assert "sm_75" in out.stderr and "sm_80" in out.stderr and "sm_90a" in out.stderr
    assert "Traceback" not in out.stderr


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
# Prewarm output: a count and a summary; the names one per line under -v


class _FakeNinja:
    """Stands in for ninja's process: reports each edge of build.ninja as done
    and writes its output, so build.run_builds logs and reports as in a real run."""

    def __init__(self, argv, **kwargs):
        text = (Path(argv[argv.index("-C") + 1]) / "build.ninja").read_text()
        outputs = re.findall(r"^build (\S+): nvcc", text, re.M)
        names = re.findall(r"^  name = (\S+)$", text, re.M)
        for out in outputs:
            Path(out).write_bytes(b"")
        self.stdout = iter(f"[{i}/{len(names)}] nvcc {name}\n" for i, name in enumerate(names, 1))

    def wait(self) -> int:
        return 0


@pytest.fixture
def fake_compiler(monkeypatch, tmp_path):
    """prewarm through the real build driver with nothing compiled."""
    set_cache_env(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(build, "ninja_executable", lambda: "ninja")
    monkeypatch.setattr(build, "subprocess", SimpleNamespace(Popen=_FakeNinja, PIPE=subprocess.PIPE,
                                                             STDOUT=subprocess.STDOUT))

    def build_many(specs, arches=None, jobs=None, progress=None, root=None, raise_first=True):
        todo = []
        for spec in specs:
            (tmp_path / "builds" / spec.name).mkdir(parents=True)
            todo.append(build.BuildJob(spec.name, tmp_path / "builds" / spec.name, "nvcc", [f"{spec.name}.cu"],
                                       f"lib{spec.name}.so"))
        build.run_builds(todo, root, jobs, progress)
        return [jit.BuildResult(spec, SimpleNamespace(path=job.build_dir), True, job.seconds)
                for spec, job in zip(specs, todo)]

    monkeypatch.setattr(jit, "build_many", build_many)


DEFAULT_PRESET = ["prewarm", "--preset", "default", "--arch", "sm_80", "sm_89", "sm_90a", "--jobs", "4"]


def _header(stderr: str) -> list[str]:
    """What prewarm prints before the build's progress."""
    lines = stderr.splitlines()
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("  [1/"))]


def test_prewarm_prints_a_count_and_a_summary(fake_compiler, capsys):
    specs = cli.specs_from_args(cli.build_parser().parse_args(DEFAULT_PRESET))
    assert cli.main(DEFAULT_PRESET) == 0
    out, err = capsys.readouterr()
    assert max(len(line) for line in err.splitlines()) < 200, "a long line on stderr"
    header = _header(err)
    assert header[0] == f"flashjit prewarm: {len(specs)} configuration(s) for sm_80, sm_89, sm_90a"
    assert re.search(r"^  dtypes +float16, bfloat16, float32$", err, re.M)
    assert re.search(r"^  head_dims +64, 128, 256 \(mla_paged: ckv 512 \+ kpe 64\)$", err, re.M)
    assert not [line for line in header if any(s.name in line for s in specs)], "names listed without -v"
    assert f"flashjit: compiling {len(specs)} configuration(s) with 4 parallel nvcc job(s)\n" in err
    progress = [line for line in err.splitlines() if re.match(r"  \[\d+/\d+\] nvcc \S+$", line)]
    assert len(progress) == len(specs)
    assert f"{len(specs)} ready, 0 failed" in err
    assert len(out.splitlines()) == len(specs) + 1  # the table


def test_prewarm_verbose_lists_every_name(fake_compiler, capsys):
    specs = cli.specs_from_args(cli.build_parser().parse_args(DEFAULT_PRESET))
    assert cli.main([*DEFAULT_PRESET, "-v"]) == 0
    header = _header(capsys.readouterr().err)
    assert [line.strip() for line in header if line.startswith("    ")] == [s.name for s in specs]
