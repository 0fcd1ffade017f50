"""Where a tile of the fa3 MLA kernel's time goes: builds the loader kernel
(fa3_mla.cuh; the shipped tiling with pairs off, since launches of more than 64
heads otherwise run the pairs kernel, which dev/mla_pairs_trace.py stamps) from
a copy of templates/ with clock64 stamps added (the loader's first thread: slot
free and boxes issued, each key group landed; the softmax consumer's first
thread: S issued, past each key group's barrier, S landed, P.V issued, slot
released; the other consumer's first thread: hand-off passed, slot released),
runs rows of benchmarks/mla.py, and reports the median of each interval over
the CTAs' middle tiles, in SM cycles and in ns (the SM clock from %globaltimer
against clock64 over each CTA).

Non-split plans only: the stamps go to the partial-output pointer, which such
a plan leaves unused. The instrumented copy lives in a temporary folder; the
shipped templates are not touched. Only whole tiles by TMA are stamped
(pages of 64, more than 64 heads); gathered tiles leave the loader's stamps 0.

Usage: python benchmarks/dev/mla_trace.py [--rows 1 2] [--tiling 'Fa3MlaTiling(...)']
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, mla
import mla  # noqa: E402
from common import fa3_mla_tiling, parse_fa3_mla_tiling, use_templates  # noqa: E402
from common import instrumented_templates as common_instrumented  # noqa: E402

import flashjit  # noqa: E402
from flashjit import jit  # noqa: E402
from flashjit.kernels import fa3  # noqa: E402

HEADER = "include/flashjit/fa3/fa3_mla.cuh"
TILES, EVENTS, HEAD = 64, 16, 11  # stamped tiles, stamps a tile, header words a CTA
STRIDE = HEAD + TILES * EVENTS
# Stamp slots of a tile.
SLOT_FREE, ISSUED, LANDED0 = 0, 1, 2  # loader; LANDED0 + g for key group g
S_ISSUE, GROUP0, S_LANDED, PV_ISSUE, RELEASE1 = 5, 6, 9, 10, 11  # softmax consumer; GROUP0 + g
HANDOFF, RELEASE0, AT_HANDOFF = 12, 13, 14  # the other consumer


def stamp(thread: int, slot: int, t: str = "t", indent: str = "      ") -> str:
    """CUDA by which thread `thread` writes clock64 into slot `slot` of tile `t`."""
    return (f"{indent}if (threadIdx.x == {thread} && ({t}) < {TILES}) fj_out[{HEAD} + ({t}) * {EVENTS} + {slot}] = "
            "clock64();\n")


def time_code(thread: int, word: int, clock: bool = False, sm_word: int | None = None) -> str:
    """CUDA by which thread `thread` writes globaltimer into word `word` and,
    with `clock`, clock64 into word + 1; with sm_word, its SM there."""
    return (f"  if (threadIdx.x == {thread}) {{\n"
            "    unsigned long long fj_g;\n"
            "    asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(fj_g));\n"
            f"    fj_out[{word}] = fj_g;\n"
            + (f"    fj_out[{word + 1}] = clock64();\n" if clock else "")
            + ("    unsigned fj_sm;\n    asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(fj_sm));\n"
               f"    fj_out[{sm_word}] = fj_sm;\n" if sm_word is not None else "")
            + "  }\n")


def entry_code(stride: int) -> str:
    """CUDA for a kernel's first line: fj_out, this CTA's `stride` stamp words,
    thread 0's globaltimer in word 6 and its SM in word 8 (words 7, 9, 10: the
    loop's end to the last store, time_code)."""
    return (f"  unsigned long long* fj_out = reinterpret_cast<unsigned long long*>(p.partial_o) + {stride} * "
            "size_t(blockIdx.x);\n" + time_code(0, 6, sm_word=8))


def clocks_code(thread: int, word: int) -> str:
    """CUDA by which thread `thread` writes globaltimer and clock64 into words `word` and `word` + 1."""
    return time_code(thread, word, clock=True)


ENTRY, EXIT = entry_code(STRIDE), clocks_code(256, 2)
# (anchor in the shipped kernel, code, "before" or "after" the anchor's first occurrence)
PROBES = [
    # "Entry" is past decode_work, whose wait for the grid before (programmatic
    # dependent launch, grid_dependency.cuh) is no part of this CTA's time.
    ("  const int tid = threadIdx.x, warpgroup = tid / 128, lane = tid % 32;\n", ENTRY, "before"),
    ("  const CtaWork w = decode_work<true>(p, ROWS);\n", clocks_code(0, 0), "after"),
    ("      q_smem, 1, 256, ctid % 128);\n", time_code(256, 7), "after"),
    ("        if (tma_arg.page_box_rows > 0 && k0 % KEYS == 0 && k0 + KEYS <= w.kv_len) {\n",
     stamp(0, SLOT_FREE, indent="          "), "after"),
    ("          if (t + 1 < num_tiles) lookup(t + 1);\n", stamp(0, ISSUED, indent="          "), "before"),
    ("            fa3::loader_barrier();\n            if constexpr (Traits::kKeyGroups > 1) fa3::key_group_arrive",
     stamp(0, f"{LANDED0} + g", indent="            "), "after_first_line"),
    ("  auto issue_qk = [&](int t) {\n", stamp(256, S_ISSUE, indent="    "), "after"),
    ("          fa3::key_group_sync<Traits>(t, kk / (4 * Traits::kBlocksPerGroup));\n",
     stamp(256, f"{GROUP0} + kk / (4 * Traits::kBlocksPerGroup)", indent="          "), "after"),
    ("      float* factor_t = factors + (t & 1) * ROWS;\n", stamp(256, S_LANDED), "before"),
    ("      rescale(factor);\n      issue_pv(t);\n      fa3::handoff_arrive(t);", stamp(256, PV_ISSUE), "before"),
    ("    if (lane == 0) tma::mbar_arrive(empty(t));\n",
     stamp(256, RELEASE1, indent="    ") + stamp(128, RELEASE0, indent="    "), "after"),
    ("      fa3::handoff_sync(t);\n", stamp(128, HANDOFF), "after"),
    ("      fa3::handoff_sync(t);\n", stamp(128, AT_HANDOFF), "before"),
    ("  // The row sums came with the last tile's P (none without tiles).\n", EXIT, "before"),
    # Both consumers' first threads as they leave one barrier: how far apart
    # their clocks read at one moment (the cross-warp intervals' error).
    ("  fa3::consumers_barrier();\n",
     "  if (threadIdx.x == 128) fj_out[4] = clock64();\n  if (threadIdx.x == 256) fj_out[5] = clock64();\n", "after"),
]


def instrumented_templates() -> Path:
    return common_instrumented(HEADER, PROBES, prefix="mla-trace-")


def intervals(t: torch.Tensor) -> dict:
    """Median cycles of each interval over every CTA's middle tiles (from the 4th
    to the 4th from last), from the [CTAs, TILES, EVENTS] stamps."""
    t = t.double()
    num = int((t[0, :, S_ISSUE] > 0).sum())
    mid = slice(4, max(5, min(num, TILES) - 4))
    cur, nxt = t[:, mid], t[:, mid.start + 1: mid.stop + 1]
    prev2 = t[:, mid.start - 2: mid.stop - 2]  # the tile two back (its slot)
    parts = {
        "tile period (S issued to the next S issued)": nxt[..., S_ISSUE] - cur[..., S_ISSUE],
        "slot freed by both consumers to the loader seeing it": cur[..., SLOT_FREE]
        - torch.maximum(prev2[..., RELEASE0], prev2[..., RELEASE1]),
        "loader: slot seen to boxes issued": cur[..., ISSUED] - cur[..., SLOT_FREE],
        "load: boxes issued to key group 0 landed": cur[..., LANDED0] - cur[..., ISSUED],
        "load: boxes issued to key group 2 landed": cur[..., LANDED0 + 2] - cur[..., ISSUED],
        "S issued to past key group 0's barrier (waits for keys)": cur[..., GROUP0] - cur[..., S_ISSUE],
        "past group 0 to past group 1": cur[..., GROUP0 + 1] - cur[..., GROUP0],
        "past group 1 to past group 2": cur[..., GROUP0 + 2] - cur[..., GROUP0 + 1],
        "past group 2 to S landed": cur[..., S_LANDED] - cur[..., GROUP0 + 2],
        "S landed to P.V issued (softmax, P stores, barrier)": cur[..., PV_ISSUE] - cur[..., S_LANDED],
        "P.V issued to the next S issued": nxt[..., S_ISSUE] - cur[..., PV_ISSUE],
        "P.V issued to softmax consumer's release": cur[..., RELEASE1] - cur[..., PV_ISSUE],
        "P.V issued to the other consumer past the hand-off": cur[..., HANDOFF] - cur[..., PV_ISSUE],
        "the other consumer: at the hand-off to past it": cur[..., HANDOFF] - cur[..., AT_HANDOFF],
        "hand-off to the other consumer's release": cur[..., RELEASE0] - cur[..., HANDOFF],
        "the other consumer's period (hand-off to the next)": nxt[..., HANDOFF] - cur[..., HANDOFF],
        "key group 2 landed to S issued (keys early, +) or late (-)": cur[..., S_ISSUE] - cur[..., LANDED0 + 2],
    }
    if not bool((t[..., ISSUED] > 0).any()):  # gathered tiles: no loader stamps
        loader = ("slot freed", "loader:", "load:", "key group 2 landed")
        parts = {k: v for k, v in parts.items() if not k.startswith(loader)}
    return {k: statistics.median(v.flatten().tolist()) for k, v in parts.items()}


def use_instrumented(folder, prefix: str) -> None:
    """Kernels rendered from `folder` (an instrumented templates/ copy) from
    here on, built into a fresh cache of their own."""
    use_templates(folder)
    os.environ["FLASHJIT_CACHE_DIR"] = tempfile.mkdtemp(prefix=prefix)
    jit._modules.clear()


def print_intervals(parts: dict, ghz: float, over: str) -> None:
    """The table of median intervals (cycles, and ns at `ghz`)."""
    print(f"| interval (median over {over}) | cycles | ns |\n|---|---|---|")
    for name, cycles in parts.items():
        print(f"| {name} | {cycles:.0f} | {cycles / ghz:.0f} |")


def print_cta_phases(head: torch.Tensor, starts: torch.Tensor, ghz: float) -> None:
    """Where a CTA's time goes outside its middle steps: from the header words
    [CTAs, 11] and `starts` [CTAs, N], each step's (or tile's) first stamp in
    clock64, the kernel's span (by %globaltimer) and, for the CTAs that entered
    with the first (within 5 us) and those that entered later (as SMs freed),
    the medians of entry -> first step, the first and last steps' periods
    against the middle ones', the last step -> the loop's end -> the last
    store, the first line -> entry, and the gap from the SM's CTA before."""
    head, starts = head.double(), starts.double()
    n = int((starts[0] > 0).sum())
    span_us = float(head[:, 2].max() - head[:, 0].min()) / 1e3
    start_us = (head[:, 0] - head[:, 0].min()) / 1e3
    waves = {"first": start_us <= 5.0, "later": start_us > 5.0}
    waves = {k: v for k, v in waves.items() if bool(v.any())}
    print(f"kernel span (first entry to last loop end) {span_us:.1f} us; "
          + ", ".join(f"{int(v.sum())} CTAs entered {k} (median at {float(start_us[v].median()):.1f} us)"
                      for k, v in waves.items()))
    periods = starts[:, 1:n] - starts[:, :n - 1]
    parts = {"entry -> Q landed (prologue barrier)": head[:, 4] - head[:, 1],
             "entry -> first step's stamp (Q and the first tiles)": starts[:, 0] - head[:, 1]}
    for i in range(min(3, n - 1)):
        parts[f"step {i} period"] = periods[:, i]
    parts["middle steps' period"] = periods[:, 3:max(4, n - 4)]
    parts[f"step {n - 2} period"] = periods[:, n - 2]
    parts["last step's stamp -> loop end"] = head[:, 3] - starts[:, n - 1]
    parts["entry -> loop end"] = head[:, 3] - head[:, 1]
    parts["loop end -> last store issued (globaltimer)"] = (head[:, 7] - head[:, 2]) * ghz
    parts["first line -> entry (decode_work and its wait for the grid before)"] = (head[:, 0] - head[:, 6]) * ghz
    # The CTA before on the same SM: its last store to this one's first line.
    gap = torch.full_like(head[:, 0], float("nan"))
    for sm in head[:, 8].unique():
        on_sm = (head[:, 8] == sm).nonzero().flatten()
        on_sm = on_sm[head[on_sm, 6].argsort()]
        gap[on_sm[1:]] = (head[on_sm[1:], 6] - head[on_sm[:-1], 7]) * ghz
    parts["the SM's CTA before: last store issued -> this one's first line"] = gap
    print("| interval (median over a wave's CTAs), cycles | " + " | ".join(f"{k} wave" for k in waves) + " |")
    print("|---|" + "---|" * len(waves))
    for name, v in parts.items():
        cells = [[x for x in v[mask].flatten().tolist() if x == x] for mask in waves.values()]
        print(f"| {name} | " + " | ".join(f"{statistics.median(c):.0f} ({statistics.median(c) / ghz / 1e3:.2f} us)"
                                          if c else "-" for c in cells) + " |")
    print()


def stamped_runs(rows, tiling, head_words: int, shape: tuple):
    """For each of benchmarks/mla.py's ROWS (indices) whose plan does not split
    keys: three runs of the fa3 MLA wrapper (`tiling`, None: the shipped one)
    with a stamps buffer of head_words + prod(shape) words a CTA as its
    partial-output pointer, the output checked against float64. Yields (label,
    CTAs, stamps [CTAs, *shape], SM GHz, clock skew in cycles, median CTA us,
    header [CTAs, head_words]), from the header words [globaltimer, clock64 at
    entry; the same at the loop's end; two clocks read leaving one barrier]."""
    stride = head_words + math.prod(shape)
    for row in rows:
        label, batch, kv_len, heads, page_size = mla.ROWS[row]
        r = mla.make_row(batch, kv_len, heads, page_size)
        w = flashjit.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                   backend="fa3")
        with fa3_mla_tiling(tiling):
            w.plan(r["qo_indptr"], r["kv_indptr"], r["kv_indices"], r["kv_lens"], heads, 512, 64, page_size, False,
                   mla.SM_SCALE, mla.DTYPE, mla.DTYPE)
            plan = w._plan
            if plan.merge_tokens:
                print(f"{label}: the plan splits keys, no stamps", file=sys.stderr)
                continue
            ctas = plan.num_work
            stamps = torch.zeros(ctas * stride, dtype=torch.int64, device="cuda")
            w._plan = dataclasses.replace(plan, partials=(stamps.data_ptr(), 0))
            for _ in range(3):
                out = w.run(r["q_nope"], r["q_pe"], r["ckv"], r["kpe"])
            torch.cuda.synchronize()
        mla.check(out, r, kv_len, label, "fa3")
        s = stamps.view(ctas, stride).cpu()
        head = s[:, :head_words].double()
        ghz = statistics.median(((head[:, 3] - head[:, 1]) / (head[:, 2] - head[:, 0])).tolist())
        skew = statistics.median((head[:, 5] - head[:, 4]).tolist())
        cta_us = statistics.median(((head[:, 2] - head[:, 0]) / 1e3).tolist())
        yield label, ctas, s[:, head_words:].view(ctas, *shape), ghz, skew, cta_us, head


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2], help="indices into benchmarks/mla.py's ROWS")
    parser.add_argument("--tiling", help="a Fa3MlaTiling(...) expression in place of the shipped one (pairs off)")
    args = parser.parse_args()
    use_instrumented(instrumented_templates(), "mla-trace-cache-")
    tiling = parse_fa3_mla_tiling(args.tiling) if args.tiling else dataclasses.replace(fa3.MLA_TILING, pairs=False)
    print(f"{torch.cuda.get_device_name()}, flashjit fa3 MLA ({tiling}), bf16")
    for label, ctas, tiles, ghz, skew, cta_us, head in stamped_runs(args.rows, tiling, HEAD, (TILES, EVENTS)):
        print(f"\n{label}: {ctas} CTAs, median CTA {cta_us:.1f} us (entry to the softmax consumer's last tile), "
              f"SM clock {ghz:.2f} GHz; the softmax consumer's clock read {skew:.0f} cycles after the other's "
              "leaving one barrier\n")
        print_intervals(intervals(tiles), ghz, "CTAs and middle tiles")
        print()
        print_cta_phases(head, tiles[..., S_ISSUE], ghz)
    return 0


if __name__ == "__main__":
    sys.exit(main())
