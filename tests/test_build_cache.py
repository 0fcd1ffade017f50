"""Building with nvcc through ninja into the verified cache, without a GPU:
a representative subset for sm_80, sm_89 and sm_90a in one build_many call,
cache hits, keys, and the toolchain / compile errors."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import re
import shlex
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from flashjit import arch, build, cache, cli, jit, kernels, loader, render
from flashjit.error_model import profile
from flashjit.errors import BuildError, JitDisabledError, KernelLaunchError, SettingError, ToolchainError
from flashjit.spec import KernelSpec
from helpers_cache import fresh_cache, templates_copy  # noqa: F401 (fixtures)
from helpers_cache import (SMALL_SPEC, compile_count, entry_dirs, have_nvcc, is_empty, manifest_of, needs_nvcc,
                           nvcc_wrapper, set_cache_env, tmp_dirs)

ARCHES = ("sm_80", "sm_89", "sm_90a")
ARCH_LIST = " ".join(ARCHES)

# One configuration per op and dtype; each op gets head_dim 64, 128 and 256 once,
# and each variant flag appears at least twice (causal: 3, window: 3, soft-cap: 3, lse: 5).
REPRESENTATIVE = [
    KernelSpec.make("single_prefill", "float16", 64, causal=True),
    KernelSpec.make("single_prefill", "bfloat16", 128, sliding_window=True, soft_cap=True),
    KernelSpec.make("single_prefill", "float32", 256, return_lse=True),
    KernelSpec.make("single_decode", "float16", 128, return_lse=True),
    KernelSpec.make("single_decode", "bfloat16", 256, sliding_window=True, soft_cap=True),
    KernelSpec.make("single_decode", "float32", 64),
    KernelSpec.make("batch_prefill_ragged", "float16", 256, causal=True, return_lse=True),
    KernelSpec.make("batch_prefill_ragged", "bfloat16", 64, sliding_window=True, return_lse=True),
    KernelSpec.make("batch_prefill_ragged", "float32", 128, causal=True, soft_cap=True, return_lse=True),
    # Tensor cores (fa2): one configuration per head_dim, the register-tightest variants.
    KernelSpec.make("single_prefill", "bfloat16", 64, use_tensor_cores=True, causal=True),
    KernelSpec.make("single_prefill", "float16", 128, use_tensor_cores=True, soft_cap=True, return_lse=True),
    KernelSpec.make("batch_prefill_ragged", "bfloat16", 256, use_tensor_cores=True, sliding_window=True,
                    return_lse=True),
    # Paged K/V (decode in the fa2 kernel's split-keys mode) and the append kernel with its own ABI struct.
    KernelSpec.make("batch_decode_paged", "bfloat16", 128, use_tensor_cores=True, soft_cap=True, return_lse=True),
    KernelSpec.make("batch_decode_paged", "float32", 256, sliding_window=True, return_lse=True),
    KernelSpec.make("batch_prefill_paged", "float16", 64, causal=True, return_lse=True),
    KernelSpec.make("append_paged", "bfloat16", 128),
]
IDS = [s.name for s in REPRESENTATIVE]


def _spill_params():
    for spec in REPRESENTATIVE:
        for a in ARCHES:
            yield pytest.param(spec, a, id=f"{spec.name}-{a}")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def representative(tmp_path_factory):
    """The representative subset, built cold in ONE build_many call (ninja runs
    the configurations in parallel) through a counting nvcc wrapper."""
    if not have_nvcc():
        pytest.skip("needs nvcc")
    base = tmp_path_factory.mktemp("representative")
    root = base / "cache"
    wrapper, counter = nvcc_wrapper(base / "bin")
    records = _Records()
    logger = logging.getLogger("flashjit")
    old_level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)  # the per-configuration compile times are DEBUG lines
    events = []
    try:
        with pytest.MonkeyPatch.context() as m:
            set_cache_env(m, root, arches=ARCH_LIST)
            m.setenv("FLASHJIT_NVCC", str(wrapper))
            started = time.monotonic()
            results = jit.build_many(REPRESENTATIVE, progress=events.append)
            cold = time.monotonic() - started
    finally:
        logger.removeHandler(records)
        logger.setLevel(old_level)
    return SimpleNamespace(root=root, base=base, results=dict(zip(REPRESENTATIVE, results)), cold=cold,
                           wrapper=wrapper, counter=counter, log=records.messages, events=events)


def _env(monkeypatch, rep, arches: str = ARCH_LIST):
    set_cache_env(monkeypatch, rep.root, arches=arches, xdg=rep.base / "xdg")
    monkeypatch.setenv("FLASHJIT_NVCC", str(rep.wrapper))


# ---------------------------------------------------------------------------
# The cold build


@pytest.mark.nvcc
@pytest.mark.slow
def test_cold_build_compiles_each_configuration_once_in_one_batch(representative):
    rep = representative
    assert [r.built for r in rep.results.values()] == [True] * len(REPRESENTATIVE)
    assert all(r.error is None for r in rep.results.values())
    assert compile_count(rep.counter) == len(REPRESENTATIVE), "one nvcc run per configuration (all arches)"
    batches = [m for m in rep.log if re.match(r"flashjit: compiling \d+ configuration", m)]
    assert len(batches) == 1 and f"compiling {len(REPRESENTATIVE)} configuration(s)" in batches[0]
    for spec in REPRESENTATIVE:
        assert any(re.fullmatch(rf"flashjit: compiled {spec.name} in \d+\.\d s", m) for m in rep.log), spec.name
    # One progress event per configuration as it finishes, counting up to the total.
    assert [e.done for e in rep.events] == list(range(1, len(REPRESENTATIVE) + 1))
    assert {e.name for e in rep.events} == set(IDS) and all(e.total == len(REPRESENTATIVE) for e in rep.events)
    assert all(e.ok and not e.cached and e.seconds > 0 for e in rep.events)
    print(f"\ncold build of {len(REPRESENTATIVE)} configurations x {len(ARCHES)} arches: {rep.cold:.1f} s")
    assert tmp_dirs(rep.root) == [] and not list(rep.root.glob(".batch-*"))


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize("spec", REPRESENTATIVE, ids=IDS)
def test_entry_verifies_and_records_its_inputs(representative, spec):
    result = representative.results[spec]
    entry = result.entry
    assert entry.path.parent == representative.root / spec.name
    verified, problems = cache.verify_entry(entry.path, entry.path.name)
    assert problems == [] and verified is not None
    m = manifest_of(entry.path)
    assert m["name"] == spec.name and m["spec"] == spec.as_dict()
    assert m["arches"] == list(ARCHES)
    assert m["key"] == entry.path.name == cache.compute_key(m["key_inputs"])
    assert m["artifact_sha256"] == cache.sha256_file(entry.artifact)
    assert m["tolerance"] == profile(spec)
    assert json.loads((entry.path / "tolerance.json").read_text()) == m["tolerance"]
    # Key inputs: digests of the source and of every header it was built from (kept
    # beside the artifact), the full relative nvcc command with every arch, versions.
    source = entry.path / f"{spec.name}.cu"
    assert m["key_inputs"]["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert spec.name in source.read_text().splitlines()[0]
    headers = {p.relative_to(entry.path / "include").as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in (entry.path / "include").rglob("*") if p.is_file()}
    assert m["key_inputs"]["headers_sha256"] == headers
    # ... and that set is exactly what the stored source includes, transitively.
    assert set(headers) == set(render._included_headers(source.read_text(), entry.path / "include"))
    command = m["key_inputs"]["nvcc_command"]
    assert command[0] == "nvcc" and not any(str(representative.root) in a for a in command)
    for a in ARCHES:
        assert arch.ARCHES[a][0] in command
    assert m["key_inputs"]["nvcc_version"] == arch.nvcc_version(arch.find_nvcc())
    assert oct(os.stat(entry.path).st_mode & 0o777) == oct(0o700)


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize("spec,arch_name", list(_spill_params()))
def test_no_register_spills(representative, spec, arch_name):
    usage = representative.results[spec].entry.manifest["resources"]
    kernels_seen = {u["kernel"] for u in usage}
    main = "append_paged_kernel" if spec.op == "append_paged" else "attention_kernel"
    assert any(main in k for k in kernels_seen), f"no {main} in the ptxas report"
    for kernel in kernels_seen:
        assert sorted(u["arch"] for u in usage if u["kernel"] == kernel) == sorted(ARCHES), \
            f"{kernel} is not reported once per arch"
    mine = [u for u in usage if u["arch"] == arch_name]
    for u in mine:
        assert 0 < u["registers"] <= 255
    spills = [u for u in mine if u["spill_stores"] or u["spill_loads"]]
    assert spills == [], f"{spec.name} spills on {arch_name}: " + ", ".join(
        f"{u['kernel']}: {u['registers']} regs, {u['spill_stores']} B stores, {u['spill_loads']} B loads"
        for u in spills)


@pytest.mark.nvcc
@pytest.mark.slow
@needs_nvcc
def test_sm90a_only_build_takes_the_wide_fa2_tiling(monkeypatch, tmp_path):
    """A library built for sm_90a alone takes the two-fragment d128 tiling for
    non-causal ragged prefill (the same spec built for every default arch takes
    one fragment): 128 rows per CTA from the library, no spill on the variant
    closest to its register cap, and its own cache entry."""
    spec = KernelSpec.make("batch_prefill_ragged", "bfloat16", 128, use_tensor_cores=True, soft_cap=True,
                           return_lse=True).validate()
    set_cache_env(monkeypatch, tmp_path / "cache", arches="sm_90a")
    [result] = jit.build_many([spec])
    manifest = result.entry.manifest
    assert manifest["arches"] == ["sm_90a"]
    wide = kernels.fa2.FA2_WIDE_TILINGS[128]
    assert kernels.tiling_for(spec, manifest["arches"])[1] == wide
    assert loader.load_library(spec, result.entry.artifact, manifest).rows_per_cta == wide.rows_per_cta == 128
    spills = [u for u in manifest["resources"] if u["spill_stores"] or u["spill_loads"]]
    assert spills == [], spills
    other = jit.plan(spec, tuple(ARCHES), None)
    assert other.key != jit.plan(spec, ("sm_90a",), None).key
    assert re.findall(r"/\*kFragsM=\*/\s*(\d+)", other.rendered.text) == ["1"]


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize("spec", REPRESENTATIVE, ids=IDS)
def test_artifact_loads_without_a_gpu(representative, spec):
    entry = representative.results[spec].entry
    # load_library also checks the library's params struct size against the host mirror.
    module = loader.load_library(spec, entry.artifact, entry.manifest)
    if spec.op == "append_paged":  # no rows: one CTA per new token
        expected = 0
    else:
        expected = kernels.tiling_for(spec, entry.manifest["arches"])[1].rows_per_cta
        assert expected > 0
    assert module.rows_per_cta == expected
    # The library speaks the ABI of the header it was built from, which is the host's.
    header = (entry.path / "include" / "flashjit" / "common" / "attention_params.cuh").read_text()
    abi = int(re.search(r"#define FLASHJIT_ABI_VERSION (\d+)", header).group(1))
    lib = ctypes.CDLL(str(entry.artifact))
    lib.flashjit_abi_version.restype = ctypes.c_int
    assert lib.flashjit_abi_version() == abi == loader.ABI_VERSION >= 1
    assert module.tolerance_profile == profile(spec)


@pytest.mark.nvcc
@pytest.mark.slow
def test_launch_without_a_gpu_is_a_clear_error(representative):
    spec = REPRESENTATIVE[0]
    entry = representative.results[spec].entry
    module = loader.load_library(spec, entry.artifact, entry.manifest)
    with pytest.raises(KernelLaunchError, match=rf"^{spec.name}: CUDA error \d+ \(.+\) at launch"):
        module.run(bytes(loader.AttentionParams()), 0)


# ---------------------------------------------------------------------------
# Cache hits


@pytest.mark.nvcc
@pytest.mark.slow
def test_second_build_is_all_cache_hits_and_fast(representative, monkeypatch):
    _env(monkeypatch, representative)
    before = compile_count(representative.counter)
    started = time.monotonic()
    again = jit.build_many(REPRESENTATIVE)
    elapsed = time.monotonic() - started
    assert [r.built for r in again] == [False] * len(REPRESENTATIVE)
    assert [r.entry.path for r in again] == [representative.results[s].entry.path for s in REPRESENTATIVE]
    assert compile_count(representative.counter) == before, "a cache hit ran nvcc"
    print(f"\nwarm build_many of {len(REPRESENTATIVE)}: {elapsed * 1000:.0f} ms")
    assert elapsed < 1.0


@pytest.mark.nvcc
@pytest.mark.slow
def test_cached_configuration_is_ready_in_under_50ms(representative, monkeypatch):
    _env(monkeypatch, representative)
    spec = REPRESENTATIVE[3]
    times = []
    for _ in range(5):
        monkeypatch.setattr(jit, "_modules", {})
        started = time.perf_counter()
        module = jit.get_module(spec)
        times.append(time.perf_counter() - started)
    assert module.path == representative.results[spec].entry.artifact
    print(f"\ncached get_module: best {min(times) * 1000:.1f} ms, first {times[0] * 1000:.1f} ms")
    assert min(times) < 0.05


@pytest.mark.nvcc
@pytest.mark.slow
def test_disable_jit_serves_the_cache(representative, monkeypatch):
    _env(monkeypatch, representative)
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", "1")
    results = jit.build_many(REPRESENTATIVE[:3])
    assert [r.built for r in results] == [False] * 3


@pytest.mark.nvcc
@pytest.mark.slow
def test_cache_without_nvcc_serves_entries_of_any_toolchain(representative, monkeypatch):
    """A deployment machine with a prewarmed cache and no CUDA toolkit."""
    _env(monkeypatch, representative)
    monkeypatch.setattr(arch, "find_nvcc", lambda: None)
    results = jit.build_many(REPRESENTATIVE)
    assert [r.built for r in results] == [False] * len(REPRESENTATIVE)
    assert [r.entry.path for r in results] == [representative.results[s].entry.path for s in REPRESENTATIVE]


@pytest.mark.nvcc
@pytest.mark.slow
def test_other_arch_list_is_a_miss(representative, monkeypatch):
    _env(monkeypatch, representative, arches="sm_80")
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError):
        jit.build_many([REPRESENTATIVE[0]])


# ---------------------------------------------------------------------------
# Keys (no compile)


def _key(spec, arches=("sm_80",), nvcc=None) -> str:
    return jit.plan(spec, tuple(arches), nvcc).key


def test_key_changes_when_a_header_changes(templates_copy):
    spec = KernelSpec.make("single_prefill", "bfloat16", 128)
    before = jit.plan(spec, ("sm_80",), None)
    header = templates_copy / "include" / "flashjit" / "common" / "numeric.cuh"
    header.write_text(header.read_text() + "\n// an edit that changes no rendered text\n")
    after = jit.plan(spec, ("sm_80",), None)
    assert after.rendered.text == before.rendered.text
    assert after.key_inputs["headers_sha256"]["flashjit/common/numeric.cuh"] != \
        before.key_inputs["headers_sha256"]["flashjit/common/numeric.cuh"]
    assert after.key != before.key


def test_fingerprint_changes_when_a_header_changes(templates_copy, monkeypatch):
    """The cached-load fast path (no rendering) must not serve an entry built
    from an older header either."""
    monkeypatch.setattr(arch, "nvcc_version", lambda nvcc: "13.0.88")
    spec = KernelSpec.make("single_decode", "bfloat16", 256, soft_cap=True)
    before = jit.fingerprint(spec, ("sm_80",), "/fake/nvcc")
    assert before == jit.fingerprint(spec, ("sm_80",), "/fake/nvcc")
    header = templates_copy / "include" / "flashjit" / "common" / "work.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    for fn in (render.environment, render.generator_digest):
        fn.cache_clear()
    assert jit.fingerprint(spec, ("sm_80",), "/fake/nvcc") != before
    assert jit.fingerprint(spec, ("sm_89",), "/fake/nvcc") != jit.fingerprint(spec, ("sm_80",), "/fake/nvcc")


@needs_nvcc
@pytest.mark.nvcc
def test_header_edit_rebuilds_instead_of_serving_the_old_entry(fresh_cache, templates_copy):
    first = jit.build_many([SMALL_SPEC])[0]
    assert first.built and jit.build_many([SMALL_SPEC])[0].built is False
    header = templates_copy / "include" / "flashjit" / "common" / "numeric.cuh"
    header.write_text(header.read_text() + "\n// a comment: same code, new key\n")
    for fn in (render.environment, render.generator_digest):
        fn.cache_clear()
    second = jit.build_many([SMALL_SPEC])[0]
    assert second.built is True and second.entry.path != first.entry.path
    assert second.entry.path.parent == first.entry.path.parent == fresh_cache / SMALL_SPEC.name
    assert b"same code, new key" in (second.entry.path / "include" / "flashjit" / "common" / "numeric.cuh").read_bytes()
    assert len(entry_dirs(fresh_cache)) == 2


@needs_nvcc
@pytest.mark.nvcc
def test_entry_found_by_key_gets_the_current_fingerprint(fresh_cache, monkeypatch):
    """An entry whose manifest records an older fingerprint (its generator changed
    without changing the source) is served by its content key once, and records
    the current fingerprint, so the next load takes the fast path again."""
    first = jit.build_many([SMALL_SPEC])[0]
    manifest = first.entry.path / "manifest.json"
    current = json.loads(manifest.read_text())["fingerprint"]
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "fingerprint": "an-older-one"}))
    assert cache.find_entry_by_fingerprint(fresh_cache, SMALL_SPEC.name, current) is None
    again = jit.build_many([SMALL_SPEC])[0]
    assert again.built is False and again.entry.path == first.entry.path
    assert json.loads(manifest.read_text())["fingerprint"] == current
    assert cache.find_entry_by_fingerprint(fresh_cache, SMALL_SPEC.name, current).path == first.entry.path
    monkeypatch.setattr(jit, "plan", lambda *a, **k: pytest.fail("a fingerprint hit must not render"))
    assert jit.build_many([SMALL_SPEC])[0].entry.path == first.entry.path


def test_key_changes_when_the_template_changes(templates_copy):
    spec = KernelSpec.make("single_decode", "float16", 64)
    before = _key(spec)
    template = templates_copy / "attention_cuda_decode.cu.jinja"
    template.write_text(template.read_text().replace("CUDA-core decode", "CUDA-core decode (edited)"))
    assert _key(spec) != before


def test_key_changes_with_the_arch_list_and_nvcc_version(monkeypatch):
    spec = KernelSpec.make("single_prefill", "float16", 64)
    keys = {_key(spec, a) for a in [("sm_80",), ("sm_89",), ("sm_90a",), ("sm_80", "sm_89"), ARCHES]}
    assert len(keys) == 5
    monkeypatch.setattr(arch, "nvcc_version", lambda nvcc: "12.4.131")
    k124 = _key(spec, nvcc="/fake/nvcc")
    monkeypatch.setattr(arch, "nvcc_version", lambda nvcc: "13.0.88")
    k130 = _key(spec, nvcc="/fake/nvcc")
    assert k130 != k124
    monkeypatch.setattr(jit, "__version__", "999.0")
    assert _key(spec, nvcc="/fake/nvcc") not in (k124, k130), "the flashjit version enters the key"


def test_key_does_not_depend_on_the_cache_location_or_nvcc_path(monkeypatch, tmp_path):
    spec = KernelSpec.make("batch_prefill_ragged", "bfloat16", 256, return_lse=True)
    monkeypatch.setattr(arch, "nvcc_version", lambda nvcc: "13.0.88")
    a = jit.plan(spec, ("sm_80",), "/opt/cuda/bin/nvcc")
    monkeypatch.setenv("FLASHJIT_CACHE_DIR", str(tmp_path / "elsewhere"))
    b = jit.plan(spec, ("sm_80",), "/usr/local/cuda/bin/nvcc")
    assert a.key == b.key
    assert a.key_inputs["nvcc_command"][0] == "nvcc"
    assert "-Iinclude" in a.key_inputs["nvcc_command"]


@pytest.mark.parametrize("spec", REPRESENTATIVE, ids=IDS)
def test_distinct_configurations_have_distinct_keys(spec):
    keys = {_key(s) for s in REPRESENTATIVE}
    assert len(keys) == len(REPRESENTATIVE)
    assert _key(spec) == _key(spec), "the key is deterministic"


# ---------------------------------------------------------------------------
# No-JIT mode and missing toolchain (no compile)


def test_disable_jit_with_empty_cache_names_the_prewarm_command(fresh_cache, monkeypatch):
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", "1")
    spec = KernelSpec.make("single_prefill", "bfloat16", 128, causal=True)
    with pytest.raises(JitDisabledError) as info:
        jit.build_many([spec])
    message = str(info.value)
    assert "flashjit prewarm" in message and spec.name in message and "sm_80" in message
    assert entry_dirs(fresh_cache) == [] and tmp_dirs(fresh_cache) == []


def _hinted_specs(message: str):
    command = re.search(r"(flashjit prewarm [^(\n]*)", message).group(1)
    args = cli.build_parser().parse_args(shlex.split(command)[1:])
    return cli.specs_from_args(args), args


@pytest.mark.parametrize("spec", [
    pytest.param(KernelSpec.make("single_prefill", "bfloat16", 128), id="plain"),
    pytest.param(KernelSpec.make("single_prefill", "float16", 64, causal=True), id="causal"),
    pytest.param(KernelSpec.make("batch_prefill_ragged", "float32", 256, return_lse=True), id="ragged"),
    pytest.param(KernelSpec.make("single_prefill", "bfloat16", 128, sliding_window=True), id="window"),
    pytest.param(KernelSpec.make("single_decode", "float16", 64, soft_cap=True), id="softcap"),
    pytest.param(KernelSpec.make("single_decode", "float32", 256, return_lse=True), id="lse"),
])
def test_disable_jit_prewarm_hint_builds_the_missing_configuration(fresh_cache, monkeypatch, spec):
    monkeypatch.setenv("FLASHJIT_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError) as info:
        jit.build_many([spec])
    specs, args = _hinted_specs(str(info.value))
    assert args.arch == ["sm_80"]
    assert spec in specs, f"`{info.value}` does not build {spec.name}"


def test_missing_nvcc_is_a_toolchain_error_with_the_fix(fresh_cache, monkeypatch):
    monkeypatch.setattr(arch, "find_nvcc", lambda: None)
    spec = KernelSpec.make("single_decode", "bfloat16", 128)
    with pytest.raises(ToolchainError) as info:
        jit.build_many([spec])
    message = str(info.value)
    assert spec.name in message and "nvcc was not found" in message
    assert "CUDA_HOME" in message and "PATH" in message
    with pytest.raises(ToolchainError, match=r"nvcc not found \(looked at \$FLASHJIT_NVCC, \$CUDA_HOME"):
        arch.require_nvcc()
    assert entry_dirs(fresh_cache) == []


def test_find_nvcc_search_order(monkeypatch, tmp_path):
    def fake(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return path

    explicit, home, cuda_path = fake(tmp_path / "x" / "nvcc"), fake(tmp_path / "home" / "bin" / "nvcc"), \
        fake(tmp_path / "cpath" / "bin" / "nvcc")
    monkeypatch.setenv("FLASHJIT_NVCC", str(explicit))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "cpath"))
    assert arch.find_nvcc() == str(explicit)
    # A FLASHJIT_NVCC that is no executable is an error (tests/test_settings.py), not skipped.
    monkeypatch.delenv("FLASHJIT_NVCC")
    assert arch.find_nvcc() == str(home)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    assert arch.find_nvcc() == str(cuda_path)
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH")
    path_dir = tmp_path / "path"
    fake(path_dir / "nvcc")
    monkeypatch.setenv("PATH", str(path_dir))
    assert arch.find_nvcc() == str(path_dir / "nvcc")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    default = Path("/usr/local/cuda/bin/nvcc")
    assert arch.find_nvcc() == (str(default) if default.is_file() else None)


def test_old_nvcc_for_an_arch_names_the_fix(monkeypatch, tmp_path):
    old = tmp_path / "nvcc"
    old.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 11.8, V11.8.89'\n")
    old.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert arch.nvcc_version(str(old)) == "11.8.89"
    arch.check_nvcc_supports("11.8.89", ["sm_80", "sm_89"])
    with pytest.raises(ToolchainError, match=r"nvcc 11.8.89 cannot compile for sm_90a \(needs CUDA 12.0"):
        arch.check_nvcc_supports("11.8.89", ["sm_80", "sm_90a"])
    # build_many refuses before rendering or compiling anything.
    set_cache_env(monkeypatch, tmp_path / "cache", arches="sm_90a", xdg=tmp_path / "xdg")
    monkeypatch.setenv("FLASHJIT_NVCC", str(old))
    with pytest.raises(ToolchainError, match="upgrade the CUDA toolkit"):
        jit.build_many([SMALL_SPEC])
    assert entry_dirs(tmp_path / "cache") == []


def test_unreadable_nvcc_version_is_a_toolchain_error(tmp_path, monkeypatch):
    odd = tmp_path / "nvcc"
    odd.write_text("#!/bin/sh\necho 'something else'\n")
    odd.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ToolchainError, match="cannot read the version"):
        arch.nvcc_version(str(odd))


@pytest.mark.parametrize("name,expected", [("sm_80", "sm_80"), ("80", "sm_80"), ("8.0", "sm_80"), ("sm89", "sm_89"),
                                           ("8.9", "sm_89"), ("9.0a", "sm_90a"), ("sm_90", "sm_90a"),
                                           ("90a", "sm_90a"), ("compute_86", "sm_86"), (" SM_80 ", "sm_80")])
def test_normalize_arch(name, expected):
    assert arch.normalize_arch(name) == expected


@pytest.mark.parametrize("name", ["sm_75", "7.5", "sm_70", "banana", ""])
def test_unknown_arch_names_the_supported_ones(name):
    with pytest.raises(ToolchainError) as info:
        arch.normalize_arch(name)
    assert "sm_80" in str(info.value) and "sm_90a" in str(info.value)


def test_arch_list_from_environment(fresh_cache, monkeypatch):
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "9.0a, 8.0;sm_89 8.0")
    assert jit.resolve_arches() == ("sm_80", "sm_89", "sm_90a")
    monkeypatch.setenv("FLASHJIT_CUDA_ARCH_LIST", "sm_75")
    with pytest.raises(SettingError, match="FLASHJIT_CUDA_ARCH_LIST: .*'sm_75'"):
        jit.build_many([SMALL_SPEC])
    assert is_empty(fresh_cache)


def test_gpu_older_than_sm80_is_refused():
    with pytest.raises(ToolchainError, match="needs SM80 or newer"):
        arch.arch_of_capability(7, 5, "Tesla T4")
    assert arch.arch_of_capability(9, 0) == "sm_90a"


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_bad_flashjit_jobs(monkeypatch, value):
    monkeypatch.setenv("FLASHJIT_JOBS", value)
    with pytest.raises(ValueError, match="FLASHJIT_JOBS: expected a positive integer"):
        build.default_jobs()


def test_default_jobs_is_capped(monkeypatch):
    monkeypatch.delenv("FLASHJIT_JOBS", raising=False)
    assert 1 <= build.default_jobs() <= len(os.sched_getaffinity(0))
    monkeypatch.setenv("FLASHJIT_JOBS", "3")
    assert build.default_jobs() == 3


def test_resource_usage_parser():
    log_text = """\
ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_80'
ptxas info    : Function properties for _Z6kernelv
    8 bytes stack frame, 4 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 8 bytes cumulative stack size, 536 bytes cmem[0]
ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90a'
ptxas info    : Function properties for _Z6kernelv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 1024 bytes smem, 536 bytes cmem[0]
"""
    assert build.resource_usage(log_text) == [
        {"kernel": "_Z6kernelv", "arch": "sm_80", "stack": 8, "spill_stores": 4, "spill_loads": 16,
         "registers": 96},
        {"kernel": "_Z6kernelv", "arch": "sm_90a", "stack": 0, "spill_stores": 0, "spill_loads": 0,
         "registers": 128, "static_smem": 1024},
    ]


# ---------------------------------------------------------------------------
# A compile error


@needs_nvcc
@pytest.mark.nvcc
def test_compile_error_names_configuration_command_and_error_line(fresh_cache, templates_copy):
    header = templates_copy / "include" / "flashjit" / "common" / "numeric.cuh"
    header.write_text(header.read_text().replace(
        "namespace flashjit {", "namespace flashjit {\nint flashjit_injected_syntax_error = ;", 1))
    spec = KernelSpec.make("single_decode", "float16", 64, return_lse=True)
    with pytest.raises(BuildError) as info:
        jit.build_many([spec])
    message = str(info.value)
    assert f"nvcc failed for configuration {spec.name}" in message
    assert "-gencode=arch=compute_80,code=sm_80" in message and " -o lib" in message
    error_lines = [ln for ln in message.splitlines() if "numeric.cuh" in ln and "error" in ln]
    assert error_lines, f"no compiler error line naming the header in:\n{message}"
    log_path = Path(re.search(r"full log: (\S+)", message).group(1))
    assert log_path.is_file()
    assert any("numeric.cuh" in ln and "error" in ln for ln in log_path.read_text().splitlines())
    # Nothing was published; raise_first=False reports the same error per configuration.
    assert entry_dirs(fresh_cache) == []
    results = jit.build_many([spec], raise_first=False)
    assert results[0].entry is None and isinstance(results[0].error, BuildError)
    assert spec.name in str(results[0].error)
