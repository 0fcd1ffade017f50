"""SASS digests of every configuration of a selection, to show that a change to
the templates or the rendering left the compiled kernels identical (CPU only:
nvcc and cuobjdump, no GPU).

    # build a tree's configurations into a private cache, then digest them
    python benchmarks/dev/sass_digest.py build /tmp/base_tree /tmp/sass_base_cache
    python benchmarks/dev/sass_digest.py digest /tmp/sass_base_cache -o /tmp/sass_base.json
    # the same for the working tree, then compare configuration by configuration
    python benchmarks/dev/sass_digest.py build . /tmp/sass_new_cache
    python benchmarks/dev/sass_digest.py digest /tmp/sass_new_cache -o /tmp/sass_new.json
    python benchmarks/dev/sass_digest.py compare /tmp/sass_base.json /tmp/sass_new.json

`build` runs `python -m flashjit prewarm` with PYTHONPATH=TREE and
FLASHJIT_CACHE_DIR=CACHE, so each tree renders and compiles its own templates.
The selection is explicit (every op, fp16/bf16/fp32, head dims 64/128/256, the
default arches: 125 configurations, the default preset before the bf16 serving
set replaced it, now `--preset full`), so that trees whose presets differ still
build the same configurations; --selector replaces it. A tree for an older commit:
`git worktree add /tmp/base_tree <commit>`.

`digest` runs `cuobjdump -sass` on each configuration's library and hashes,
per arch, the function names and instructions with their encodings; the
offsets in the address column and blank lines are left out. Per function
digests go to the file too, so that `compare` can name the functions that
differ. The cache keys (which hash the templates) differ between trees and
play no part: configurations are matched by name.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

OPS = ["single_prefill", "single_decode", "batch_prefill_ragged", "batch_prefill_paged", "batch_decode_paged",
       "mla_paged", "append_paged"]
SELECTION = ["--op", *OPS, "--dtype", "fp16", "bf16", "fp32", "--head-dim", "64", "128", "256"]
ARCHES = ["sm_80", "sm_89", "sm_90a"]

_ADDRESS = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*")
_SPACES = re.compile(r"\s+")


def cuobjdump() -> str:
    """cuobjdump from the nvidia-cuda-cuobjdump wheel (the test extra), else PATH."""
    try:
        import nvidia

        for root in nvidia.__path__:
            for found in sorted(Path(root).glob("*/bin/cuobjdump")):
                return str(found)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if found is None:
        sys.exit("sass_digest: no cuobjdump (pip install nvidia-cuda-cuobjdump, or put the CUDA toolkit's on PATH)")
    return found


def build(tree: Path, cache: Path, arches: list[str], selection: list[str], jobs: int) -> int:
    """Renders and compiles the selection from `tree` into `cache` (prewarm's own output)."""
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "FLASHJIT_CACHE_DIR": str(cache), "FLASHJIT_JOBS": str(jobs)}
    command = [sys.executable, "-m", "flashjit", "prewarm", *selection, "--arch", *arches]
    print(f"sass_digest: {' '.join(command)}  (PYTHONPATH={tree}, FLASHJIT_CACHE_DIR={cache})", file=sys.stderr)
    return subprocess.run(command, cwd=tree, env=env).returncode


def libraries(cache: Path) -> dict[str, Path]:
    """Configuration name -> its library, from each published entry's manifest
    (<cache>/<name>/<key>/manifest.json); unpublished build directories are skipped."""
    found = {}
    for manifest in sorted(cache.glob("*/*/manifest.json")):
        entry = manifest.parent
        if entry.name.startswith("."):
            continue
        name = entry.parent.name
        if name in found:
            sys.exit(f"sass_digest: {cache} holds more than one entry of {name}; digest a cache of one build")
        found[name] = entry / json.loads(manifest.read_text())["artifact"]
    return found


def split_sass(text: str) -> dict[str, dict[str, str]]:
    """arch -> function name -> its normalized instructions, from a cuobjdump -sass listing."""
    by_arch: dict[str, dict[str, list[str]]] = {}
    arch, function = None, None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("arch = "):
            arch, function = stripped.split("=", 1)[1].strip(), None
            by_arch.setdefault(arch, {})
        elif stripped.startswith("Function : "):
            function = stripped.split(":", 1)[1].strip()
            by_arch[arch].setdefault(function, [])
        elif function is not None and stripped:
            by_arch[arch][function].append(_SPACES.sub(" ", _ADDRESS.sub("", line)).strip())
    return {a: {f: "\n".join(lines) for f, lines in fs.items()} for a, fs in by_arch.items()}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def digest(cache: Path, tool: str) -> dict:
    """{configuration: {arch: {"digest": ..., "functions": {name: digest}}}} of every entry in cache."""
    out = {}
    found = libraries(cache)
    for i, (name, library) in enumerate(found.items(), 1):
        text = subprocess.run([tool, "-sass", str(library)], capture_output=True, text=True, check=True).stdout
        per_arch = {}
        for arch, functions in sorted(split_sass(text).items()):
            if not functions:
                continue
            whole = "\n".join(f"Function {f}\n{body}" for f, body in functions.items())
            per_arch[arch] = {"digest": _sha(whole), "functions": {f: _sha(b) for f, b in functions.items()}}
        out[name] = per_arch
        print(f"  [{i}/{len(found)}] {name}: {', '.join(per_arch)}", file=sys.stderr)
    return out


def compare(base: dict, new: dict) -> int:
    """Prints the counts of identical and differing (configuration, arch) pairs
    and every difference; returns 1 when any pair differs or is missing."""
    same, differ, missing = 0, [], []
    for name in sorted(base):
        if name not in new:
            missing.append(f"{name} (missing from the second file)")
            continue
        for arch, entry in sorted(base[name].items()):
            other = new[name].get(arch)
            if other is None:
                missing.append(f"{name} {arch} (missing from the second file)")
            elif other["digest"] == entry["digest"]:
                same += 1
            else:
                changed = sorted(f for f in entry["functions"] | other["functions"]
                                 if entry["functions"].get(f) != other["functions"].get(f))
                differ.append(f"{name} {arch}: " + ", ".join(changed))
    extra = sorted(set(new) - set(base))
    print(f"{len(base)} configurations, {same} (configuration, arch) pairs identical, {len(differ)} differ, "
          f"{len(missing)} missing; {len(extra)} configurations only in the second file")
    for line in differ + missing:
        print(f"  {line}")
    return 1 if differ or missing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="render and compile a tree's selection into a private cache")
    p.add_argument("tree", type=Path)
    p.add_argument("cache", type=Path)
    p.add_argument("--arch", nargs="+", default=ARCHES)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--selector", nargs=argparse.REMAINDER, help="prewarm selectors instead of the built-in selection")
    p = sub.add_parser("digest", help="SASS digests of every configuration in a cache")
    p.add_argument("cache", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p = sub.add_parser("compare", help="compare two digest files configuration by configuration")
    p.add_argument("base", type=Path)
    p.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "build":
        return build(args.tree.resolve(), args.cache.resolve(), args.arch, args.selector or SELECTION, args.jobs)
    if args.command == "digest":
        result = digest(args.cache, cuobjdump())
        args.output.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"sass_digest: {len(result)} configurations -> {args.output}", file=sys.stderr)
        return 0 if result else 1
    return compare(json.loads(args.base.read_text()), json.loads(args.new.read_text()))


if __name__ == "__main__":
    sys.exit(main())
