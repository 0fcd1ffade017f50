"""The on-disk cache of compiled configurations.

Layout (docs/cache.md): <root>/<configuration name>/<key>/ holds the artifact,
the sources it was built from, the build log, tolerance.json and manifest.json.
The key is a content hash (see `compute_key`); the readable name is only a
directory level. An entry is published by an atomic rename of a private build
directory whose manifest was written last, so a reader sees a whole entry or
none. Locks are flock locks (filelock) on <root>/<name>/<key>.lock: the kernel
drops them when their holder dies.

Errors: CacheError (never a bare OSError), with the path and the fix, from
check_safe_dir (unsafe directory), ensure_root (unsafe, or not creatable),
require_writable (a read-only root: the setting to change), config_lock,
new_build_dir, write_file and publish (a full disk: the space needed, see
no_space_error), refresh_fingerprint, remove_entry, iter_entries and clear.
The lookups (verify_entry, find_entry, find_entry_by_fingerprint,
find_entry_any_toolchain) and read_only_reason raise nothing: a bad entry is a
miss with its problems, logged once per process. sha256_file raises OSError;
its callers catch it. os_error and no_space_error return the CacheError.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .cache_errors import no_space_error, os_error, root_setting  # noqa: F401 (part of this module's API)
from .errors import CacheError

log = logging.getLogger("flashjit")

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_CHECKOUT_ROOT = Path(__file__).resolve().parent.parent
_warned: set[tuple[str, str]] = set()  # (entry path, problems) already logged by this process


def default_root() -> Path:
    """$FLASHJIT_CACHE_DIR, else cache/ of a source checkout, else the user's cache dir."""
    env = os.environ.get("FLASHJIT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    if (_CHECKOUT_ROOT / "pyproject.toml").is_file() and (_CHECKOUT_ROOT / "cache").is_dir():
        return _CHECKOUT_ROOT / "cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flashjit"


def check_safe_dir(path: Path, allow_root_owner: bool = False) -> None:
    """A directory we load code from: a real directory (no symlink), owned by us
    (or, with allow_root_owner, for a read-only layer baked into an image, by
    root), writable by nobody else. Raises CacheError otherwise."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise os_error("inspect", path, exc) from exc
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"refusing cache path {path}: it is a symlink or not a directory")
    if st.st_uid != os.getuid() and not (allow_root_owner and st.st_uid == 0):
        raise CacheError(f"refusing cache directory {path}: owned by uid {st.st_uid}, not by you "
                         f"(uid {os.getuid()}); set FLASHJIT_CACHE_DIR to a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(f"refusing cache directory {path}: others can write it "
                         f"(mode {stat.S_IMODE(st.st_mode):o}); run chmod 700 on it")


def ensure_root(root: Path | None = None, create: bool = True) -> Path:
    """The cache root, checked safe (check_safe_dir). A missing root is created
    private to the user (0700), or with create=False left missing (lookups then
    find nothing; `require_writable` creates it on a miss). An existing root
    keeps its mode, except that group and other write bits are removed: a root
    the user made read-only stays read-only and serves its hits."""
    root = Path(root) if root is not None else default_root()
    try:
        if not os.path.lexists(root):
            if not create:
                return root
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(root)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(root, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    except OSError as exc:
        raise os_error("create the cache directory", root, exc) from exc
    check_safe_dir(root)
    return root


def read_only_reason(root: Path) -> str | None:
    """Why flashjit may not write the (existing) root, or None if it may. Read
    from the mode, access and mount flags, without writing anything: a root
    whose owner removed its own write bit is read-only even for root."""
    try:
        st = os.stat(root)
        if not st.st_mode & stat.S_IWUSR:
            return f"mode {stat.S_IMODE(st.st_mode):04o}: its owner has no write permission"
        if not os.access(root, os.W_OK | os.X_OK):
            return "you have no write permission"
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            return "it is on a read-only file system"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def require_writable(root: Path, action: str) -> Path:
    """Creates the root if it is missing and refuses a read-only one with a
    one-line CacheError: "cannot <action>: the cache is read-only (...)"."""
    root = ensure_root(root)
    reason = read_only_reason(root)
    if reason is not None:
        raise CacheError(f"cannot {action}: the cache is read-only ({root_setting(root, default_root())}; {reason}); it serves the "
                         f"configurations it holds but takes no new ones: set FLASHJIT_CACHE_DIR to a writable "
                         f"directory (FLASHJIT_CACHE_READONLY={root} keeps this one in use), or make it writable "
                         f"(chmod u+w {root})")
    return root


def compute_key(key_inputs: dict) -> str:
    """sha256 over the canonical JSON of the key inputs: rendered source and headers
    digests, full nvcc command, nvcc version, flashjit version, ABI version."""
    blob = json.dumps(key_inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Entry:
    path: Path
    manifest: dict

    @property
    def artifact(self) -> Path:
        return self.path / self.manifest["artifact"]


def verify_entry(path: Path, expected_key: str | None = None,
                 readonly: bool = False) -> tuple[Entry | None, list[str]]:
    """Checks one entry: safe directory, manifest present and parseable, key
    matching its inputs and its directory, artifact a regular file whose sha256
    matches. `readonly` (an entry of a FLASHJIT_CACHE_READONLY layer) also
    accepts root-owned directories. Returns (entry or None, problems)."""
    problems: list[str] = []
    try:
        check_safe_dir(path.parent, readonly)  # the configuration directory: renaming into it replaces entries
        check_safe_dir(path, readonly)
    except CacheError as exc:
        return None, [str(exc)]
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return None, ["no manifest (partial or interrupted build)"]
    except (OSError, ValueError) as exc:
        return None, [f"unreadable manifest: {exc}"]
    if not isinstance(manifest, dict):
        return None, ["unreadable manifest: not a JSON object"]
    if manifest.get("format") != MANIFEST_FORMAT:
        return None, [f"manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}"]
    key = manifest.get("key")
    if key != path.name or (expected_key is not None and key != expected_key):
        problems.append(f"manifest key {key!r} does not match directory {path.name!r}")
    if compute_key(manifest.get("key_inputs", {})) != key:
        problems.append("manifest key does not match its recorded inputs")
    artifact = path / str(manifest.get("artifact", ""))
    try:
        st = os.lstat(artifact)
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"artifact {artifact.name} is not a regular file")
        elif sha256_file(artifact) != manifest.get("artifact_sha256"):
            problems.append(f"artifact {artifact.name} does not match its sha256 (truncated or altered)")
    except OSError as exc:
        problems.append(f"artifact missing: {exc}")
    return (None if problems else Entry(path, manifest)), problems


def warn_once(path: Path, message: str) -> None:
    """Logs a warning about an entry once per process (a prewarm looks an entry
    up by fingerprint, by key and again under its lock); repeats go to DEBUG.
    Publishing a new entry at that path forgets it (see publish)."""
    key = (str(path), message)
    if key in _warned:
        log.debug("flashjit: %s", message)
    else:
        _warned.add(key)
        log.warning("flashjit: %s", message)


def entry_path(root: Path, name: str, key: str) -> Path:
    return root / name / key


def find_entry(root: Path, name: str, key: str, readonly: bool = False) -> Entry | None:
    """The valid entry for (name, key), or None for a miss (absent, partial or corrupt)."""
    path = entry_path(root, name, key)
    if not path.exists():
        return None
    entry, problems = verify_entry(path, key, readonly)
    if problems:
        warn_once(path, f"cache entry {path} is invalid ({'; '.join(problems)}); it will be rebuilt")
    return entry


def find_entry_by_fingerprint(root: Path, name: str, fingerprint: str, readonly: bool = False) -> Entry | None:
    """The valid entry whose manifest records this fingerprint (see jit.fingerprint):
    the cached-load path, which neither renders nor hashes sources."""
    config_dir = root / name
    try:
        candidates = [p for p in config_dir.iterdir() if not p.name.startswith(".") and p.is_dir()]
    except OSError:
        return None
    for path in candidates:
        try:
            recorded = json.loads((path / MANIFEST).read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            continue
        if recorded == fingerprint:
            entry, problems = verify_entry(path, readonly=readonly)
            if problems:
                warn_once(path, f"cache entry {path} is invalid ({'; '.join(problems)}); it will be rebuilt")
            return entry
    return None


def find_entry_any_toolchain(root: Path, name: str, key_inputs: dict, readonly: bool = False) -> Entry | None:
    """For a machine without nvcc: a valid entry whose inputs equal key_inputs in
    everything but the nvcc version (the newest such one)."""
    wanted = {k: v for k, v in key_inputs.items() if k != "nvcc_version"}
    found: list[Entry] = []
    for path in sorted((root / name).glob("[0-9a-f]*")) if (root / name).is_dir() else []:
        entry, problems = verify_entry(path, readonly=readonly)
        if entry and {k: v for k, v in entry.manifest["key_inputs"].items() if k != "nvcc_version"} == wanted:
            found.append(entry)
    return max(found, key=lambda e: e.manifest.get("created_unix", 0), default=None)


@contextlib.contextmanager
def config_lock(root: Path, name: str, key: str, poll_log_seconds: float = 30.0):
    """Holds the flock of one configuration; logs while it waits for another process."""
    import filelock

    lock_dir = root / name
    try:
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error("create", lock_dir, exc) from exc
    check_safe_dir(lock_dir)
    lock_path = lock_dir / f"{key}.lock"
    lock = filelock.UnixFileLock(str(lock_path), mode=0o600)
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            started = time.monotonic()
            log.info("flashjit: waiting for another process building %s (lock %s)", name, lock_path)
            while True:
                try:
                    lock.acquire(timeout=poll_log_seconds)
                    break
                except filelock.Timeout:
                    log.info("flashjit: still waiting for %s after %.0f s", name, time.monotonic() - started)
    except OSError as exc:
        raise os_error("lock", lock_path, exc) from exc
    try:
        yield
    finally:
        lock.release()


def new_build_dir(root: Path, name: str, key: str) -> Path:
    """A private temporary directory beside the entry (same file system, so the
    publish rename is atomic). Leftovers of killed builders of this key are
    removed: the caller holds the key's lock, so nobody else is using them."""
    parent = root / name
    try:
        for stale in parent.glob(f".tmp-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp-{key}-{os.getpid()}-", dir=parent))
    except OSError as exc:
        raise os_error("create a build directory in", parent, exc) from exc


def write_file(path: Path, data: bytes | str, needed: int | None = None) -> None:
    """Writes one file of an entry being built; needed: the space the whole
    entry needs, named in the CacheError of a full disk."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    except OSError as exc:
        raise os_error("write", path, exc, needed) from exc


def publish(build_dir: Path, manifest: dict, needed: int | None = None) -> Entry:
    """Writes the manifest last, then renames build_dir onto its entry path.
    A previous (invalid) entry at that path is moved aside and deleted."""
    final = build_dir.parent / manifest["key"]
    write_file(build_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True), needed)
    try:
        os.chmod(build_dir, 0o700)
        if final.exists():
            trash = build_dir.parent / f".trash-{manifest['key']}-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(build_dir, final)
    except OSError as exc:
        raise os_error("publish the cache entry", final, exc, needed) from exc
    _warned.difference_update({k for k in _warned if k[0] == str(final)})  # a new entry: warn afresh
    return Entry(final, manifest)


def refresh_fingerprint(root: Path, entry: Entry, key: str, fingerprint: str) -> Entry:
    """Records a new fingerprint in a valid entry found by its content key (its
    generator changed in ways that left the source alike), so that later loads
    take the fast path again. Under the configuration's lock, the manifest is
    replaced by rename. Raises CacheError if the manifest cannot be written."""
    manifest = {**entry.manifest, "fingerprint": fingerprint}
    path = entry.path / MANIFEST
    tmp = entry.path / f".{MANIFEST}.{os.getpid()}.tmp"
    with config_lock(root, entry.path.parent.name, key):
        write_file(tmp, json.dumps(manifest, indent=1, sort_keys=True))
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise os_error("update the manifest", path, exc) from exc
    return Entry(entry.path, manifest)


def remove_entry(root: Path, entry: Entry) -> None:
    """Deletes one entry under its configuration lock (so no reader races a builder)."""
    key = entry.path.name
    with config_lock(root, entry.path.parent.name, key):
        if entry.path.exists():
            trash = entry.path.parent / f".trash-{key}-{os.getpid()}-{time.monotonic_ns()}"
            try:
                os.rename(entry.path, trash)
            except OSError as exc:
                raise os_error("remove", entry.path, exc) from exc
            shutil.rmtree(trash, ignore_errors=True)


def iter_entries(root: Path):
    """(path, entry or None, problems) for every entry directory under root."""
    if not root.is_dir():
        return
    try:
        config_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as exc:
        raise os_error("list", root, exc) from exc
    for config_dir in config_dirs:
        try:
            paths = sorted(p for p in config_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError as exc:
            raise os_error("list", config_dir, exc) from exc
        for path in paths:
            entry, problems = verify_entry(path)
            yield path, entry, problems


def clear(root: Path) -> int:
    """Removes every configuration directory under root; returns how many."""
    removed = 0
    if not root.is_dir():
        return 0
    for child in root.iterdir():
        if child.is_dir() and not child.is_symlink():
            try:
                shutil.rmtree(child)
            except OSError as exc:
                raise os_error("remove", child, exc) from exc
            removed += 1
    return removed
