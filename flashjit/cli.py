"""The `flashjit` command: prewarm the cache, inspect it, describe this machine,
benchmark this GPU, measure its numerics.

Exit codes: 0 done; 1 a failure while working (a build, the cache, the
toolchain); 2 bad input (flags, a selection that does not exist, or a FLASHJIT_*
setting it cannot use). Errors are one line on stderr naming what to fix; a
failed build also prints the compiler's first errors.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import textwrap
import time
import warnings
from pathlib import Path

from . import bench
from .cache_root import cache_root
from .errors import FlashjitError, JitDisabledError, SettingError
from .selection import specs_from_args, summary_lines
from .selectors import SelectionError, add_arch, add_selectors, check_selectors, presets_text
from .spec import OPS, PLANNED_OPS, KernelSpec

__all__ = ["build_parser", "cache_root", "main", "specs_from_args"]


def _tolerance_text(spec: KernelSpec) -> str:
    from .error_model import tolerance

    t = tolerance(spec, kv_len=4096, v_absmax=1.0)
    return f"rtol {t.rtol:.1e} atol {t.atol:.1e}*max|v|"


def target_arches(named) -> tuple[tuple[str, ...], str]:
    """The arches to compile for and where they come from: --arch, else
    FLASHJIT_CUDA_ARCH_LIST, else this GPU's (torch is imported here), else the default set."""
    from . import arch

    if named:
        return tuple(sorted(set(named))), "--arch"
    env = arch.env_arches()
    if env:
        return env, "FLASHJIT_CUDA_ARCH_LIST"
    device = arch.device_arch()
    if device is not None:
        return (device,), "this GPU"
    return arch.DEFAULT_ARCHES, "no GPU visible"


def cmd_prewarm(args) -> int:
    # The selectors in their own words first: before torch or the build is imported, or a GPU probed.
    check_selectors(args)
    from . import arch, build, cache_ship, jit
    from .cli_output import BuildProgressLine, duration, size, table, tree_bytes

    # Every setting the selection and the build read, before either, through
    # the library's own parsers (each a SettingError naming the variable).
    if args.jobs is None:
        build.default_jobs()
    jit.jit_disabled()
    arch.strict_backend()
    arch.env_nvcc()
    cache_ship.readonly_roots()
    # The arches (named, else this GPU, else the default set) decide the
    # backends of the selection; they are checked before the cache is created.
    arches, arches_from = target_arches(args.arch)
    specs = specs_from_args(args, arches)
    if not specs:
        raise SelectionError("the selection is empty")
    root = cache_root(create=True)
    for line in summary_lines(specs, arches, arches_from):
        print(line, file=sys.stderr)
    started = time.monotonic()
    progress = BuildProgressLine(sys.stderr)
    try:
        results = jit.build_many(specs, arches=arches, jobs=args.jobs, root=root, raise_first=False,
                                 progress=progress)
    except JitDisabledError as exc:
        missing = re.match(r"(\S+) is not in the cache", str(exc))
        name = missing.group(1) if missing else "a configuration"
        print(f"flashjit prewarm: {name} is not in the cache and FLASHJIT_DISABLE_JIT="
              f"{os.environ.get('FLASHJIT_DISABLE_JIT')} forbids compiling it; unset FLASHJIT_DISABLE_JIT (or set "
              f"it to 0) to build", file=sys.stderr)
        return 1
    finally:
        progress.finish()
    failed = [r for r in results if r.error is not None]
    built = sum(r.built for r in results if r.error is None)
    if args.verbose:
        rows = [("configuration", "built", "seconds", "tolerance (kv_len 4096)", "cache path")]
        rows += [(r.spec.name, "FAILED", f"{r.seconds:.1f}", "-", "-") if r.error is not None else
                 (r.spec.name, "yes" if r.built else "cached", f"{r.seconds:.1f}", _tolerance_text(r.spec),
                  str(r.entry.path)) for r in results]
        print("\n".join(table(rows, right=(2,))))
    ready = len(results) - len(failed)
    print(f"flashjit prewarm: {ready} configuration(s) ready ({built} built, {ready - built} cached)"
          + (f", {len(failed)} FAILED" if failed else "")
          + f" in {duration(time.monotonic() - started)}; cache {size(tree_bytes(root))} at {root}", file=sys.stderr)
    for r in failed:
        print(f"\n{r.error}", file=sys.stderr)
    return 1 if failed else 0


def _archive_problem(action: str, file: str) -> str | None:
    """Why `cache export FILE` / `cache import FILE` cannot start, or None."""
    path = Path(file)
    if action == "import":
        return None if path.is_file() else f"import: {file}: no such archive; name a file that flashjit cache " \
                                             f"export wrote"
    if path.is_dir():
        return f"export: {file} is a folder; name the archive inside it, e.g. {path / 'flashjit-cache.tar.gz'}"
    if not path.resolve().parent.is_dir():
        return f"export: the folder of {file} does not exist; create it first, or name a file in an existing folder"
    return None


def cmd_cache(args) -> int:
    from . import cache, cache_ship
    from .cli_output import cache_table

    if args.action in ("export", "import") and not args.file:
        print(f"flashjit cache: {args.action} needs the archive's path: flashjit cache {args.action} FILE",
              file=sys.stderr)
        return 2
    if (args.action != "export" and args.patterns) or (args.action not in ("export", "import") and args.file):
        print(f"flashjit cache: {args.action} takes no further arguments", file=sys.stderr)
        return 2
    if args.action in ("export", "import"):
        problem = _archive_problem(args.action, args.file)
        if problem:
            print(f"flashjit cache: {problem}", file=sys.stderr)
            return 2
    if args.action == "export":
        root = cache_root(create=False)
        entries = cache_ship.export_cache(root, Path(args.file), args.patterns)
        print(f"exported {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} from {root} to {args.file}")
        return 0
    if args.action == "import":
        root = cache_root(create=True)
        published, skipped = cache_ship.import_cache(Path(args.file), root)
        for path in published:
            print(f"imported  {path}")
        for path in skipped:
            print(f"present   {path}")
        print(f"{len(published)} imported, {len(skipped)} already present in {root}")
        return 0
    root = cache_root(create=False)
    if args.action == "clear":
        print(f"removed {cache.clear(root)} configuration(s) from {root}")
        return 0
    if args.action == "list":
        lines, bad = cache_table(root, cache.iter_entries(root))
        for line in lines + bad:
            print(line)
        return 1 if bad else 0
    bad = 0
    count = 0
    for path, entry, problems in cache.iter_entries(root):
        count += 1
        if entry is None:
            bad += 1
            print(f"BAD  {path}: {'; '.join(problems)}")
    print(f"{count - bad} of {count} entries verified in {root}")
    return 1 if bad else 0


def cmd_info(args) -> int:
    """Describes this machine; a bad setting shows in its line and as one line
    on stderr at the end (exit 2), so the rest is still reported."""
    from . import __version__, arch, build, cache_ship, jit

    problems: list[str] = []

    def setting(check, show):
        try:
            return show(check())
        except SettingError as exc:
            problems.append(str(exc))
            return f"invalid ({str(exc).split(':', 1)[0]}, see below)"

    print(f"flashjit      {__version__}")
    print(f"python        {sys.version.split()[0]}")
    try:
        import torch

        print(f"torch         {torch.__version__} (CUDA {torch.version.cuda})")
    except ImportError:
        torch = None
        print("torch         not installed")
    nvcc = setting(arch.find_nvcc, lambda found: found or f"not found: {arch.NVCC_HINT}")
    print(f"nvcc          {nvcc} ({arch.nvcc_version(nvcc)})" if os.path.isfile(nvcc) else f"nvcc          {nvcc}")
    print(f"cache dir     {setting(lambda: cache_root(create=False), str)}")
    layers = setting(cache_ship.readonly_roots, lambda roots: ", ".join(map(str, roots)) or "none")
    print(f"read-only     {layers} ({cache_ship.READONLY_VAR}, consulted first)")
    default_arches = "(this GPU, else " + " ".join(arch.DEFAULT_ARCHES) + ")"
    print(f"arch list     {setting(arch.env_arches, lambda a: ' '.join(a) if a else default_arches)}")
    print(f"jobs          {setting(build.default_jobs, str)}")
    jit_state = setting(jit.jit_disabled, lambda off: "disabled (FLASHJIT_DISABLE_JIT)" if off else "enabled")
    print(f"jit           {jit_state}")
    strict = setting(arch.strict_backend, lambda on: "on (no fallback to fa2)" if on else "off")
    print(f"strict        {strict}")
    invariant = setting(arch.batch_invariant, lambda on: "on (FLASHJIT_BATCH_INVARIANT)" if on else "off")
    print(f"batch-inv.    {invariant}")
    if torch is not None and torch.cuda.is_available():
        idx = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        print(f"gpu           {torch.cuda.get_device_name(idx)} (sm_{major}{minor})")
        backends = []
        if major >= 8:
            backends.append("fa2 (SM80+)")
        if (major, minor) == (9, 0):
            backends.append("fa3 (SM90a)")
        print(f"backends      {', '.join(backends) or 'none: flashjit needs SM80+'}")
    else:
        print("gpu           none visible")
    print(f"ops           {', '.join(OPS)}" + (f" (planned: {', '.join(PLANNED_OPS)})" if PLANNED_OPS else ""))
    for problem in problems:
        print(f"flashjit info: {problem}", file=sys.stderr)
    return 2 if problems else 0


def cmd_bench(args) -> int:
    return bench.run(args)


def cmd_numerics(args) -> int:
    from . import numerics

    return numerics.run(args)


# ---------------------------------------------------------------------------
# Settings: each command reads the FLASHJIT_* variables it depends on before it
# acts, so that a bad value is one line naming the variable, what it takes and
# the fix, never a traceback from deep inside a build or a silent default. The
# library parses them (arch.env_nvcc, arch.env_arches, arch.strict_backend,
# jit.jit_disabled, build.default_jobs: each raises SettingError), so the
# command and the library agree; the ones only the command reads are here.

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> int:
    value = os.environ.get("FLASHJIT_LOG_LEVEL", "")
    if not value:
        return logging.INFO
    if value.strip().upper() in LOG_LEVELS:
        return getattr(logging, value.strip().upper())
    raise SettingError(f"FLASHJIT_LOG_LEVEL: expected one of {', '.join(LOG_LEVELS)} (any case), got {value!r}; "
                       f"set one of them, or unset it for INFO")


@contextlib.contextmanager
def _log_to_stderr(level: int):
    """flashjit's log lines on stderr while a command runs; the logger is left as it was found."""
    logger = logging.getLogger("flashjit")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


PREWARM_DESCRIPTION = (
    "Compiles the selected configurations into the cache (FLASHJIT_CACHE_DIR, see `flashjit info`), in parallel, "
    "so that no op compiles at its first call. A preset names the ops, dtypes and head dims; --op, --dtype and "
    "--head-dim replace its own; the variant flags (--causal, --window, --soft-cap, --lse, --tensor-cores) choose "
    "the variants of each; --backend and the target arches choose the backends. It prints a progress line as each "
    "configuration finishes and a summary at the end (-v: a table of every configuration). Exit 0 when every one "
    "is ready, 1 where a build or the cache failed, 2 for a bad flag or FLASHJIT_* setting.")


def _described(text: str, presets: bool) -> dict:
    """A subcommand's description wrapped to 79 columns, and the presets as its
    epilog (RawDescriptionHelpFormatter keeps their lines)."""
    epilog = "presets (--preset):\n" + presets_text() if presets else None
    return dict(description=textwrap.fill(text, 79), epilog=epilog,
                formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashjit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pre = sub.add_parser("prewarm", help="build the cache for a set of configurations, in parallel",
                         **_described(PREWARM_DESCRIPTION, presets=True))
    add_selectors(pre)
    add_arch(pre)
    pre.add_argument("--jobs", type=_positive_int,
                     help="parallel nvcc jobs (default: $FLASHJIT_JOBS, else by cores/memory)")
    pre.add_argument("-v", "--verbose", action="store_true",
                     help="after the build, a table of every configuration: built or cached, seconds, tolerance, "
                          "cache path")
    pre.add_argument("--batch-invariant", action="store_true",
                     help="the kernels the selected ops load in batch-invariant mode (decode: its prefill tiling)")
    pre.set_defaults(func=cmd_prewarm)
    cac = sub.add_parser("cache", help="list, verify, clear, export or import the cache",
                         description="list: a table of the valid entries (sorted by op, dtype, head dim) and their "
                                     "total; verify: checks every entry; clear: removes them; export FILE "
                                     "[PATTERN ...] / import FILE: an archive of entries for another machine.")
    cac.add_argument("action", choices=["list", "verify", "clear", "export", "import"], help="what to do")
    cac.add_argument("file", nargs="?", help="export/import: the archive (.tar, or .tar.gz / .tgz for gzip)")
    cac.add_argument("patterns", nargs="*",
                     help="export: configuration-name globs (e.g. 'single_decode_*'); default: every valid entry")
    cac.set_defaults(func=cmd_cache)
    inf = sub.add_parser("info", help="versions, toolchain, GPU, cache directory",
                         description="Versions, toolchain, GPU, cache directory and every FLASHJIT_* setting; exit 2 "
                                     "where a setting is invalid.")
    inf.set_defaults(func=cmd_info)
    ben = sub.add_parser("bench", help=bench.HELP, description=bench.DESCRIPTION)
    bench.add_arguments(ben, _positive_int)
    ben.set_defaults(func=cmd_bench)
    _add_numerics(sub)
    return parser


def _add_numerics(sub) -> None:
    from . import numerics

    num = sub.add_parser("numerics", help=numerics.HELP, **_described(numerics.DESCRIPTION, presets=True))
    add_selectors(num)
    numerics.add_arguments(num, _positive_int)
    num.set_defaults(func=cmd_numerics, arch=None)


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def one_line_warning(message, category, filename, lineno, file=None, line=None):
        # Python's format adds the warning's source file and line: two lines per warning.
        print(f"flashjit {args.command}: warning: {message}", file=sys.stderr)

    try:
        level = log_level()
        with _log_to_stderr(level), warnings.catch_warnings():
            warnings.showwarning = one_line_warning
            # torch says this on its first import where numpy is not installed, which
            # flashjit does not need: not the user's concern in a flashjit command.
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            return args.func(args)
    except SelectionError as exc:
        print(f"flashjit {args.command}: {exc}", file=sys.stderr)
        return 2
    except FlashjitError as exc:
        print(f"flashjit {args.command}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, SettingError) else 1


if __name__ == "__main__":
    sys.exit(main())
