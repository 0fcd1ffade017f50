"""How the benchmarks time a call: CUDA events around back-to-back calls,
implementations of a row interleaved in rounds of alternating order. The
instruments in benchmarks/dev/ time the same way (they import these through
benchmarks/common.py), so that their numbers compare with the tables'."""

from __future__ import annotations

import sys


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


def round_orders(items: list, rounds: int):
    """The order in which to time `items` in each of `rounds` rounds: as given,
    then reversed, alternately. Timed once each in a fixed order, identical
    kernels differed with their place in it (docs/bench.md, "What it does");
    alternated, drift during a run falls on every item alike."""
    for rnd in range(rounds):
        yield list(items) if rnd % 2 == 0 else list(reversed(items))


def calls_per_sample(fn, sample_ms: float = 2.0) -> int:
    """After two warm-ups, how many back-to-back calls of fn last about
    `sample_ms` (1 to 50): enough that the host's launch work overlaps the
    GPU's as in a serving loop, instead of adding to a lone call's time."""
    for _ in range(2):
        fn()
    return max(1, min(50, int(sample_ms / max(event_ms(fn, 1), 1e-3))))


def bench_ms(fn, reps: int = 10, sample_ms: float = 2.0) -> float:
    """Median ms per call over `reps` samples (CUDA events) of
    calls_per_sample back-to-back calls each."""
    calls = calls_per_sample(fn, sample_ms)
    times = sorted(event_ms(fn, calls) / calls for _ in range(reps))
    return times[len(times) // 2]


def shuffled_ms(fns: dict, passes: int, sample_ms: float = 2.0, seed: int = 0) -> dict:
    """{name: `passes` samples of ms per call}: each pass takes one sample of
    every fn, in a fresh random order (seeded). Timed as whole cells, even in
    alternating rounds, a column's time depended on the kernel before it
    (docs/mla.md, "Measuring"); shuffled, every fn follows every other alike."""
    import random

    rng = random.Random(seed)
    calls = {name: calls_per_sample(fn, sample_ms) for name, fn in fns.items()}
    names, out = list(fns), {name: [] for name in fns}
    for _ in range(passes):
        rng.shuffle(names)
        for name in names:
            out[name].append(event_ms(fns[name], calls[name]) / calls[name])
    return out


# Calls per timing sample, at least: a sample starts on an idle GPU, and its
# first launch costs tens of µs that a lone call would carry whole, so a
# library estimated a little faster would get fewer calls a sample and carry
# more of that start (docs/bench.md, "What it does").
MIN_CALLS_PER_SAMPLE = 4


def time_us(fn, reps: int, target_us: float = 2000.0) -> tuple[float, str, int]:
    """(median µs per call, 'graph' or 'eager', calls per sample): each sample
    replays a CUDA graph of N calls (an eager loop where capture fails) / N."""
    import torch

    for _ in range(3):
        fn()
    est = event_ms(fn, 5) * 1e3 / 5
    inner = max(MIN_CALLS_PER_SAMPLE, min(500, int(target_us / max(est, 1.0))))
    runner, mode, graph = (lambda: event_ms(fn, inner)), "eager", None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        runner, mode = (lambda: event_ms(graph.replay)), "graph"
    except Exception as exc:
        print(f"  graph capture failed, timing eager: {type(exc).__name__}: {str(exc)[:150]}", file=sys.stderr)
    torch.cuda.synchronize()
    times = sorted(runner() for _ in range(reps))
    return times[len(times) // 2] * 1e3 / inner, mode, inner
