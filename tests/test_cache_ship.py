"""Shipping a cache: `flashjit cache export|import` and FLASHJIT_CACHE_READONLY layers.

One small configuration is compiled once for the module; every test works on
copies of that cache or on archives made from it. Nothing here needs a GPU:
loading a library and reading its tiling works without one.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashjit import build, cache, cache_ship, cli, jit
from flashjit.errors import CacheError, JitDisabledError, SettingError
from flashjit.spec import KernelSpec
from helpers_cache import SMALL_SPEC, copy_cache, entry_dirs, needs_nvcc, no_compile, set_cache_env  # noqa: F401

VAR = cache_ship.READONLY_VAR


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache holding SMALL_SPEC for sm_80, and an archive of it."""
    if jit.arch_mod.find_nvcc() is None:
        pytest.skip("needs nvcc")
    base = tmp_path_factory.mktemp("ship")
    with pytest.MonkeyPatch.context() as m:
        root = set_cache_env(m, base / "src")
        m.delenv(VAR, raising=False)
        (result,) = jit.build_many([SMALL_SPEC])
        archive = base / "cache.tar.gz"
        cache_ship.export_cache(root, archive)
    return SimpleNamespace(root=root, entry=result.entry, archive=archive, xdg=base / "xdg")


def _use(monkeypatch, built, root: Path, layers: str | None = None) -> Path:
    set_cache_env(monkeypatch, root, xdg=built.xdg)
    if layers is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, layers)
    return root


def _forbid_builds(monkeypatch) -> None:
    def forbidden(jobs, *args, **kwargs):
        assert not jobs, "a kernel was compiled"

    monkeypatch.setattr(build, "run_builds", forbidden)


def _snapshot(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.lstat().st_mtime_ns, p.lstat().st_mode, p.lstat().st_size)
                  for p in [root, *root.rglob("*")])


def _chmod_tree(root: Path, dir_mode: int) -> None:
    for p in [root, *root.rglob("*")]:
        if p.is_dir():
            os.chmod(p, dir_mode)


# ---------------------------------------------------------------------------
# Export and import


@pytest.mark.nvcc
@needs_nvcc
def test_export_holds_whole_entries_and_nothing_else(built):
    name, key = built.entry.path.parent.name, built.entry.path.name
    with tarfile.open(built.archive) as tar:
        members = tar.getmembers()
    names = {m.name for m in members}
    assert {f"{name}/{key}/manifest.json", f"{name}/{key}/lib{name}.so", f"{name}/{key}/{name}.cu"} <= names
    assert all(m.isfile() or m.isdir() for m in members)
    assert all(m.name.startswith(f"{name}/{key}") for m in members)  # no lock files, no temp dirs
    assert all(m.uid == 0 and not m.mode & 0o022 for m in members)


@pytest.mark.nvcc
@needs_nvcc
def test_export_selects_by_name_glob(built, tmp_path):
    out = tmp_path / "sel.tar"
    assert len(cache_ship.export_cache(built.root, out, ["single_decode_*"])) == 1
    with pytest.raises(CacheError, match=r"no entry of .* matches single_prefill_\*"):
        cache_ship.export_cache(built.root, tmp_path / "none.tar", ["single_prefill_*"])
    assert not (tmp_path / "none.tar").exists()


@pytest.mark.nvcc
@needs_nvcc
def test_import_into_an_empty_cache_then_load_without_compiling(built, tmp_path, monkeypatch):
    root = _use(monkeypatch, built, tmp_path / "cache")
    published, skipped = cache_ship.import_cache(built.archive, root)
    assert [p.relative_to(root) for p in published] == [built.entry.path.relative_to(built.root)] and not skipped
    assert [p.name for p in root.rglob(".import-*")] == [] and not list(root.glob("*/.tmp-*"))
    entry, problems = cache.verify_entry(published[0])
    assert entry is not None and not problems
    _forbid_builds(monkeypatch)
    module = jit._load(SMALL_SPEC, None)
    assert module.rows_per_cta > 0
    again, present = cache_ship.import_cache(built.archive, root)
    assert again == [] and present == published


def _tar(dst: Path, entry_dir: Path, key: str | None = None, manifest=None, flip: bool = False, extra=()) -> Path:
    """An archive of one entry, altered: another key directory, manifest or artifact; extra members."""
    name, key = entry_dir.parent.name, key or entry_dir.name
    with tarfile.open(dst, "w") as tar:
        for f in sorted(entry_dir.rglob("*")):
            if not f.is_file():
                continue
            rel = f.relative_to(entry_dir).as_posix()
            data = f.read_bytes()
            if rel == "manifest.json" and manifest is not None:
                data = json.dumps(manifest).encode()
            if flip and rel.endswith(".so"):
                data = bytearray(data)
                data[len(data) // 2] ^= 0xFF
                data = bytes(data)
            info = tarfile.TarInfo(f"{name}/{key}/{rel}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    return dst


def _member(name: str, kind=tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, 1 if kind == tarfile.REGTYPE else 0
    return info


def _foreign(entry_dir: Path) -> tuple[str, dict]:
    manifest = json.loads((entry_dir / "manifest.json").read_text())
    manifest["key_inputs"]["flashjit_version"] = "0.0.1-other"
    manifest["key"] = cache.compute_key(manifest["key_inputs"])
    return manifest["key"], manifest


TAMPERED = {
    "artifact byte": (lambda e: dict(flip=True), r"does not match its sha256"),
    "dotdot member": (lambda e: dict(extra=[_member(f"{e.parent.name}/{e.name}/../../../evil")]),
                      r"a path leaving its directory"),
    "absolute member": (lambda e: dict(extra=[_member("/tmp/flashjit-evil")]), r"an absolute path"),
    "symlink member": (lambda e: dict(extra=[_member(f"{e.parent.name}/{e.name}/link", tarfile.SYMTYPE, "/etc")]),
                       r"a link"),
    "hardlink member": (lambda e: dict(extra=[_member(f"{e.parent.name}/{e.name}/hard", tarfile.LNKTYPE,
                                                      "/etc/passwd")]), r"a link"),
    "foreign flashjit_version": (lambda e: dict(zip(("key", "manifest"), _foreign(e))),
                                 r"another toolchain \(flashjit_version '0.0.1-other', this install has"),
}


@pytest.mark.nvcc
@needs_nvcc
@pytest.mark.parametrize("case", list(TAMPERED))
def test_tampered_archive_is_refused_with_nothing_published(built, tmp_path, monkeypatch, case):
    root = _use(monkeypatch, built, tmp_path / "cache")
    make, message = TAMPERED[case]
    archive = _tar(tmp_path / "bad.tar", built.entry.path, **make(built.entry.path))
    with pytest.raises(CacheError, match=rf"refusing (entry|archive member) .*{SMALL_SPEC.name}.*{message}|"
                                         rf"refusing archive member '/tmp.*{message}"):
        cache_ship.import_cache(archive, root)
    assert list(root.iterdir()) == [], "a refused import left files behind"
    assert not Path("/tmp/flashjit-evil").exists()


@pytest.mark.nvcc
@needs_nvcc
def test_cli_export_import_and_a_refusal(built, tmp_path, monkeypatch, capsys):
    _use(monkeypatch, built, built.root)
    out = tmp_path / "one.tgz"
    assert cli.main(["cache", "export", str(out), "single_decode_*"]) == 0
    assert "exported 1 entry" in capsys.readouterr().out
    root = _use(monkeypatch, built, tmp_path / "cache")
    assert cli.main(["cache", "import", str(out)]) == 0
    assert "1 imported, 0 already present" in capsys.readouterr().out
    assert len(entry_dirs(root)) == 1
    bad = _tar(tmp_path / "bad.tar", built.entry.path, flip=True)
    assert cli.main(["cache", "import", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("flashjit cache: refusing entry ") and len(err.strip().splitlines()) == 1
    assert cli.main(["cache", "import"]) == 2


# ---------------------------------------------------------------------------
# Read-only layers


@pytest.fixture
def layer(built, tmp_path):
    """A read-only copy of the built cache (directories 0555)."""
    path = copy_cache(built.root, tmp_path / "layer")
    for lock in path.glob("*/*.lock"):
        lock.unlink()
    yield path
    _chmod_tree(path, 0o755)


@pytest.mark.nvcc
@needs_nvcc
def test_readonly_layer_serves_loads_and_is_never_written(built, layer, tmp_path, monkeypatch):
    _chmod_tree(layer, 0o555)
    root = _use(monkeypatch, built, tmp_path / "cache", layers=f"{tmp_path / 'missing-is-not-ok'}")
    with pytest.raises(SettingError, match=VAR):
        jit._load(SMALL_SPEC, None)
    _use(monkeypatch, built, root, layers=f"{layer}{os.pathsep}")
    before = _snapshot(layer)
    _forbid_builds(monkeypatch)
    assert jit._load(SMALL_SPEC, None).rows_per_cta > 0
    (result,) = jit.build_many([SMALL_SPEC])
    assert not result.built and result.entry.path.parent.parent == layer
    assert _snapshot(layer) == before
    assert entry_dirs(root) == []


@pytest.mark.nvcc
@needs_nvcc
def test_readonly_entry_found_by_key_gets_no_fingerprint_written(built, layer, tmp_path, monkeypatch):
    (entry_dir,) = entry_dirs(layer)
    manifest = json.loads((entry_dir / "manifest.json").read_text())
    manifest["fingerprint"] = "0" * 64  # as if built from other (equivalent) templates
    (entry_dir / "manifest.json").write_text(json.dumps(manifest))
    _chmod_tree(layer, 0o555)
    root = _use(monkeypatch, built, tmp_path / "cache", layers=str(layer))
    before = _snapshot(layer)
    _forbid_builds(monkeypatch)
    assert jit._load(SMALL_SPEC, None).rows_per_cta > 0
    assert _snapshot(layer) == before
    assert entry_dirs(root) == [] and not list(root.glob("*/*.lock"))


def test_a_miss_everywhere_with_jit_disabled_is_the_clear_error(tmp_path, monkeypatch):
    root = set_cache_env(monkeypatch, tmp_path / "cache")
    empty = tmp_path / "layer"
    empty.mkdir(mode=0o755)
    monkeypatch.setenv(VAR, str(empty))
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", "1")
    _forbid_builds(monkeypatch)
    with pytest.raises(JitDisabledError, match="flashjit prewarm"):
        jit.build_many([KernelSpec.make("single_decode", "float16", 64)])
    assert list(empty.iterdir()) == [] and entry_dirs(root) == []


def _bad_layer(kind: str, tmp_path: Path) -> tuple[str, str]:
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    if kind == "missing":
        return str(tmp_path / "nope"), "does not exist"
    if kind == "file":
        (tmp_path / "f").write_text("x")
        return str(tmp_path / "f"), "got a file"
    if kind == "symlink":
        (tmp_path / "link").symlink_to(target)
        return str(tmp_path / "link"), "got a symlink"
    if kind == "group-writable":
        os.chmod(target, 0o775)
        return str(target), "others can write it"
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    os.chown(target, 12345, 12345)
    return f"{tmp_path / 'ok'}{os.pathsep}{target}", "owned by uid 12345"


@pytest.mark.parametrize("kind", ["missing", "file", "symlink", "group-writable", "other-owner"])
def test_bad_readonly_value_is_a_setting_error(kind, tmp_path, monkeypatch, no_compile, capsys):
    (tmp_path / "ok").mkdir(mode=0o700)
    value, message = _bad_layer(kind, tmp_path)
    monkeypatch.setenv(VAR, value)
    with pytest.raises(SettingError, match=rf"^{VAR}: .*{message}"):
        cache_ship.readonly_roots()
    assert cli.main(["info"]) == 2
    captured = capsys.readouterr()
    assert f"flashjit info: {VAR}: " in captured.err and "read-only     invalid" in captured.out
    assert cli.main(["prewarm", "--op", "single_decode", "--dtype", "fp16", "--head-dim", "64",
                     "--arch", "sm_80"]) == 2
    assert capsys.readouterr().err.startswith(f"flashjit prewarm: {VAR}: ")


def test_readonly_unset_or_empty_means_none(monkeypatch, tmp_path):
    monkeypatch.delenv(VAR, raising=False)
    assert cache_ship.readonly_roots() == []
    monkeypatch.setenv(VAR, os.pathsep)
    assert cache_ship.readonly_roots() == []
    (tmp_path / "a").mkdir(mode=0o755)
    (tmp_path / "b").mkdir(mode=0o700)
    monkeypatch.setenv(VAR, f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}")
    assert cache_ship.readonly_roots() == [tmp_path / "a", tmp_path / "b"]
