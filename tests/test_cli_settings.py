"""Bad FLASHJIT_* settings reach the `flashjit` command as one line on stderr
naming the variable, what it takes and the fix, with a non-zero exit code and
nothing built; flashjit's other errors one line too; real bugs a traceback.
The command runs in-process (cli.main) against a private cache, and once as
`python -m flashjit` for the reported cases."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest

from flashjit import cli, jit
from flashjit.errors import JitDisabledError
from flashjit.spec import KernelSpec
from flashjit.jit import build_many as real_build_many
from helpers_cache import run_cli, set_cache_env


@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    """A valid environment (private cache, sm_80) in which nothing may be built."""
    root = set_cache_env(monkeypatch, tmp_path / "cache")
    for name in ("FLASHJIT_NVCC", "FLASHJIT_LOG_LEVEL", "FLASHJIT_STRICT_BACKEND"):
        monkeypatch.delenv(name, raising=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("a build was started despite a bad setting")

    monkeypatch.setattr(jit, "build_many", forbidden)
    return root


PREWARM_ONE = ["prewarm", "--op", "single_decode", "--dtype", "fp16", "--head-dim", "64"]


def _one_line_error(capsys, argv: list[str], variable: str, code: int = 2) -> str:
    assert cli.main(argv) == code
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert err.startswith(f"flashjit {argv[0]}: ") and variable in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "8 jobs"])
def test_bad_jobs(cli_env, monkeypatch, capsys, value):
    monkeypatch.setenv("FLASHJIT_JOBS", value)
    err = _one_line_error(capsys, PREWARM_ONE, "FLASHJIT_JOBS")
    assert f"got {value!r}" in err and "positive integer" in err
    _one_line_error(capsys, ["info"], "FLASHJIT_JOBS")


@pytest.mark.parametrize("value", ["sm_75", "8.0 7.5", "volta", " , "])
def test_bad_arch_list(cli_env, monkeypatch, capsys, value):
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", value)
    err = _one_line_error(capsys, PREWARM_ONE, "FLASHJIT_CUDA_ARCH_LIST")
    assert f"got {value!r}" in err and "9.0a" in err
    _one_line_error(capsys, ["info"], "FLASHJIT_CUDA_ARCH_LIST")


@pytest.mark.parametrize("value", ["maybe", "off", "on", "2", " 1"])
def test_bad_disable_jit(cli_env, monkeypatch, capsys, value):
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", value)
    err = _one_line_error(capsys, [*PREWARM_ONE, "--arch", "sm_80"], "FLASHJIT_DISABLE_JIT")
    assert f"got {value!r}" in err and "true" in err and "false" in err
    _one_line_error(capsys, ["info"], "FLASHJIT_DISABLE_JIT")


@pytest.mark.parametrize("value", ["maybe", "2", "strict", "on", " 1"])
def test_bad_strict_backend(cli_env, monkeypatch, capsys, value):
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", value)
    err = _one_line_error(capsys, PREWARM_ONE, "FLASHJIT_STRICT_BACKEND")
    assert f"got {value!r}" in err and "fa2" in err
    _one_line_error(capsys, ["info"], "FLASHJIT_STRICT_BACKEND")


@pytest.mark.parametrize("kind", ["missing", "directory", "not-executable"])
def test_bad_nvcc_path(cli_env, monkeypatch, capsys, tmp_path, kind):
    path = tmp_path / "nvcc"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-executable":
        path.write_text("")
    monkeypatch.setenv("FLASHJIT_NVCC", str(path))
    err = _one_line_error(capsys, PREWARM_ONE, "FLASHJIT_NVCC")
    assert str(path) in err and "bin/nvcc" in err
    _one_line_error(capsys, ["info"], "FLASHJIT_NVCC")


@pytest.mark.parametrize("value", ["loud", "10", "verbose"])
@pytest.mark.parametrize("argv", [PREWARM_ONE, ["cache", "list"], ["info"]], ids=lambda a: a[0])
def test_bad_log_level(cli_env, monkeypatch, capsys, value, argv):
    monkeypatch.setenv("FLASHJIT_LOG_LEVEL", value)
    err = _one_line_error(capsys, argv, "FLASHJIT_LOG_LEVEL")
    assert f"got {value!r}" in err and "WARNING" in err


def test_log_level_names_in_any_case(cli_env, monkeypatch, capsys):
    monkeypatch.setenv("FLASHJIT_LOG_LEVEL", "warning")
    assert cli.main(["cache", "list"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("kind", ["file", "symlink"])
@pytest.mark.parametrize("argv", [PREWARM_ONE, ["cache", "list"], ["cache", "verify"], ["cache", "clear"], ["info"]],
                         ids=" ".join)
def test_cache_dir_that_is_no_directory(cli_env, monkeypatch, capsys, tmp_path, kind, argv):
    bad = tmp_path / "not-a-dir"
    if kind == "file":
        bad.write_text("")
    else:
        (tmp_path / "elsewhere").mkdir()
        bad.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", str(bad))
    err = _one_line_error(capsys, argv, "FLASHJIT_CACHE_DIR")
    assert f"expected a directory, got a {'regular file' if kind == 'file' else 'symlink'}: {bad}" in err
    assert bad.is_file() or bad.is_symlink(), "the bad path was changed"


def test_cache_dir_below_a_file(cli_env, monkeypatch, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    err = _one_line_error(capsys, [*PREWARM_ONE, "--arch", "sm_80"], "FLASHJIT_CACHE_DIR", code=1)
    assert "Not a directory" in err


@pytest.fixture
def read_only_root(cli_env):
    """The cache root with its owner's write bit removed (0500)."""
    cli_env.mkdir(mode=0o700)
    os.chmod(cli_env, 0o500)
    yield cli_env
    os.chmod(cli_env, 0o700)


def test_read_only_cache_dir_refuses_a_miss_in_one_line(read_only_root, monkeypatch, capsys):
    """The refusal comes before anything is compiled, and the root keeps its mode."""
    monkeypatch.setattr(jit, "build_many", real_build_many)
    assert cli.main([*PREWARM_ONE, "--arch", "sm_80"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("flashjit prewarm: 1 configuration(s) for sm_80") and len(err) == 6, err
    assert err[-1].startswith("flashjit prewarm: cannot build single_decode_f16_d64_fa2_cc: the cache is read-only "
                              f"(FLASHJIT_CACHE_DIR={read_only_root}; mode 0500")
    assert stat.S_IMODE(os.stat(read_only_root).st_mode) == 0o500 and list(read_only_root.iterdir()) == []


def test_read_only_cache_dir_serves_its_hits(read_only_root, monkeypatch, capsys):
    monkeypatch.setattr(jit, "build_many", lambda specs, **kw: [
        jit.BuildResult(s, SimpleNamespace(path=read_only_root / s.name), False, 0.0) for s in specs])
    assert cli.main([*PREWARM_ONE, "--arch", "sm_80"]) == 0
    assert "1 configuration(s) ready (0 built, 1 cached)" in capsys.readouterr().err
    assert stat.S_IMODE(os.stat(read_only_root).st_mode) == 0o500


def test_missing_cache_dir_lists_nothing(cli_env, capsys):
    assert cli.main(["cache", "list"]) == 0
    assert capsys.readouterr() == ("", "")
    assert not cli_env.exists()


def test_jit_disabled_prewarm_names_the_setting(cli_env, monkeypatch, capsys):
    """With FLASHJIT_DISABLE_JIT=1 a prewarm can only confirm a cache; a miss
    names the setting that forbids building, not the prewarm command."""
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", "1")
    spec = KernelSpec.make("single_decode", "float16", 64)

    def miss(specs, **kwargs):
        raise JitDisabledError(f"{spec.name} is not in the cache and FLASHJIT_DISABLE_JIT is set; build it first "
                               f"with: flashjit prewarm ...")

    monkeypatch.setattr(jit, "build_many", miss)
    argv = [*PREWARM_ONE, "--arch", "sm_80"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (f"flashjit prewarm: {spec.name} is not in the cache and FLASHJIT_DISABLE_JIT=1 forbids "
                       f"compiling it; unset FLASHJIT_DISABLE_JIT (or set it to 0) to build")


def test_bugs_still_show_a_traceback(cli_env, monkeypatch):
    """Only flashjit's errors and bad settings become one line; anything else propagates."""
    def bug(*args, **kwargs):
        raise ValueError("not a setting")

    monkeypatch.setattr(jit, "build_many", bug)
    with pytest.raises(ValueError, match="not a setting"):
        cli.main([*PREWARM_ONE, "--arch", "sm_80"])


def test_bad_settings_from_the_command_line(tmp_path):
    """The reported case, end to end: FLASHJIT_JOBS=abc and a cache dir that is a file."""
    out = run_cli(*PREWARM_ONE, "--arch", "sm_80", root=tmp_path / "cache", timeout=120, FLASHJIT_JOBS="abc")
    assert out.returncode == 2 and out.stdout == ""
    assert [ln for ln in out.stderr.splitlines() if "Warning" not in ln and "_conversion_method" not in ln] == [
        "flashjit prewarm: FLASHJIT_JOBS: expected a positive integer, got 'abc'; set it to the number of parallel "
        "nvcc jobs (e.g. FLASHJIT_JOBS=8), or unset it for one per core and per 2 GiB of free memory"]
    (tmp_path / "file").write_text("")
    listed = run_cli("cache", "list", root=tmp_path / "file", timeout=120)
    assert listed.returncode == 2 and listed.stdout == "" and len(listed.stderr.splitlines()) == 1
    assert "FLASHJIT_CACHE_DIR" in listed.stderr and "regular file" in listed.stderr
