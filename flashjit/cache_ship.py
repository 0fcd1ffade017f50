"""Shipping a cache to other machines: archives and read-only layers.

`export_cache` writes valid entries of a cache into one tar archive (gzip for
a name ending in .gz or .tgz); `import_cache` checks a whole archive, then
publishes its entries into a cache. `readonly_roots` parses
FLASHJIT_CACHE_READONLY: caches (e.g. baked into a container image) that jit
consults before the writable cache and never writes (docs/cache.md,
"Shipping a cache").

Errors: export_cache and import_cache raise CacheError (with the path and the
fix) for an unreadable, tampered or foreign archive, an entry that fails
verification, or a cache that cannot be written; import_cache publishes
nothing unless every entry of the archive passes. readonly_roots raises
SettingError naming FLASHJIT_CACHE_READONLY for a directory that is missing,
not a directory, a symlink, or unsafe to load code from.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from . import cache
from .errors import CacheError, SettingError

log = logging.getLogger("flashjit")

READONLY_VAR = "FLASHJIT_CACHE_READONLY"
_KEY = re.compile(r"^[0-9a-f]{24}$")


def readonly_roots() -> list[Path]:
    """The FLASHJIT_CACHE_READONLY directories, in order (os.pathsep between
    them; empty parts are ignored, unset or empty means none). Each must be an
    existing real directory, not writable by group or others, owned by you or by
    root (an image-baked layer). Raises SettingError otherwise."""
    value = os.environ.get(READONLY_VAR, "")
    roots = []
    for part in value.split(os.pathsep):
        if not part.strip():
            continue
        path = Path(part.strip()).expanduser()
        fix = (f"set {READONLY_VAR} to existing cache directories separated by '{os.pathsep}', or unset it")
        if path.is_symlink():
            raise SettingError(f"{READONLY_VAR}: expected a directory, got a symlink: {path}; name the directory "
                               f"it points to instead")
        if not path.exists():
            raise SettingError(f"{READONLY_VAR}: {path} does not exist; {fix}")
        if not path.is_dir():
            raise SettingError(f"{READONLY_VAR}: expected a directory, got a file: {path}; {fix}")
        try:
            cache.check_safe_dir(path, allow_root_owner=True)
        except CacheError as exc:
            raise SettingError(f"{READONLY_VAR}: {exc}") from None
        roots.append(path)
    return roots


def _selected(root: Path, patterns) -> list[cache.Entry]:
    entries = []
    for path, entry, problems in cache.iter_entries(root):
        name = path.parent.name
        if patterns and not any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            continue
        if entry is None:
            log.warning("flashjit: not exporting invalid entry %s (%s)", path, "; ".join(problems))
            continue
        entries.append(entry)
    return entries


def export_cache(root: Path, archive: Path, patterns=None) -> list[cache.Entry]:
    """Writes the valid entries of root whose configuration name matches one of
    the fnmatch `patterns` (all if none) into `archive`, as <name>/<key>/<files>
    (regular files and directories only, owner and group reset). The archive is
    written beside its final path and renamed, so a failure leaves no partial
    file. Returns the entries written; CacheError if none is selected."""
    import tarfile

    root, archive = Path(root), Path(archive)
    entries = _selected(root, patterns)
    if not entries:
        what = f"matches {' '.join(patterns)}" if patterns else "is valid"
        raise CacheError(f"no entry of {root} {what}; nothing to export (see flashjit cache list)")

    def clean(info: tarfile.TarInfo):
        if not (info.isfile() or info.isdir()):
            return None  # an entry holds only files and directories
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode &= 0o755
        return info

    mode = "w:gz" if archive.name.endswith((".gz", ".tgz")) else "w"
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{archive.name}.", suffix=".tmp", dir=archive.parent)
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode=mode) as tar:
            for entry in entries:
                tar.add(entry.path, arcname=f"{entry.path.parent.name}/{entry.path.name}", filter=clean)
        os.replace(tmp, archive)
    except OSError as exc:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise CacheError(f"cannot write the archive {archive}: {exc.strerror or exc}; "
                         f"name a file in a directory you can write") from exc
    return entries


def _member_entry(member) -> tuple[str, str]:
    """(name, key) of a safe archive member; CacheError naming it otherwise."""
    parts = PurePosixPath(member.name).parts
    what = f"{parts[0]}/{parts[1]}" if len(parts) >= 2 else member.name
    bad = None
    if member.name.startswith("/") or PurePosixPath(member.name).is_absolute():
        bad = "an absolute path"
    elif any(p in ("..", "") for p in parts) or "\\" in member.name:
        bad = "a path leaving its directory"
    elif member.issym() or member.islnk():
        bad = "a link"
    elif not (member.isfile() or member.isdir()):
        bad = "not a regular file or directory"
    elif len(parts) < 2 or parts[0].startswith(".") or not _KEY.match(parts[1]):
        bad = "outside any <name>/<key>/ entry"
    if bad:
        raise CacheError(f"refusing archive member {member.name!r} (entry {what}): {bad}; the archive is not "
                         f"one flashjit cache export wrote; export it again from a trusted cache")
    return parts[0], parts[1]


def _toolchain_problems(manifest: dict) -> list[str]:
    """How the entry's recorded toolchain differs from this install's. The nvcc
    version is compared only where this machine has an nvcc (one without loads
    entries of any nvcc: cache.find_entry_any_toolchain)."""
    from . import arch
    from ._version import __version__
    from .loader import ABI_VERSION

    inputs = manifest.get("key_inputs", {})
    ours = {"flashjit_version": __version__, "abi_version": ABI_VERSION}
    nvcc = arch.find_nvcc()
    if nvcc is not None:
        ours["nvcc_version"] = arch.nvcc_version(nvcc)
    return [f"{k} {inputs.get(k)!r}, this install has {v!r}" for k, v in ours.items() if inputs.get(k) != v]


def import_cache(archive: Path, root: Path) -> tuple[list[Path], list[Path]]:
    """Publishes the entries of `archive` into the cache at root. Every member
    is checked (relative path inside <name>/<key>/, a regular file or directory)
    before anything is extracted; the archive is extracted into a private
    directory under root; every entry is verified (cache.verify_entry) and its
    flashjit, ABI and nvcc versions compared with this install's; only then is
    each entry renamed into place under its lock, as a build publishes. An
    entry already valid in the cache is skipped. Returns (published, skipped)
    entry paths. Raises CacheError naming the first bad entry, with nothing
    published."""
    import tarfile

    archive = Path(archive)
    root = cache.require_writable(root, f"import {archive}")
    fix = "export it again from a trusted cache with flashjit cache export"
    try:
        tar = tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as exc:
        raise CacheError(f"cannot read the archive {archive}: {exc}; name a tar file that flashjit cache "
                         f"export wrote") from exc
    try:
        staging = Path(tempfile.mkdtemp(prefix=".import-", dir=root))
    except OSError as exc:
        tar.close()
        raise cache.os_error("create an import directory in", root, exc) from exc
    try:
        with tar:
            members = tar.getmembers()
            entries = sorted({_member_entry(m) for m in members})
            if not entries:
                raise CacheError(f"the archive {archive} holds no cache entry; {fix}")
            for m in members:
                target = staging.joinpath(*PurePosixPath(m.name).parts)
                if m.isdir():
                    target.mkdir(mode=0o700, parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                src = tar.extractfile(m)
                with src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.chmod(target, m.mode & 0o700 | 0o600)
        manifests = {}
        for name, key in entries:
            path = staging / name / key
            for d in (staging / name, path):
                os.chmod(d, 0o700)
            try:
                manifest = json.loads((path / cache.MANIFEST).read_text())
            except (OSError, ValueError) as exc:
                raise CacheError(f"refusing entry {name}/{key} of {archive}: no readable manifest ({exc}); {fix}")
            foreign = _toolchain_problems(manifest)
            if foreign:
                raise CacheError(f"refusing entry {name}/{key} of {archive}: built by another toolchain "
                                 f"({'; '.join(foreign)}); export it from a cache built by this flashjit and nvcc, "
                                 f"or prewarm here")
            entry, problems = cache.verify_entry(path, key)
            artifact = str(manifest.get("artifact", ""))
            if not problems and (manifest.get("name") != name or "/" in artifact or artifact.startswith(".")):
                problems = [f"manifest name {manifest.get('name')!r} or artifact {artifact!r} does not name its "
                            f"own directory's files"]
            if problems:
                raise CacheError(f"refusing entry {name}/{key} of {archive}: {'; '.join(problems)}; {fix}")
            manifests[name, key] = entry.manifest
        published, skipped = [], []
        for (name, key), manifest in manifests.items():
            config_dir = root / name
            try:
                config_dir.mkdir(mode=0o700, exist_ok=True)
            except OSError as exc:
                raise cache.os_error("create", config_dir, exc) from exc
            with cache.config_lock(root, name, key):
                if cache.find_entry(root, name, key) is not None:
                    skipped.append(config_dir / key)
                    continue
                tmp = config_dir / f".tmp-{key}-{os.getpid()}-import"
                try:
                    os.rename(staging / name / key, tmp)
                except OSError as exc:
                    raise cache.os_error("move the imported entry to", tmp, exc) from exc
                published.append(cache.publish(tmp, manifest).path)
        return published, skipped
    except (OSError, tarfile.TarError) as exc:
        raise CacheError(f"cannot import {archive} into {root}: {exc}; free space or set FLASHJIT_CACHE_DIR to a "
                         f"cache you can write, or {fix}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
