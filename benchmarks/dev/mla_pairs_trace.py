"""Where a step of the fa3 MLA pairs kernel (fa3/fa3_mla_pairs.cuh) spends its
time: builds it from a copy of templates/ with clock64 stamps added at each
hand-off, product issue and wait of both warpgroups' first threads, runs rows of
benchmarks/mla.py (pages of 64: the pairs kernel's launches) with a tiling that
has pairs=True, and reports the median of each interval over the CTAs' middle
steps (a step: two tiles, one per warpgroup), in SM cycles and in ns.

Non-split plans only (the stamps go to the partial-output pointer). Intervals
between the two warpgroups' clocks carry their skew, which the header reports.

Usage: python benchmarks/dev/mla_pairs_trace.py [--rows 1 2 0] [--tiling 'Fa3MlaTiling(...)']
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
sys.path.insert(0, str(Path(__file__).resolve().parent))  # dev/: mla_trace
from mla_trace import clocks_code, entry_code, print_cta_phases, print_intervals  # noqa: E402
from mla_trace import stamped_runs, time_code, use_instrumented  # noqa: E402
from common import instrumented_templates, parse_fa3_mla_tiling  # noqa: E402

from flashjit import render  # noqa: E402

HEADER = "include/flashjit/fa3/fa3_mla_pairs.cuh"
STEPS, EVENTS, HEAD = 32, 19, 11  # stamped steps, stamps a step, header words a CTA
STRIDE = HEAD + STEPS * EVENTS
# (name, thread, anchor, "before" or "after" its first occurrence); event e is the e-th entry.
EVENT_PROBES = [
    ("wg0 step start (S_a landed)", 0, "      zero_tail(a, 0);\n", "before"),
    ("wg0 scale0 sent", 0, "      hand(fa3::kScale0);\n", "after"),
    ("wg0 own P.V issued", 0, "      pv_own(0);\n", "after"),
    ("wg0 own P.V landed", 0, "      if (next_a && ctid == 0) let_go(fa3::kRefill0Low);\n", "before"),
    ("wg0 past scale1", 0, "        take(fa3::kScale1, a);\n", "after"),
    ("wg0 P0 sent", 0, "      hand(fa3::kP0);\n", "after"),
    ("wg0 past p1", 0, "        take(fa3::kP1, a);\n", "after"),
    ("wg0 S blocks 0-3 issued", 0, "          fa3::wait<4>();\n", "before"),
    ("wg0 other P.V landed", 0,
     "        fa3::fence_operands(o);\n        if (next_b && ctid == 0) let_go(fa3::kRefill1Low);\n", "before"),
    ("wg0 S issued", 0, "        fa3::wait<0>();\n        fa3::fence_operands(s);\n        fa3::fence_operands(o);\n",
     "before"),
    ("wg1 step start (S_b landed)", 128, "        zero_tail(b, 1);\n", "before"),
    ("wg1 past scale0", 128, "      take(fa3::kScale0, a);\n", "after"),
    ("wg1 scale1 sent", 128, "        hand(fa3::kScale1);\n", "after"),
    ("wg1 own P.V issued", 128, "        pv_own(1);\n", "after"),
    ("wg1 past p0", 128, "      take(fa3::kP0, a);\n", "after"),
    ("wg1 own P.V landed", 128, "        fa3::wait<1>();\n", "after"),
    ("wg1 other P.V landed", 128,
     "      fa3::fence_operands(o);\n      if (next_a && ctid == 0) let_go(fa3::kRefill0High);\n",
     "before"),
    ("wg1 S blocks 4-7 issued", 128, "        fa3::mla_s_blocks<T, 4, BLOCKS - 1, 4, Tile>", "before_next_line"),
    ("wg1 S issued", 128, "        fa3::mla_s_blocks<T, BLOCKS - 1, BLOCKS, 4, Tile>", "before_next_line"),
]
ENTRY, EXIT = entry_code(STRIDE), clocks_code(128, 2)

def probes(text: str) -> list:
    """(anchor, code, where) for common.insert_probes; "before_next_line"
    stamps ahead of the statement after the anchor's (a call over lines)."""
    out = [("  const int tid = threadIdx.x, wg = tid / 128,", ENTRY, "before"),
           ("  const CtaWork w = decode_work<true>(p, ROWS);\n", clocks_code(0, 0), "after"),  # past the grid before
           ("      q_smem, fa3::kOwnWarpgroup0 + wg, 128, ctid);\n", time_code(0, 7), "after"),
           ("  // Each warpgroup summed its own tiles' P; the two sums meet here.\n", time_code(0, 9), "before"),
           ("  take(fa3::kSums, 0);\n", time_code(0, 10), "after"),
           ("  // Each warpgroup summed its own tiles' P; the two sums meet here.\n", EXIT, "before"),
           ("  auto parity = [](int t) { return uint32_t((t / 2) & 1); };\n  if (wg == 2) {\n",
            "  if (threadIdx.x == 0) fj_out[4] = clock64();\n  if (threadIdx.x == 128) fj_out[5] = clock64();\n",
            "after_first_line")]
    for e, (_, thread, anchor, where) in enumerate(EVENT_PROBES):
        code = (f"{' ' * 6}if (threadIdx.x == {thread} && a / 2 < {STEPS}) "
                f"fj_out[{HEAD} + (a / 2) * {EVENTS} + {e}] = clock64();\n")
        if where == "before_next_line":
            start = text.index(anchor)
            anchor = text[start:text.index(";\n", start) + 2]
            where = "after"
        out.append((anchor, code, where))
    return out


def intervals(t: torch.Tensor) -> dict:
    """Median cycles of each interval over every CTA's middle steps (from the
    3rd to the 3rd from last), from the [CTAs, STEPS, EVENTS] stamps."""
    t = t.double()
    num = int((t[0, :, 0] > 0).sum())
    mid = slice(3, max(4, min(num, STEPS) - 3))
    cur, nxt = t[:, mid], t[:, mid.start + 1: mid.stop + 1]
    names = [name for name, *_ in EVENT_PROBES]
    parts = {"step period (wg0's S landed to the next)": nxt[..., 0] - cur[..., 0],
             "wg1's period": nxt[..., 10] - cur[..., 10]}
    for first, last in [(0, 9), (10, 18)]:
        for e in range(first, last):
            parts[f"{names[e]} -> {names[e + 1]}"] = cur[..., e + 1] - cur[..., e]
        parts[f"{names[last]} -> next {names[first]}"] = nxt[..., first] - cur[..., last]
    parts["wg0 step start -> wg1 step start (clock skew included)"] = cur[..., 10] - cur[..., 0]
    return {k: statistics.median(v.flatten().tolist()) for k, v in parts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2], help="indices into benchmarks/mla.py's ROWS")
    parser.add_argument("--tiling", default="Fa3MlaTiling(stages=2, key_groups=3, early_release=True, tma=True, "
                        "pairs=True)", help="a Fa3MlaTiling(...) expression with pairs=True")
    parser.add_argument("--templates", help="a templates/ folder to instrument (default: the package's)")
    args = parser.parse_args()
    source = Path(args.templates or render.templates_dir())
    use_instrumented(instrumented_templates(HEADER, probes((source / HEADER).read_text()), source=source,
                                            prefix="mla-pairs-trace-"), "mla-pairs-trace-cache-")
    tiling = parse_fa3_mla_tiling(args.tiling)
    print(f"{torch.cuda.get_device_name()}, flashjit fa3 MLA ({args.tiling}), bf16")
    for label, ctas, steps, ghz, skew, cta_us, head in stamped_runs(args.rows, tiling, HEAD, (STEPS, EVENTS)):
        print(f"\n{label}: {ctas} CTAs, median CTA {cta_us:.1f} us, SM clock {ghz:.2f} GHz; warpgroup 1's clock "
              f"read {skew:.0f} cycles after warpgroup 0's leaving one barrier\n")
        print_intervals(intervals(steps), ghz, "CTAs and middle steps")
        print()
        print_cta_phases(head, steps[..., 0], ghz)
        ends = {"wg1's loop end -> wg0's": head[:, 9] - head[:, 2], "wg0's loop end -> past the row sums":
                head[:, 10] - head[:, 9], "past the row sums -> wg0's last store issued": head[:, 7] - head[:, 10]}
        print_intervals({k: statistics.median((v * ghz).tolist()) for k, v in ends.items()}, ghz, "CTAs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
