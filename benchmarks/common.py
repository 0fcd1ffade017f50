"""Shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations


def emit(text: str, out: str | None) -> None:
    """Prints a result table and appends it to `out` when given."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


def event_ms(fn, inner: int = 1) -> float:
    """Milliseconds between two CUDA events around `inner` back-to-back calls of fn."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
