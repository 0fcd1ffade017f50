"""FLASHJIT_* settings read by the library when it is used from Python (no
CLI): a value it cannot use is a SettingError (a FlashjitError and a
ValueError) naming the variable, what it takes and what came, raised before
anything is built, never skipped or guessed at. The CLI calls the same
parsers, so its one-line errors are these messages (tests/test_cli_settings.py).
No GPU and no nvcc needed: every bad value is refused before either."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from flashjit import arch, build, cli, jit
from flashjit.errors import FlashjitError, SettingError, ToolchainError
from helpers_cache import SMALL_SPEC, entry_dirs, fresh_cache  # noqa: F401  (fixture)


@pytest.fixture
def settings_env(fresh_cache, monkeypatch):
    """A private cache (sm_80), the settings under test unset, nothing compiled."""
    for name in ("FLASHJIT_NVCC", "FLASHJIT_STRICT_BACKEND", "FLASHJIT_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("a build was started despite a bad setting")

    monkeypatch.setattr(build, "run_builds", forbidden)
    return fresh_cache


def _api_paths():
    """The ways Python code reaches the settings: a prewarm from Python and a kernel lookup."""
    return [lambda: jit.build_many([SMALL_SPEC]), lambda: jit.get_module(SMALL_SPEC)]


def _setting_error(call, variable: str) -> str:
    with pytest.raises(SettingError) as info:
        call()
    assert isinstance(info.value, FlashjitError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(f"{variable}: expected "), message
    assert "\n" not in message
    return message


def _cli_agrees(capsys, message: str) -> None:
    """`flashjit info` reports the library's message, word for word."""
    assert cli.main(["info"]) == 2
    assert f"flashjit info: {message}\n" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# FLASHJIT_CUDA_ARCH_LIST

@pytest.mark.parametrize("value,bad", [("sm_75", "sm_75"), ("8.0 7.5", "7.5"), ("volta", "volta"),
                                       ("9.0a,sm_70", "sm_70")])
def test_bad_arch_list(settings_env, monkeypatch, capsys, value, bad):
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", value)
    message = _setting_error(arch.env_arches, "FLASHJIT_CUDA_ARCH_LIST")
    assert f"got {value!r}, where {bad!r} is none of them" in message
    assert "sm_80" in message and "sm_90a" in message and "8.0" in message and "9.0a" in message
    for call in [jit.resolve_arches, *_api_paths()]:
        assert _setting_error(call, "FLASHJIT_CUDA_ARCH_LIST") == message
    assert entry_dirs(settings_env) == []
    _cli_agrees(capsys, message)


@pytest.mark.parametrize("value", [" , ", " ", ";;"])
def test_arch_list_naming_no_arch(settings_env, monkeypatch, capsys, value):
    """Was read as unset (this GPU, else the default set) without a word."""
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", value)
    message = _setting_error(arch.env_arches, "FLASHJIT_CUDA_ARCH_LIST")
    assert message.startswith(f"FLASHJIT_CUDA_ARCH_LIST: expected at least one arch, got {value!r}; ")
    for call in _api_paths():
        assert _setting_error(call, "FLASHJIT_CUDA_ARCH_LIST") == message
    _cli_agrees(capsys, message)


def test_good_arch_lists(monkeypatch):
    monkeypatch.delenv("FLASHJIT_CUDA_ARCH_LIST", raising=False)
    assert arch.env_arches() is None
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "")
    assert arch.env_arches() is None
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a, 8.0;sm_89 8.0")
    assert arch.env_arches() == ("sm_80", "sm_89", "sm_90a")


def test_an_arch_named_in_code_stays_a_toolchain_error():
    """Not a setting: an arch passed as an argument keeps its own error."""
    with pytest.raises(ToolchainError, match=r"arch: expected one of sm_80.*got 'sm_75'"):
        jit.resolve_arches(["sm_75"])


# ---------------------------------------------------------------------------
# FLASHJIT_DISABLE_JIT

@pytest.mark.parametrize("value,disabled", [("", False), ("0", False), ("false", False), ("No", False),
                                            ("FALSE", False), ("1", True), ("true", True), ("YES", True)])
def test_disable_jit_words(monkeypatch, value, disabled):
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", value)
    assert jit.jit_disabled() is disabled


def test_disable_jit_unset_is_enabled(monkeypatch):
    monkeypatch.delenv("FLASHJIT_DISABLE_JIT", raising=False)
    assert jit.jit_disabled() is False


@pytest.mark.parametrize("value", ["maybe", "off", "on", "2", " 1", "disabled"])
def test_bad_disable_jit(settings_env, monkeypatch, capsys, value):
    """'off' was read as 'disabled' (anything not 0/false/no/empty was)."""
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", value)
    message = _setting_error(jit.jit_disabled, "FLASHJIT_DISABLE_JIT")
    assert f"got {value!r}" in message and "1, true or yes" in message and "0, false, no or empty" in message
    for call in _api_paths():
        assert _setting_error(call, "FLASHJIT_DISABLE_JIT") == message
    assert not settings_env.exists(), "the cache was touched before the setting was checked"
    _cli_agrees(capsys, message)


# ---------------------------------------------------------------------------
# FLASHJIT_NVCC

def _fake_nvcc(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("kind", ["missing", "directory", "not-executable"])
def test_bad_nvcc_path_is_not_skipped(settings_env, monkeypatch, capsys, tmp_path, kind):
    """A usable nvcc elsewhere (CUDA_HOME) must not stand in for the one named."""
    path = tmp_path / "named" / "nvcc"
    path.parent.mkdir()
    if kind == "directory":
        path.mkdir()
    elif kind == "not-executable":
        path.write_text("")
        path.chmod(0o644)
    _fake_nvcc(tmp_path / "home" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FLASHJIT_NVCC", str(path))
    message = _setting_error(arch.find_nvcc, "FLASHJIT_NVCC")
    what = {"missing": "no such file", "directory": "a directory", "not-executable": "not executable"}[kind]
    assert f"got {str(path)!r} ({what})" in message and "bin/nvcc" in message and "unset it" in message
    for call in [arch.require_nvcc, arch.env_nvcc, *_api_paths()]:
        assert _setting_error(call, "FLASHJIT_NVCC") == message
    assert not settings_env.exists(), "the cache was touched before the setting was checked"
    _cli_agrees(capsys, message)


def test_good_nvcc_path(monkeypatch, tmp_path):
    nvcc = _fake_nvcc(tmp_path / "x" / "nvcc")
    monkeypatch.setenv("FLASHJIT_NVCC", str(nvcc))
    assert arch.env_nvcc() == arch.find_nvcc() == str(nvcc)
    monkeypatch.setenv("FLASHJIT_NVCC", "")  # empty: unset, the search goes on
    assert arch.env_nvcc() is None
    home = _fake_nvcc(tmp_path / "home" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    assert arch.find_nvcc() == str(home)


# ---------------------------------------------------------------------------
# FLASHJIT_STRICT_BACKEND and FLASHJIT_JOBS

@pytest.mark.parametrize("value", ["maybe", "2", "strict", " Yes please"])
def test_bad_strict_backend(settings_env, monkeypatch, capsys, value):
    monkeypatch.setenv("FLASHJIT_STRICT_BACKEND", value)
    message = _setting_error(arch.strict_backend, "FLASHJIT_STRICT_BACKEND")
    assert message.startswith(f"FLASHJIT_STRICT_BACKEND: expected 0 or 1 (or true/false, yes/no), got {value!r}; ")
    assert "fa2" in message
    # Where the library reads it: an explicit fa3 the target cannot run.
    with pytest.raises(SettingError, match="FLASHJIT_STRICT_BACKEND: expected 0 or 1"):
        arch.choose_backend("single_prefill", "bfloat16", True, "fa3", targets=("sm_80",))
    _cli_agrees(capsys, message)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "8 jobs"])
def test_bad_jobs(settings_env, monkeypatch, capsys, value):
    monkeypatch.setenv("FLASHJIT_JOBS", value)
    message = _setting_error(build.default_jobs, "FLASHJIT_JOBS")
    assert message == (f"FLASHJIT_JOBS: expected a positive integer, got {value!r}; set it to the number of parallel "
                       f"nvcc jobs (e.g. FLASHJIT_JOBS=8), or unset it for one per core and per 2 GiB of free memory")
    _cli_agrees(capsys, message)


# ---------------------------------------------------------------------------
# The build's log: the count at INFO, the names at DEBUG

def _jobs(tmp_path: Path, count: int) -> list[build.BuildJob]:
    """Jobs whose 'nvcc' writes the output it is given (a real ninja run, nothing compiled)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    nvcc.chmod(0o755)
    jobs = []
    for i in range(count):
        name = f"config_{i:02d}_with_a_long_name"
        build_dir = tmp_path / "builds" / name
        build_dir.mkdir(parents=True)
        (build_dir / f"{name}.cu").write_text("")
        jobs.append(build.BuildJob(name, build_dir, str(nvcc), ["-o", f"lib{name}.so", f"{name}.cu"],
                                   f"lib{name}.so"))
    return jobs


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_build_logs_the_count_at_info_and_the_names_at_debug(tmp_path, caplog, level):
    jobs = _jobs(tmp_path, 12)
    (tmp_path / "scratch").mkdir()
    with caplog.at_level(level, logger="flashjit"):
        build.run_builds(jobs, tmp_path / "scratch", n_jobs=2)
    assert all(job.error is None for job in jobs), [job.error for job in jobs]
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert "flashjit: compiling 12 configuration(s) with 2 parallel nvcc job(s)" in info
    assert max(len(m) for m in info) < 120, "a long line at INFO"
    batch = next(m for m in info if m.startswith("flashjit: compiling "))
    assert not any(job.name in batch for job in jobs), "names in the INFO batch line"
    if level == logging.DEBUG:
        assert [m for m in debug if m.startswith("flashjit: to compile: ")] == \
            [f"flashjit: to compile: {job.name}" for job in jobs]
    else:
        assert debug == []
