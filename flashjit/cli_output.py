"""What the `flashjit` command prints while and after it builds, and its
tables: the build's progress line (done/total, elapsed, ETA, the last
configuration finished), durations and sizes in short human form, aligned
tables, and `flashjit cache list`'s table. Plain Python: the CPU tests feed it
fake progress events and cache entries."""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

from .spec import DTYPES, OPS


def duration(seconds: float) -> str:
    """41s, 1m12s, 1h05m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def size(nbytes: int) -> str:
    """512 B, 4.2 kB, 61 MB, 1.3 GB (powers of 1000, as du --si)."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 999.5 or unit == "TB":
            break
        value /= 1000
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if value < 9.95 else f"{value:.0f} {unit}"


def tree_bytes(path: Path) -> int:
    """The bytes of every regular file under path (links not followed)."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(folder, name)):
                total += st.st_size
    return total


def table(rows: list[tuple], right: tuple[int, ...] = ()) -> list[str]:
    """Rows (the first the header) as aligned lines; the columns in `right` right-aligned."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(cell).rjust(w) if i in right else str(cell).ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


class BuildProgressLine:
    """The build's progress callback (flashjit.build.BuildProgress events, one
    per configuration as it is found in the cache or finishes compiling):
    "[done/total] elapsed 1m12s, ETA 2m30s  last: <name>". Configurations found
    in the cache are counted, not shown: a fully cached run prints nothing. On
    a terminal one line rewritten in place; elsewhere (a log) a line at the
    first and last build and at each further twentieth of the builds, so a log
    keeps about 20 lines however many there are. The ETA is the mean time per
    build so far times the configurations left."""

    STEPS = 20

    def __init__(self, stream=None, clock=time.monotonic, tty: bool | None = None):
        self.stream = stream or sys.stderr
        self.clock = clock
        self.started = clock()
        self.tty = self.stream.isatty() if tty is None else tty
        self.cached = 0
        self.failed = 0
        self.next_mark = 0
        self.width = 0  # of the line on the terminal, to blank its tail when a shorter one replaces it

    def line(self, event) -> str:
        elapsed = self.clock() - self.started
        built = event.done - self.cached
        eta = elapsed / built * (event.total - event.done) if built > 0 else 0.0
        failed = f", {self.failed} failed" if self.failed else ""
        count = f"[{event.done:>{len(str(event.total))}}/{event.total}]"
        return f"{count} elapsed {duration(elapsed)}, ETA {duration(eta)}{failed}  last: {event.name}"

    def __call__(self, event) -> None:
        if getattr(event, "cached", False):
            self.cached += 1
            return
        self.failed += not event.ok
        text = self.line(event)
        if self.tty:
            columns = shutil.get_terminal_size((100, 20)).columns - 1
            text = text[:columns]
            print("\r" + text.ljust(self.width), end="", file=self.stream, flush=True)
            self.width = len(text)
            if event.done >= event.total:
                self.finish()
            return
        built = event.done - self.cached
        if built >= self.next_mark or event.done >= event.total or not event.ok:
            print(text, file=self.stream, flush=True)
            step = max(1, math.ceil((event.total - self.cached) / self.STEPS))
            self.next_mark = (built // step + 1) * step

    def finish(self) -> None:
        """Ends the terminal's progress line (no-op elsewhere, or where none was drawn)."""
        if self.tty and self.width:
            print(file=self.stream, flush=True)
            self.width = 0


# ---------------------------------------------------------------------------
# flashjit cache list

_HEAD_DIM = re.compile(r"_(?:d|qk)(\d+)(?:_|$)")


def entry_order(name: str, spec: dict | None = None) -> tuple:
    """Sort key of a configuration: op and dtype in flashjit.spec's order, the
    head dim as a number (d64 before d128), then the rest of the name."""
    spec = spec or {}
    op = spec.get("op") or next((o for o in sorted(OPS, key=len, reverse=True) if name.startswith(o + "_")), name)
    short = name.removeprefix(op + "_").split("_", 1)[0]
    dtype = spec.get("dtype_q") or next((d for d, fields in DTYPES.items() if fields[0] == short), None)
    head_dim = spec.get("head_dim_qk")
    if head_dim is None:
        found = _HEAD_DIM.search(name)
        head_dim = int(found.group(1)) if found else 0
    op_rank = OPS.index(op) if op in OPS else len(OPS)
    dtype_rank = list(DTYPES).index(dtype) if dtype in DTYPES else len(DTYPES)
    return op_rank, op, dtype_rank, int(head_dim), name


def cache_table(root: Path, entries) -> tuple[list[str], list[str]]:
    """`flashjit cache list`: (the table's lines, one line per invalid entry)
    from cache.iter_entries' (path, entry or None, problems)."""
    rows, bad, total = [], [], 0
    for path, entry, problems in entries:
        if entry is None:
            bad.append(f"BAD  {path}: {'; '.join(problems)}")
            continue
        manifest = entry.manifest
        nbytes = tree_bytes(path)
        total += nbytes
        rows.append((entry_order(manifest["name"], manifest.get("spec")), manifest["name"],
                     ",".join(manifest["arches"]), size(nbytes), manifest.get("key", path.name)))
    if not rows:
        return [], bad
    rows.sort(key=lambda row: row[0])
    lines = table([("configuration", "arches", "size", "key"), *(row[1:] for row in rows)], right=(2,))
    count = f"{len(rows)} configuration{'s' if len(rows) != 1 else ''}"
    lines.append(f"{count}, {size(total)}, in {root}/<configuration>/<key>")
    return lines, bad
