"""fa3 MLA under several split-KV chunk sizes: rows of benchmarks/mla.py
planned automatically, without splits, and with fixed chunks of keys, each
output checked against float64, timed in shuffled samples; the table gives the
plan's CTAs, whether it merges split states, and us and GB/s a call.

Usage: python benchmarks/dev/mla_splits.py [--rows 3 0] [--keys 512 1024 2048 4096] [--samples 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: mla
import mla  # noqa: E402

import flashjit  # noqa: E402
from flashjit.bench.timing import shuffled_ms  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[3, 0], help="indices into benchmarks/mla.py's ROWS")
    parser.add_argument("--keys", type=int, nargs="+", default=[512, 1024, 1536, 2048, 2560, 4096],
                        help="fixed split-KV chunks, in keys (whole pages)")
    parser.add_argument("--samples", type=int, default=40)
    args = parser.parse_args()
    for row in args.rows:
        label, batch, kv_len, heads, page_size = mla.ROWS[row]
        r = mla.make_row(batch, kv_len, heads, page_size)
        gigabytes = batch * kv_len * 576 * 2 / 1e9
        plans = [("auto", {}), ("no split", {"disable_split_kv": True})]
        plans += [(f"{k} keys", {"fixed_split_size": k // page_size}) for k in args.keys]
        fns, shape = {}, {}
        for name, kw in plans:
            w = flashjit.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                       backend="fa3")
            w.plan(r["qo_indptr"], r["kv_indptr"], r["kv_indices"], r["kv_lens"], heads, 512, 64, page_size, False,
                   mla.SM_SCALE, mla.DTYPE, mla.DTYPE, **kw)
            mla.check(w.run(r["q_nope"], r["q_pe"], r["ckv"], r["kpe"]), r, kv_len, label, "fa3")
            shape[name] = (w._plan.num_work, bool(w._plan.merge_tokens))
            fns[name] = lambda w=w: w.run(r["q_nope"], r["q_pe"], r["ckv"], r["kpe"])
        times = shuffled_ms(fns, args.samples)
        print(f"\n{label} ({torch.cuda.get_device_name()})\n\n| plan | CTAs | merged | us | GB/s |\n|---|---|---|---|---|")
        for name, samples in times.items():
            ms = statistics.median(samples)
            print(f"| {name} | {shape[name][0]} | {shape[name][1]} | {ms * 1e3:.1f} | {gigabytes / ms * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
