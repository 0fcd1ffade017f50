"""Shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations


def emit(text: str, out: str | None) -> None:
    """Prints a result table and appends it to `out` when given."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
