"""No source line over 160 characters in flashjit/, templates/, tests/ and
benchmarks/. Source: Python, CUDA (.cu, .cuh, .h), Jinja templates and shell
scripts; prose (Markdown) and data files are not held to it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("flashjit", "templates", "tests", "benchmarks")
SOURCE_SUFFIXES = {".py", ".cu", ".cuh", ".h", ".jinja", ".sh"}
MAX_CHARS = 160


def source_files(root: Path = ROOT):
    for tree in TREES:
        for path in sorted((root / tree).rglob("*")):
            parts = path.relative_to(root).parts
            if path.is_file() and path.suffix in SOURCE_SUFFIXES \
                    and not any(p.startswith(".") or p == "__pycache__" for p in parts):
                yield path


def long_lines(path: Path, limit: int = MAX_CHARS) -> list[tuple[int, int]]:
    """(line number, length) of every line of path longer than limit characters."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return [(n, len(line)) for n, line in enumerate(text.splitlines(), 1) if len(line) > limit]


def test_no_source_line_over_160_characters():
    files = list(source_files())
    assert any(p.name == "fa3_wgmma.cuh" for p in files) and len(files) > 100  # the walk finds the trees
    over = {str(p.relative_to(ROOT)): found for p in files if (found := long_lines(p))}
    assert not over, "lines over 160 characters (file: [(line, length), ...]): " + "; ".join(
        f"{name}: {found[:5]}" for name, found in sorted(over.items()))


def test_long_lines_counts_characters_not_bytes(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("x" * 160 + "\n" + "µ" * 161 + "\n" + "y" * 10 + "\n", encoding="utf-8")
    assert long_lines(sample) == [(2, 161)]
