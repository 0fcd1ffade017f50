"""What the `flashjit` command prints: the build's progress line (fed fake
BuildProgress events and a fake clock), durations and sizes, `cache list`'s
table (over fake cache entries), and the reports' flashjit version and commit
(the commit only from flashjit's own checkout, tried in temporary git repos)."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashjit import cache, cli, cli_output
from flashjit.bench import report as bench_report
from flashjit.numerics import report as numerics_report
from helpers_cache import REPO, set_cache_env


def event(done: int, total: int, ok: bool = True):
    return SimpleNamespace(done=done, total=total, name=f"config_{done}", seconds=1.0, ok=ok)


class Clock:
    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        return self.now


def feed(display, clock, total: int, failing=()):
    for done in range(1, total + 1):
        clock.now += clock.step
        display(event(done, total, ok=done not in failing))
    display.finish()


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (41.4, "41s"), (59.6, "1m00s"), (72, "1m12s"), (221, "3m41s"),
                                          (3900, "1h05m")])
def test_duration(seconds, text):
    assert cli_output.duration(seconds) == text


@pytest.mark.parametrize("nbytes,text", [(0, "0 B"), (999, "999 B"), (4200, "4.2 kB"), (61_000_000, "61 MB"),
                                         (185_400_000, "185 MB"), (1_300_000_000, "1.3 GB")])
def test_size(nbytes, text):
    assert cli_output.size(nbytes) == text


def test_progress_in_a_log_is_about_twenty_lines_with_eta():
    stream, clock = io.StringIO(), Clock(2.0)
    display = cli_output.BuildProgressLine(stream, clock=clock, tty=False)
    feed(display, clock, 125)
    lines = stream.getvalue().splitlines()
    assert 18 <= len(lines) <= 22, "about one line per twentieth"
    assert lines[0] == "[  1/125] elapsed 2s, ETA 4m08s  last: config_1"
    assert lines[-1] == "[125/125] elapsed 4m10s, ETA 0s  last: config_125"
    done = [int(re.match(r"\[ *(\d+)/", line).group(1)) for line in lines]
    assert done == sorted(done) and max(b - a for a, b in zip(done, done[1:])) <= 7


def test_progress_counts_cached_configurations_without_showing_them():
    stream, clock = io.StringIO(), Clock(3.0)
    display = cli_output.BuildProgressLine(stream, clock=clock, tty=False)
    for done in range(1, 101):
        display(SimpleNamespace(done=done, total=125, name=f"config_{done}", seconds=0.0, ok=True, cached=True))
    assert stream.getvalue() == "", "a cached configuration is no progress line"
    clock.now = 0.0
    for done in range(101, 126):
        clock.now += 3.0
        display(event(done, 125))
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[101/125] elapsed 3s, ETA 1m12s  last: config_101", "the ETA from the builds' rate"
    assert lines[-1] == "[125/125] elapsed 1m15s, ETA 0s  last: config_125"
    assert 12 <= len(lines) <= 22


def test_progress_of_a_few_prints_each_and_a_failure_at_once():
    stream, clock = io.StringIO(), Clock(10.0)
    display = cli_output.BuildProgressLine(stream, clock=clock, tty=False)
    feed(display, clock, 3, failing={2})
    assert stream.getvalue().splitlines() == [
        "[1/3] elapsed 10s, ETA 20s  last: config_1",
        "[2/3] elapsed 20s, ETA 10s, 1 failed  last: config_2",
        "[3/3] elapsed 30s, ETA 0s, 1 failed  last: config_3"]


def test_progress_on_a_terminal_rewrites_one_line():
    stream, clock = io.StringIO(), Clock(1.0)
    display = cli_output.BuildProgressLine(stream, clock=clock, tty=True)
    feed(display, clock, 12)
    text = stream.getvalue()
    assert text.count("\r") == 12 and text.count("\n") == 1 and text.endswith("\n")
    assert text.rstrip("\n").split("\r")[-1].rstrip() == "[12/12] elapsed 12s, ETA 0s  last: config_12"


def test_progress_finish_without_events_prints_nothing():
    stream = io.StringIO()
    cli_output.BuildProgressLine(stream, tty=True).finish()
    assert stream.getvalue() == ""


# ---------------------------------------------------------------------------
# flashjit cache list

NAMES = ["single_decode_f16_d128_fa2_cc", "append_paged_bf16_d64", "single_decode_f16_d64_fa2_cc",
         "mla_paged_bf16_qk576_vo512_fa3_tc_lse", "single_prefill_bf16_d256_fa2_tc", "single_prefill_f32_d64_fa2_cc",
         "single_prefill_bf16_d64_fa2_tc_causal", "single_prefill_bf16_d64_fa2_tc",
         "batch_decode_paged_f16_d64_fa2_cc_lse"]
ORDER = ["single_prefill_bf16_d64_fa2_tc", "single_prefill_bf16_d64_fa2_tc_causal", "single_prefill_bf16_d256_fa2_tc",
         "single_prefill_f32_d64_fa2_cc", "single_decode_f16_d64_fa2_cc", "single_decode_f16_d128_fa2_cc",
         "batch_decode_paged_f16_d64_fa2_cc_lse", "mla_paged_bf16_qk576_vo512_fa3_tc_lse", "append_paged_bf16_d64"]


@pytest.fixture
def fake_entries(monkeypatch, tmp_path):
    """cache.iter_entries replaced by entries whose directories hold files of known size."""
    root = set_cache_env(monkeypatch, tmp_path / "cache")
    entries = []
    for i, name in enumerate(NAMES):
        path = root / name / f"{i:024x}"
        path.mkdir(parents=True)
        (path / "lib.so").write_bytes(b"x" * (1000 * (i + 1)))
        entries.append((path, SimpleNamespace(manifest={"name": name, "arches": ["sm_80", "sm_90a"],
                                                        "key": path.name}), []))
    monkeypatch.setattr(cache, "iter_entries", lambda r: iter(entries))
    return root, entries


def test_cache_list_is_a_sorted_aligned_table_with_a_total(fake_entries, capsys):
    root, _ = fake_entries
    assert cli.main(["cache", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["configuration", "arches", "size", "key"]
    assert [line.split()[0] for line in lines[1:-1]] == ORDER, "op, dtype, then head dim as a number"
    for column in ("arches", "key"):
        starts = {line.index("sm_80" if column == "arches" else "0000", len(line.split()[0])) for line in lines[1:-1]}
        assert starts == {lines[0].index(column)}, f"the {column} column is aligned"
    size_ends = {line.index(" kB") + 3 for line in lines[1:-1]}
    assert size_ends == {lines[0].index("size") + 4}, "sizes right-aligned under their header"
    assert " 1.0 kB " in lines[ORDER.index(NAMES[0]) + 1] and " 9.0 kB " in lines[ORDER.index(NAMES[-1]) + 1]
    assert lines[-1] == f"{len(NAMES)} configurations, {cli_output.size(1000 * 45)}, in {root}/<configuration>/<key>"


def test_cache_list_names_a_bad_entry_after_the_table(fake_entries, monkeypatch, capsys):
    root, entries = fake_entries
    bad = (root / "single_decode_f16_d64_fa2_cc" / "broken", None, ["artifact sha256 mismatch"])
    monkeypatch.setattr(cache, "iter_entries", lambda r: iter([*entries, bad]))
    assert cli.main(["cache", "list"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"BAD  {bad[0]}: artifact sha256 mismatch"
    assert lines[-2].startswith(f"{len(NAMES)} configurations, ")


def test_entry_order_from_the_name_alone():
    assert sorted(NAMES, key=cli_output.entry_order) == ORDER


# ---------------------------------------------------------------------------
# The reports' version and commit


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def _commit_seen_by(package_parent: Path, **env: str) -> str:
    """git_commit() of the copy of flashjit under package_parent, run from / (so that no other copy imports)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("FLASHJIT_COMMIT", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", "from flashjit.bench.report import git_commit; print(git_commit())"],
                         cwd=package_parent.anchor, capture_output=True, text=True, timeout=60, check=True,
                         env={**clean, "PYTHONPATH": str(package_parent), **env})
    return out.stdout.strip()


def _repo_with_copy(top: Path, package_at: str, templates: bool) -> Path:
    (top / package_at).mkdir(parents=True)
    shutil.copytree(REPO / "flashjit", top / package_at / "flashjit", ignore=shutil.ignore_patterns("__pycache__"))
    if templates:
        shutil.copytree(REPO / "templates", top / "templates", ignore=shutil.ignore_patterns("__pycache__"))
    _git(top, "init", "-q")
    _git(top, "add", "-A")
    _git(top, "commit", "-q", "-m", "c")
    return top / package_at


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_only_from_flashjits_own_checkout(tmp_path):
    own = _repo_with_copy(tmp_path / "own", ".", templates=True)
    assert _commit_seen_by(own) == _git(tmp_path / "own", "rev-parse", "--short", "HEAD")
    # An installed copy inside another project's checkout, and one inside a
    # flashjit checkout that is not the checkout's own package: no commit.
    other = _repo_with_copy(tmp_path / "other", "venv/site-packages", templates=False)
    assert _commit_seen_by(other) == "None"
    beside = _repo_with_copy(tmp_path / "beside", "site", templates=True)
    shutil.copytree(beside / "flashjit", tmp_path / "beside" / "flashjit")
    assert _commit_seen_by(beside) == "None"
    assert _commit_seen_by(other, FLASHJIT_COMMIT="1234abc") == "1234abc"
    plain = tmp_path / "plain" / "lib"
    shutil.copytree(REPO / "flashjit", plain / "flashjit", ignore=shutil.ignore_patterns("__pycache__"))
    assert _commit_seen_by(plain) == "None"


def test_reports_name_the_version_and_a_commit_only_where_known():
    meta = {"device": "NVIDIA H200", "date": "2026-11-25T10:00:00", "commit": None, "flashjit": "0.1.0",
            "torch": "2.11.0", "cuda": "13.0", "flashinfer": None, "quick": True, "argv": []}
    bench = bench_report.markdown({"meta": meta, "sections": {}})
    assert "; flashjit 0.1.0; torch 2.11.0;" in bench and "commit" not in bench
    bench = bench_report.markdown({"meta": {**meta, "commit": "abc1234"}, "sections": {}})
    assert "; flashjit 0.1.0 (commit abc1234); torch" in bench
    rows = [{"config": "single_decode_f16_d64_fa2_cc", "case": "-", "status": "skipped", "reason": "r",
             "op": "single_decode", "dtype": "float16"}]
    numerics = numerics_report.markdown({"meta": {"device": "X", "commit": None, "flashjit": "0.1.0", "seeds": 3},
                                         "rows": rows}).splitlines()[2]
    assert numerics == "device X; flashjit 0.1.0; seeds 3"
    numerics = numerics_report.markdown({"meta": {"device": "X", "commit": "abc1234", "flashjit": "0.1.0"},
                                         "rows": rows}).splitlines()[2]
    assert numerics == "device X; flashjit 0.1.0 (commit abc1234)"
