"""What the README, the docs and the code cite exists in the tree: relative links,
benchmarks/ paths and results files; the results index and the results folder
agree; README.md's performance table is the one benchmarks/summary.py generates."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SUMMARY = REPO / "benchmarks" / "summary.py"

# Markdown that links into the tree (results files themselves are records of a run, not checked).
MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md",
            REPO / "benchmarks" / "dev" / "README.md", RESULTS / "README.md"]
# Sources whose comments cite results files and benchmark scripts.
SOURCES = [*sorted((REPO / "flashjit").rglob("*.py")), *sorted(p for p in (REPO / "templates").rglob("*") if p.is_file()),
           *sorted((REPO / "benchmarks").glob("*.py")), *sorted((REPO / "benchmarks" / "dev").glob("*"))]

INLINE_LINK = re.compile(r"\]\(([^)\s]+)\)")
REFERENCE_LINK = re.compile(r"^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)
RESULTS_FILE = re.compile(r"\b20\d\d-\d\d-\d\d-[a-z0-9][a-z0-9-]*\.(?:md|png|json)\b")
BENCHMARKS_PATH = re.compile(r"\bbenchmarks/[\w./-]*\w\.(?:py|sh|md|png)\b")
MAX_RESULTS = 40


def relative(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def dangling_links(path: Path) -> list[str]:
    text = path.read_text()
    missing = []
    for target in INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same file
        if not (path.parent / target.split("#", 1)[0]).exists():
            missing.append(f"{relative(path)}: link {target}")
    return missing


def dangling_citations(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        return []
    missing = [f"{relative(path)}: results file {name}" for name in sorted(set(RESULTS_FILE.findall(text)))
               if not (RESULTS / name).exists()]
    missing += [f"{relative(path)}: {cited}" for cited in sorted(set(BENCHMARKS_PATH.findall(text)))
                if not (REPO / cited).exists()]
    return missing


def test_every_relative_link_resolves():
    missing = [line for path in MARKDOWN for line in dangling_links(path)]
    assert not missing, "links to files that are not in the tree:\n" + "\n".join(missing)


def test_every_cited_results_file_and_benchmark_script_exists():
    missing = [line for path in MARKDOWN + SOURCES for line in dangling_citations(path)]
    assert not missing, "citations of files that are not in the tree:\n" + "\n".join(missing)


def test_results_index_and_folder_agree():
    index = (RESULTS / "README.md").read_text()
    indexed = set(re.findall(r"^\| [^|]+ \| `([^`]+)`", index, re.MULTILINE))
    present = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert indexed, "the index lists no file"
    assert indexed == present, f"indexed, not present: {sorted(indexed - present)}; present, not indexed: {sorted(present - indexed)}"
    assert len(present) <= MAX_RESULTS


def test_the_link_checks_find_what_is_missing(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) [b](#anchor) [c](https://example.org)\n[d]: gone/x.md\n"
                    "see benchmarks/results/2000-01-01-none.md and benchmarks/dev/none.py\n")
    assert [line.split(": ", 1)[1] for line in dangling_links(page)] == ["link missing.md", "link gone/x.md"]
    cited = dangling_citations(page)
    assert any("2000-01-01-none.md" in line for line in cited) and any("benchmarks/dev/none.py" in line for line in cited)


def test_readme_performance_table_is_generated():
    run = subprocess.run([sys.executable, str(SUMMARY), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_summary_check_fails_on_an_edited_table(tmp_path):
    readme = (REPO / "README.md").read_text()
    begin = readme.index("<!-- perf-table:begin -->")
    edited = readme[:begin] + readme[begin:].replace(" of ", " out of ", 1)
    assert edited != readme
    copy = tmp_path / "README.md"
    copy.write_text(edited)
    run = subprocess.run([sys.executable, str(SUMMARY), "--check", "--readme", str(copy)], capture_output=True, text=True)
    assert run.returncode == 1
    assert "differs" in run.stderr
