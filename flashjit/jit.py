"""From a configuration to a loaded kernel: cache lookup, build on a miss, load.

`get_module(spec)` is what the ops call (memoised per process); `build_many`
is what prewarm calls: every missing configuration in one parallel ninja run.

Errors (build_many and get_module): ValueError for an unsupported spec
(before anything else); SettingError for a FLASHJIT_* variable it cannot use
(before the cache is read); ToolchainError (no nvcc or ninja, arch not
supported); JitDisabledError (a miss with FLASHJIT_DISABLE_JIT=1); BuildError
(nvcc failed: command and first errors; build_many with raise_first=False
returns it per spec instead); CacheError (an unsafe cache; a miss in a
read-only cache, naming the setting; a full disk, naming the space needed,
per spec under raise_first=False when the compile or publish hit it; from
get_module, an entry that does not load after one rebuild). KeyboardInterrupt,
and build.BuildTerminated for SIGTERM, propagate once the compilers are killed
and the unpublished build directories removed. resolve_arches raises
ToolchainError for an unknown arch name or a GPU older than SM80 and
SettingError for a FLASHJIT_CUDA_ARCH_LIST it cannot use; jit_disabled
raises SettingError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import arch as arch_mod
from . import build, cache, cache_ship
from ._version import __version__
from .errors import CacheError, FlashjitError, JitDisabledError, ToolchainError
from .loader import ABI_VERSION, KernelModule, load_library
from .kernels import target_arches, template_for
from .render import RenderedSource, generator_digest, render
from .spec import MLA_OPS, KernelSpec
from .error_model import profile

log = logging.getLogger("flashjit")
_modules: dict[tuple, KernelModule] = {}
_modules_lock = threading.Lock()


def jit_disabled() -> bool:
    """FLASHJIT_DISABLE_JIT: True (a cache miss is a JitDisabledError) for 1,
    true or yes; False (a miss is compiled) for 0, false, no, empty or unset.
    Anything else, a typo or "off", is a SettingError rather than a guess in
    either direction (arch.SWITCH_ON / SWITCH_OFF)."""
    return arch_mod.env_switch("FLASHJIT_DISABLE_JIT", "1, true or yes (a cache miss is an error) or 0, false, no or "
                               "empty (a miss is compiled)", "set one of them, or unset it")


def resolve_arches(arches=None) -> tuple[str, ...]:
    """Explicit arches, else FLASHJIT_CUDA_ARCH_LIST, else this GPU's, else the default set."""
    if arches:
        return tuple(sorted({arch_mod.normalize_arch(a) for a in arches}))
    env = arch_mod.env_arches()
    if env:
        return env
    dev = arch_mod.device_arch()
    if dev is not None:
        return (dev,)
    log.debug("flashjit: no GPU visible and no arch named; compiling for %s", ", ".join(arch_mod.DEFAULT_ARCHES))
    return arch_mod.DEFAULT_ARCHES


@dataclass
class Planned:
    """One configuration's build plan: what it renders to and its cache key."""

    spec: KernelSpec
    arches: tuple[str, ...]
    rendered: RenderedSource
    nvcc: str | None
    key_inputs: dict
    key: str
    fingerprint: str | None  # recorded in the manifest; None without nvcc

    @property
    def artifact_name(self) -> str:
        return f"lib{self.spec.name}.so"


def plan(spec: KernelSpec, arches: tuple[str, ...], nvcc: str | None) -> Planned:
    arches = target_arches(spec, arches)
    rendered = render(spec, arches)
    args = build.nvcc_args(arches, rendered.filename, f"lib{spec.name}.so")
    key_inputs = {
        **rendered.digest_inputs(),
        "nvcc_command": ["nvcc", *args],
        "nvcc_version": arch_mod.nvcc_version(nvcc) if nvcc else None,
        "flashjit_version": __version__,
        "abi_version": ABI_VERSION,
    }
    return Planned(spec, arches, rendered, nvcc, key_inputs, cache.compute_key(key_inputs),
                   fingerprint(spec, arches, nvcc))


def fingerprint(spec: KernelSpec, arches: tuple[str, ...], nvcc: str | None) -> str | None:
    """Everything the cache key depends on, without rendering: the spec, the
    generator (templates, headers, tiling code), the nvcc flags and version."""
    if nvcc is None:
        return None
    arches = target_arches(spec, arches)
    blob = json.dumps([spec.as_dict(), list(arches), generator_digest(template_for(spec)[0]), build.NVCC_FLAGS,
                       arch_mod.nvcc_version(nvcc), __version__, ABI_VERSION])
    return hashlib.sha256(blob.encode()).hexdigest()


def _find_by_fingerprint(layers, root: Path, name: str, fp: str) -> cache.Entry | None:
    """The entry with this fingerprint: the read-only layers first, then root."""
    for layer in layers:
        entry = cache.find_entry_by_fingerprint(layer, name, fp, readonly=True)
        if entry is not None:
            return entry
    return cache.find_entry_by_fingerprint(root, name, fp)


def _lookup(root: Path, p: Planned, layers=()) -> cache.Entry | None:
    """The entry for p's content key, in the read-only layers first (never
    written), then in root, where one found with an older fingerprint gets the
    current one recorded, so that the next load skips rendering."""
    for layer in layers:
        entry = (cache.find_entry_any_toolchain(layer, p.spec.name, p.key_inputs, readonly=True) if p.nvcc is None
                 else cache.find_entry(layer, p.spec.name, p.key, readonly=True))
        if entry is not None:
            return entry
    if p.nvcc is None:
        return cache.find_entry_any_toolchain(root, p.spec.name, p.key_inputs)
    entry = cache.find_entry(root, p.spec.name, p.key)
    if entry is not None and p.fingerprint is not None and entry.manifest.get("fingerprint") != p.fingerprint:
        read_only = cache.read_only_reason(root)  # a read-only cache still serves the entry, only slower
        if read_only is not None:
            cache.warn_once(entry.path, f"cache entry {entry.path} matches by key but records another fingerprint, "
                                        f"and the cache is read-only ({read_only}): served through the slower lookup")
            return entry
        try:
            entry = cache.refresh_fingerprint(root, entry, p.key, p.fingerprint)
        except CacheError as exc:
            cache.warn_once(entry.path, str(exc))
    return entry


def prewarm_command(spec: KernelSpec, arches) -> str:
    """The `flashjit prewarm` line that builds exactly this configuration."""
    def switch(flag: bool) -> str:
        return "on" if flag else "off"

    # Batch-invariant decode is what --batch-invariant makes of the plain decode op (its backend: auto's).
    mode = ("--causal off --batch-invariant", "") if spec.invariant_decode else \
        (f"--causal {switch(spec.causal)}" + (" --mask custom" if spec.custom_mask else ""), f"--backend {spec.backend} ")
    kv = f"--kv-dtype {spec.dtype_kv} " if spec.dtype_kv != spec.dtype_q else ""
    vo = f"--head-dim-vo {spec.head_dim_vo} " if spec.head_dim_vo != spec.head_dim_qk and spec.op not in MLA_OPS else ""
    return (f"flashjit prewarm --op {spec.op} --dtype {spec.dtype_q} {kv}--head-dim {spec.head_dim_qk} {vo}"
            f"{mode[1]}--tensor-cores {switch(spec.use_tensor_cores)} {mode[0]} --window {switch(spec.sliding_window)} "
            f"--soft-cap {switch(spec.soft_cap)} --lse {switch(spec.return_lse)} --arch {' '.join(arches)}")


def _miss_error(p: Planned) -> Exception:
    if jit_disabled():
        return JitDisabledError(f"{p.spec.name} is not in the cache and FLASHJIT_DISABLE_JIT is set; "
                                f"build it first with: {prewarm_command(p.spec, p.arches)}")
    return ToolchainError(f"{p.spec.name} is not in the cache and nvcc was not found: {arch_mod.NVCC_HINT}")


def _write_sources(build_dir: Path, rendered: RenderedSource, needed: int) -> None:
    cache.write_file(build_dir / rendered.filename, rendered.text, needed)
    for rel, data in rendered.headers.items():
        cache.write_file(build_dir / "include" / rel, data, needed)


def _manifest(p: Planned, job: build.BuildJob) -> dict:
    log_text = job.log_path.read_text(errors="replace") if job.log_path.exists() else ""
    return {
        "format": cache.MANIFEST_FORMAT,
        "name": p.spec.name,
        "spec": p.spec.as_dict(),
        "arches": list(p.arches),
        "key": p.key,
        "key_inputs": p.key_inputs,
        "fingerprint": p.fingerprint,
        "artifact": p.artifact_name,
        "artifact_sha256": cache.sha256_file(job.build_dir / p.artifact_name),
        "tolerance": profile(p.spec),
        "resources": build.resource_usage(log_text),
        "build_seconds": round(job.seconds, 3),
        "created_unix": time.time(),
    }


@dataclass
class BuildResult:
    spec: KernelSpec
    entry: cache.Entry | None
    built: bool
    seconds: float
    error: Exception | None = None


def build_many(specs, arches=None, jobs: int | None = None, progress=None, root: Path | None = None,
               raise_first: bool = True, readonly: bool = True) -> list[BuildResult]:
    """Makes every spec present in the cache; builds the missing ones in one ninja run.
    Entries of the FLASHJIT_CACHE_READONLY layers count as present (unless
    `readonly` is False); builds go into root, the writable cache. A cache that
    holds every spec is not written (it may be read-only).

    progress(build.BuildProgress) is called once per distinct spec: for one
    found in the cache (cached=True) when it is found, for a built one when its
    compile finishes; done counts up to total, the number of distinct specs.
    Every cached event comes before the first compile's.

    Locks are taken in name order (no deadlock between two prewarms), sources
    are rendered and written inside them, and each entry is published by an
    atomic rename with its manifest written last. On an exception (Ctrl-C, a
    full disk while writing sources, SIGTERM in the main thread) the compilers
    are killed and the unpublished build directories removed."""
    specs = [s.validate() for s in specs]
    arches = resolve_arches(arches)
    disabled = jit_disabled()  # a bad value is an error even when every entry is cached
    layers = cache_ship.readonly_roots() if readonly else []
    nvcc = arch_mod.find_nvcc()
    root = cache.ensure_root(root, create=False)  # a hit writes nothing
    if nvcc is not None:
        arch_mod.check_nvcc_supports(arch_mod.nvcc_version(nvcc), arches)
    unique = list(dict.fromkeys(specs))
    results: dict[KernelSpec, BuildResult] = {}

    def found(spec: KernelSpec, entry: cache.Entry) -> None:
        results[spec] = BuildResult(spec, entry, built=False, seconds=0.0)
        if progress is not None:
            progress(build.BuildProgress(len(results), len(unique), spec.name, 0.0, True, cached=True))

    to_plan = []
    for s in unique:
        fp = fingerprint(s, arches, nvcc)
        entry = _find_by_fingerprint(layers, root, s.name, fp) if fp else None
        if entry is not None:
            found(s, entry)
        else:
            to_plan.append(s)
    planned = sorted((plan(s, arches, nvcc) for s in to_plan), key=lambda p: (p.spec.name, p.key))
    missing = []
    for p in planned:
        entry = _lookup(root, p, layers)
        if entry is not None:
            found(p.spec, entry)
        else:
            missing.append(p)
    if missing and (disabled or nvcc is None):
        raise _miss_error(missing[0])
    if missing:
        root = cache.require_writable(root, f"build {missing[0].spec.name}")
        with build.sigterm_unwinds(), _LockSet(root, missing) as locked:
            _build_locked(locked, arches, nvcc, root, jobs, progress, results, found, len(unique))
    ordered = [results[s] for s in unique]
    if raise_first:
        for r in ordered:
            if r.error is not None:
                raise r.error
    return ordered


def _build_locked(locked: list[Planned], arches, nvcc: str, root: Path, jobs, progress, results: dict, found,
                  total: int) -> None:
    """build_many's part under the locks: render again, look again, build, publish."""
    unpublished: list[Path] = []  # removed if anything raises
    try:
        todo: list[tuple[Planned, build.BuildJob]] = []
        for p in locked:
            p = plan(p.spec, arches, nvcc)  # rendered again, inside the lock
            entry = cache.find_entry(root, p.spec.name, p.key)
            if entry is not None:  # another process built it while we waited
                found(p.spec, entry)
                continue
            build_dir = cache.new_build_dir(root, p.spec.name, p.key)
            unpublished.append(build_dir)
            _write_sources(build_dir, p.rendered, build.entry_bytes_estimate(len(p.arches)))
            args = build.nvcc_args(p.arches, p.rendered.filename, p.artifact_name)
            todo.append((p, build.BuildJob(p.spec.name, build_dir, nvcc, args, p.artifact_name)))
        base = len(results)
        shifted = None if progress is None else \
            (lambda event: progress(dataclasses.replace(event, done=base + event.done, total=total)))
        build.run_builds([job for _, job in todo], root, jobs, shifted)
        for p, job in todo:
            entry = _publish(p, job) if job.error is None else None
            unpublished.remove(job.build_dir)  # published, or a failure (a compile error keeps its log)
            results[p.spec] = BuildResult(p.spec, entry, built=entry is not None, seconds=job.seconds,
                                          error=job.error)
    except BaseException:
        for build_dir in unpublished:
            shutil.rmtree(build_dir, ignore_errors=True)
        raise


def _publish(p: Planned, job: build.BuildJob) -> cache.Entry | None:
    """Writes the manifest and renames the entry into place. A failure (a full
    disk) goes to job.error, with the build directory removed."""
    needed = build.entry_bytes_estimate(len(p.arches))
    try:
        manifest = _manifest(p, job)
        cache.write_file(job.build_dir / "tolerance.json", json.dumps(manifest["tolerance"], indent=1), needed)
        return cache.publish(job.build_dir, manifest, needed)
    except (CacheError, OSError) as exc:  # OSError: the artifact or log unreadable
        shutil.rmtree(job.build_dir, ignore_errors=True)
        job.error = exc if isinstance(exc, CacheError) else cache.os_error("publish", job.build_dir, exc, needed)
        return None


class _LockSet:
    """Holds the locks of several configurations, acquired in sorted order."""

    def __init__(self, root: Path, planned: list[Planned]):
        self._root, self._planned, self._held = root, planned, []

    def __enter__(self) -> list[Planned]:
        try:
            for p in self._planned:
                ctx = cache.config_lock(self._root, p.spec.name, p.key)
                ctx.__enter__()
                self._held.append(ctx)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self._planned

    def __exit__(self, *exc) -> None:
        while self._held:
            self._held.pop().__exit__(None, None, None)


def _candidate_arches(arches) -> list[tuple[str, ...]]:
    """Arch lists whose entries can serve this process: the requested or device
    one first, then the default fat set of a GPU-less prewarm if it covers the device."""
    if arches or arch_mod.env_arches():
        return [resolve_arches(arches)]
    dev = resolve_arches(None)
    if len(dev) == 1 and dev[0] in arch_mod.DEFAULT_ARCHES:
        return [dev, arch_mod.DEFAULT_ARCHES]
    return [dev]


def get_module(spec: KernelSpec, arches=None) -> KernelModule:
    """The loaded kernel of a configuration, built if missing (memoised per process)."""
    memo_key = (spec, tuple(arches) if arches else None)
    module = _modules.get(memo_key)
    if module is not None:
        return module
    with _modules_lock:
        module = _modules.get(memo_key)
        if module is None:
            module = _load(spec.validate(), arches)
            _modules[memo_key] = module
    return module


def _load(spec: KernelSpec, arches) -> KernelModule:
    """Loads a cached entry (this GPU's arch first, then the fat default set;
    the read-only layers before the writable cache), else builds one for the
    first candidate into the writable cache. An entry that verifies but will not
    load is removed (one in a read-only layer: passed over) and rebuilt once; a
    second failure raises."""
    candidates = _candidate_arches(arches)
    jit_disabled()  # checked before the cache is read: a bad value must not wait for the first miss
    layers = cache_ship.readonly_roots()
    nvcc = arch_mod.find_nvcc()
    root = cache.ensure_root(create=False)  # a hit writes nothing
    for arch_list in candidates:
        fp = fingerprint(spec, arch_list, nvcc)
        entry = (_find_by_fingerprint(layers, root, spec.name, fp) if fp
                 else _lookup(root, plan(spec, arch_list, nvcc), layers))
        if entry is not None:
            try:
                return load_library(spec, entry.artifact, entry.manifest)
            except FlashjitError as exc:
                log.warning("flashjit: %s", exc)
                if entry.path.parent.parent != root:
                    layers = []  # a layer's entry that does not load: build our own
    for attempt in (1, 2):
        result = build_many([spec], candidates[0], root=root, readonly=bool(layers))[0]
        try:
            return load_library(spec, result.entry.artifact, result.entry.manifest)
        except FlashjitError as exc:
            if result.built or attempt == 2:
                raise CacheError(f"{spec.name}: entry {result.entry.path} does not load after a rebuild: "
                                 f"{exc}") from exc
            log.warning("flashjit: cached %s does not load (%s); rebuilding once", result.entry.path, exc)
            if result.entry.path.parent.parent == root:
                cache.require_writable(root, f"replace {result.entry.path}")  # a read-only cache cannot
                cache.remove_entry(root, result.entry)
            layers = []  # never written: a layer's entry is passed over instead
    raise AssertionError("unreachable")
