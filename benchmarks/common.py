"""Shared by the benchmark scripts (run as `python benchmarks/NAME.py`) and by the
instruments in benchmarks/dev/, which put benchmarks/ on sys.path to import it."""

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


def kernel_times(fn, calls: int = 20) -> dict[str, float]:
    """Mean µs per call of each CUDA kernel that fn launches (torch.profiler)."""
    from collections import defaultdict

    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for event in prof.key_averages():
        if event.device_time_total > 0:
            times[event.key] += event.device_time_total / calls
    return dict(times)


def round_orders(items: list, rounds: int):
    """The order in which to time `items` in each of `rounds` rounds: as given,
    then reversed, alternately. Timed once each in a fixed order, identical
    kernels differed by 0-4% with their place in it
    (results/2026-11-22-h200-interleaved-timing.md); alternated, drift during a
    run falls on every item alike."""
    for rnd in range(rounds):
        yield list(items) if rnd % 2 == 0 else list(reversed(items))


def use_templates(folder) -> None:
    """Renders kernels from `folder` (a copy of another templates/ folder, e.g.
    from `git archive`), or from the package's own when None, so that a kernel
    change is measured against the sources before it in the same run."""
    from flashjit import render

    if not hasattr(use_templates, "own"):
        use_templates.own = render.templates_dir
    render.templates_dir = (lambda: folder) if folder else use_templates.own
    render.environment.cache_clear()
    render.generator_digest.cache_clear()
