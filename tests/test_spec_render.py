"""Configurations, their validation and their rendered CUDA source (no nvcc, no GPU)."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from flashjit import kernels, render
from flashjit.spec import (ATTENTION_OPS, BACKENDS, DECODE_OPS, DTYPES, HEAD_DIMS, KV_ONLY_DTYPES, OPS, PAGED_OPS,
                           PLANNED_OPS, KernelSpec, canonical_dtype)
from helpers_cache import REPO, subprocess_env, templates_copy  # noqa: F401 (fixture)

FLAGS = ("causal", "sliding_window", "soft_cap", "return_lse")
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
QO_DTYPES = [d for d in DTYPES if d not in KV_ONLY_DTYPES]  # FP8 is swept in test_fp8_spec.py


def sweep() -> list[KernelSpec]:
    """op x dtype x head_dim x causal x window x soft-cap x lse, CUDA cores."""
    return [KernelSpec.make(op, dtype, hd, use_tensor_cores=False, causal=c, sliding_window=w, soft_cap=s,
                            return_lse=lse)
            for op, dtype, hd, c, w, s, lse in itertools.product(ATTENTION_OPS, QO_DTYPES, HEAD_DIMS,
                                                                         *[(False, True)] * 4)]


SWEEP = sweep()


def all_valid_specs() -> dict[str, KernelSpec]:
    """Name -> spec of every configuration validate() accepts (whatever the
    generator supports today), to check that a 'nearest working choice' works."""
    valid = {}
    for op, dtype, hd, backend, tc, *flags in itertools.product(OPS, QO_DTYPES, HEAD_DIMS, BACKENDS, (False, True),
                                                                 *[(False, True)] * 4):
        spec = KernelSpec.make(op, dtype, hd, backend=backend, use_tensor_cores=tc, **dict(zip(FLAGS, flags)))
        try:
            valid[spec.name] = spec.validate()
        except ValueError:
            pass
    return valid


# ---------------------------------------------------------------------------
# Names


def test_sweep_names_are_unique_and_readable():
    names = [s.name for s in SWEEP]
    assert len(SWEEP) == len(ATTENTION_OPS) * 3 * len(HEAD_DIMS) * 16
    assert len(set(names)) == len(names), "two configurations share a name (and so a cache directory)"
    for spec in SWEEP:
        assert spec.name.startswith(f"{spec.op}_{DTYPES[spec.dtype_q][0]}_d{spec.head_dim_qk}_fa2_cc")
        assert re.fullmatch(r"[a-z0-9_]+", spec.name), "names are path components: no odd characters"


@pytest.mark.parametrize("alias,canonical", [("fp16", "float16"), ("half", "float16"), ("bf16", "bfloat16"),
                                             ("fp32", "float32"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_dtype_aliases(alias, canonical):
    import torch

    assert canonical_dtype(alias) == canonical
    assert canonical_dtype(getattr(torch, canonical)) == canonical


# ---------------------------------------------------------------------------
# Rendering every configuration of the sweep


def test_environment_is_strict():
    env = render.environment()
    assert env.undefined is jinja2.StrictUndefined


def _expected_values(spec: KernelSpec) -> dict[str, str]:
    template, tiling = kernels.tiling_for(spec)
    cb = {True: "true", False: "false"}
    flags = {"kWindow": cb[spec.sliding_window], "kSoftCap": cb[spec.soft_cap], "kLse": cb[spec.return_lse]}
    if template == "attention_cuda_decode.cu.jinja":
        return {
            "DType": CTYPES[spec.dtype_q], "kHeadDim": str(spec.head_dim_qk), "kWarps": str(tiling.warps),
            "kKeysPerGroup": str(tiling.keys_per_group), "kStages": str(tiling.stages),
            "kMinBlocksPerSm": str(tiling.min_blocks_per_sm),
            "kPaged": cb[spec.op in PAGED_OPS], **flags,
        }
    return {
        "DTypeQ": CTYPES[spec.dtype_q], "DTypeKV": CTYPES[spec.dtype_kv], "DTypeO": CTYPES[spec.dtype_o],
        "kHeadDimQK": str(spec.head_dim_qk), "kHeadDimVO": str(spec.head_dim_vo),
        "kRowsPerWarp": str(tiling.rows_per_warp), "kRowWarps": str(tiling.row_warps),
        "kPaged": cb[spec.op in PAGED_OPS], "kCausal": cb[spec.causal], **flags,
    }


@pytest.mark.parametrize("op", ATTENTION_OPS)
@pytest.mark.parametrize("dtype", QO_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_sweep_renders_with_its_instantiation_values(op, dtype, head_dim):
    """Every variant-flag combination of (op, dtype, head_dim) renders under
    StrictUndefined and instantiates the traits with exactly its values."""
    texts = set()
    for spec in (s for s in SWEEP if (s.op, s.dtype_q, s.head_dim_qk) == (op, dtype, head_dim)):
        rendered = render.render(spec.validate())
        text = rendered.text
        assert rendered.filename == f"{spec.name}.cu"
        assert spec.name in text.splitlines()[0]
        assert "{{" not in text and "{%" not in text and "}}" not in text
        for param, value in _expected_values(spec).items():
            found = re.findall(rf"/\*{param}=\*/\s*([\w:]+)", text)
            assert found == [value], f"{spec.name}: {param} instantiated as {found}, expected {value}"
        assert kernels.tiling_for(spec)[1].smem_bytes(spec) <= kernels.common.SMEM_BUDGET
        texts.add(text)
    assert len(texts) == 16, "each flag combination must render a different source"


def test_decode_has_its_own_kernel_and_prefill_splits_rows():
    """Decode splits keys; batch-invariant decode (causal=True) runs the prefill kernel, rows split."""
    for spec in SWEEP:
        template, t = kernels.tiling_for(spec)
        if spec.op in DECODE_OPS and not spec.invariant_decode:
            assert template == "attention_cuda_decode.cu.jinja" and t.warps > 1 and t.rows_per_cta == 4
        else:
            assert template == "attention_cuda_core.cu.jinja" and t.row_warps > 1


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("op", ["single_prefill", "batch_prefill_ragged", "batch_prefill_paged"])
def test_wide_fa2_tiling_only_where_every_target_fits_it(op, causal, head_dim):
    """Ragged prefill takes the wide tiling when every target arch is one it was
    checked on (sm_90a) and holds min_blocks_per_sm of its CTAs per SM; with an
    A100, SM89 or unchecked target, with no arch known, paged, or with the flags
    that spill, FA2_TILINGS. The tolerance profile takes the default's rescale
    count, which is at least the wide tiling's."""
    spec = KernelSpec.make(op, "bfloat16", head_dim, use_tensor_cores=True, causal=causal).validate()
    default = kernels.tiling_for(spec)[1]
    assert default == kernels.fa2.FA2_TILINGS[head_dim]
    wide_here = op != "batch_prefill_paged"
    for arches, wide in [(("sm_90a",), wide_here), (("sm_80", "sm_90a"), False), (("sm_89",), False),
                         (("sm_100a",), False), (None, False)]:
        tiling = kernels.tiling_for(spec, arches)[1]
        assert tiling == (kernels.fa2.FA2_WIDE_TILINGS[head_dim] if wide else default), arches
        assert tiling.rescales(spec)[0] >= default.rescales(spec)[0]
        text = render.render(spec, arches).text
        for field, value in [("kWarps", tiling.warps), ("kFragsM", tiling.frags_m),
                             ("kKeysPerTile", tiling.keys_per_tile), ("kSubTiles", tiling.sub_tiles),
                             ("kOneWait", str(tiling.one_wait).lower()), ("kFencePv", str(tiling.fence_pv).lower()),
                             ("kTmaKv", str(tiling.tma_kv).lower()), ("kSlotRelease", str(tiling.slot_release).lower())]:
            assert re.findall(rf"/\*{field}=\*/\s*(\w+)", text) == [str(value)], (arches, field)
    # The flag sets whose wide kernels spill on sm_90a (none for d64) keep the default.
    every_flag = spec.replace(soft_cap=True, sliding_window=True, return_lse=True).validate()
    capped = spec.replace(soft_cap=True).validate()
    for flagged, spills in [(every_flag, head_dim != 64), (capped, head_dim == 256 and causal)]:
        wide = kernels.fa2.FA2_WIDE_TILINGS[head_dim] if wide_here and not spills else kernels.fa2.FA2_TILINGS[head_dim]
        assert kernels.tiling_for(flagged, ("sm_90a",))[1] == wide, flagged.name


@pytest.mark.parametrize("missing", ["name", "dtype_q", "dtype_kv", "dtype_o", "head_dim_qk", "head_dim_vo",
                                     "causal", "sliding_window", "soft_cap", "return_lse", "tiling"])
def test_missing_template_variable_is_an_error(missing):
    """StrictUndefined: a variable the template uses but the context lacks raises,
    never renders as an empty string."""
    spec = KernelSpec.make("single_prefill", "bfloat16", 128, causal=True)
    template_name, context = kernels.template_for(spec)
    assert missing in context
    del context[missing]
    with pytest.raises(jinja2.UndefinedError):
        render.environment().get_template(template_name).render(**context)


_BASE = KernelSpec.make("single_prefill", "float16", 128)


@pytest.mark.parametrize("change", [
    {"dtype_q": "bfloat16", "dtype_kv": "bfloat16", "dtype_o": "bfloat16"},
    {"dtype_q": "float32", "dtype_kv": "float32", "dtype_o": "float32"},
    {"head_dim_qk": 64, "head_dim_vo": 64},
    {"head_dim_qk": 256, "head_dim_vo": 256},
    {"causal": True}, {"sliding_window": True}, {"soft_cap": True}, {"return_lse": True},
    {"op": "single_decode"}, {"op": "batch_prefill_ragged"},
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_rendering_changes_with_each_template_variable(change):
    base = render.render(_BASE)
    other = render.render(_BASE.replace(**change).validate())
    assert other.text != base.text
    assert other.digest_inputs()["source_sha256"] != base.digest_inputs()["source_sha256"]
    assert other.filename != base.filename


def test_rendering_is_pure_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = render.render(_BASE), render.render(_BASE)
    assert a.text == b.text and a.headers == b.headers and a.digest_inputs() == b.digest_inputs()
    assert list(tmp_path.iterdir()) == [], "render() must not write files"


# ---------------------------------------------------------------------------
# Headers


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _closure(text: str, include_root: Path) -> dict[str, bytes]:
    """Independent resolution of quoted includes: beside the includer, then -Iinclude."""
    found: dict[str, bytes] = {}
    todo = [(Path("."), name) for name in _INCLUDE.findall(text)]
    while todo:
        base, name = todo.pop()
        for candidate in (base / name, Path(name)):
            path = include_root / candidate
            if path.is_file():
                rel = path.resolve().relative_to(include_root.resolve()).as_posix()
                if rel not in found:
                    found[rel] = path.read_bytes()
                    todo += [(Path(rel).parent, n) for n in _INCLUDE.findall(found[rel].decode())]
                break
        else:
            raise AssertionError(f"#include \"{name}\" (from {base}) resolves to no file")
    return found


@pytest.mark.parametrize("spec", [KernelSpec.make(op, dt, hd, return_lse=True)
                                  for op, dt, hd in [("single_prefill", "float16", 64),
                                                     ("single_decode", "bfloat16", 256),
                                                     ("batch_prefill_ragged", "float32", 128)]],
                         ids=lambda s: s.name)
def test_headers_cover_every_include_transitively(spec):
    rendered = render.render(spec)
    include_root = render.templates_dir() / "include"
    direct = [n for n in _INCLUDE.findall(rendered.text)]
    assert direct and all(n.startswith("flashjit/") for n in direct)
    expected = _closure(rendered.text, include_root)
    assert {Path(k).as_posix() for k in rendered.headers} == set(expected)
    for rel, data in rendered.headers.items():
        assert data == (include_root / rel).read_bytes()
    # Every quoted include of every header resolves inside the recorded set.
    for rel, data in rendered.headers.items():
        for name in _INCLUDE.findall(data.decode()):
            beside = (Path(rel).parent / name).as_posix()
            assert beside in expected or name in expected, f"{rel} includes {name}, not in the headers dict"
    digests = rendered.digest_inputs()["headers_sha256"]
    assert set(digests) == set(rendered.headers)


def test_missing_header_is_reported(templates_copy):
    (templates_copy / "include" / "flashjit" / "common" / "work.cuh").unlink()
    with pytest.raises(FileNotFoundError, match="work.cuh"):
        render.render(_BASE)


# ---------------------------------------------------------------------------
# validate(): the supported set and the nearest working choice


VALID = all_valid_specs()


def _nearest(message: str) -> KernelSpec:
    m = re.search(r"[Nn]earest working choice:\s*([a-z0-9_]+)", message)
    assert m, f"no nearest working choice in: {message}"
    assert m.group(1) in VALID, f"the nearest choice {m.group(1)} is not a configuration that validates"
    return VALID[m.group(1)]


def _diff(a: KernelSpec, b: KernelSpec) -> set[str]:
    return {k for k, v in a.as_dict().items() if b.as_dict()[k] != v}


@pytest.mark.parametrize("spec,supported,may_change", [
    pytest.param(KernelSpec.make("single_prefill", "float32", 128, use_tensor_cores=True),
                 ["float16", "bfloat16"], {"use_tensor_cores", "dtype_q", "dtype_kv", "dtype_o"},
                 id="fp32-tensor-cores"),
    pytest.param(KernelSpec.make("single_decode", "float32", 64, use_tensor_cores=True, return_lse=True),
                 ["float16", "bfloat16"], {"use_tensor_cores", "dtype_q", "dtype_kv", "dtype_o"},
                 id="fp32-tensor-cores-decode"),
    pytest.param(KernelSpec.make("single_prefill", "bfloat16", 100), ["nearest: 96 or 112", "from 32 to 256"],
                 {"head_dim_qk", "head_dim_vo"}, id="head_dim-100"),
    pytest.param(KernelSpec.make("batch_prefill_ragged", "float16", 512, return_lse=True),
                 ["nearest: 256", "from 32 to 256"], {"head_dim_qk", "head_dim_vo"}, id="head_dim-512"),
    pytest.param(KernelSpec.make("batch_prefill_paged", "bfloat16", 80, backend="fa3", use_tensor_cores=True,
                                 causal=True), ["64, 96, 128, 192, 256", "on fa2"], {"backend"}, id="fa3-head_dim-80"),
    pytest.param(KernelSpec.make("single_prefill", "float16", 128, head_dim_vo=64), ["not generated", "192/128"],
                 {"head_dim_qk", "head_dim_vo"}, id="qk-ne-vo"),
    pytest.param(KernelSpec.make("single_prefill", "float16", 128, dtype_kv="bfloat16"), ["one dtype"],
                 {"dtype_q", "dtype_kv", "dtype_o"}, id="mixed-q-kv"),
    pytest.param(KernelSpec.make("single_decode", "bfloat16", 64, dtype_o="float32"), ["one dtype"],
                 {"dtype_q", "dtype_kv", "dtype_o"}, id="mixed-o"),
    # fa3 is wgmma (tensor cores): never a CUDA-core backend.
    pytest.param(KernelSpec.make("single_prefill", "bfloat16", 128, backend="fa3", causal=True), ["fa2"],
                 {"backend", "use_tensor_cores"}, id="fa3"),
])
def test_validate_names_supported_set_and_nearest_choice(spec, supported, may_change):
    with pytest.raises(ValueError) as info:
        spec.validate()
    message = str(info.value)
    for item in supported:
        assert item in message, f"{message!r} does not name {item!r}"
    nearest = _nearest(message)
    changed = _diff(spec, nearest)
    assert changed and changed <= may_change, f"nearest choice {nearest.name} changes {changed}"
    # The flags the user asked for survive.
    for flag in FLAGS:
        assert getattr(nearest, flag) == getattr(spec, flag)


@pytest.mark.parametrize("op", ["single_prefil", "attention", "mla_pagd"])
def test_unknown_and_planned_ops_name_the_available_ops(op):
    with pytest.raises(ValueError) as info:
        KernelSpec.make(op, "bfloat16", 128).validate()
    message = str(info.value)
    assert op in message
    for available in OPS:
        assert available in message
    if op in PLANNED_OPS:
        assert "not available yet" in message


@pytest.mark.parametrize("op,nearest_op", [("single_prefil", "single_prefill"), ("prefill_paged", "batch_prefill_paged")])
def test_unknown_and_planned_ops_name_a_nearest_choice(op, nearest_op):
    with pytest.raises(ValueError) as info:
        KernelSpec.make(op, "bfloat16", 128).validate()
    assert _nearest(str(info.value)).op == nearest_op


@pytest.mark.parametrize("bad", ["float64", "int8", "fp8"])
def test_unknown_dtype_names_the_supported_dtypes(bad):
    with pytest.raises(ValueError) as info:
        KernelSpec.make("single_prefill", bad, 128)
    for name in DTYPES:
        assert name in str(info.value)
    assert bad in str(info.value)


def test_unknown_backend_names_the_backends():
    with pytest.raises(ValueError, match="fa2"):
        KernelSpec.make("single_prefill", "float16", 128, backend="auto").validate()


def test_every_sweep_configuration_validates():
    for spec in SWEEP:
        assert spec.validate() is spec


# ---------------------------------------------------------------------------
# `import flashjit` is cheap and initialises nothing


def test_import_flashjit_imports_nothing_heavy(tmp_path):
    cache_dir, xdg = tmp_path / "cache", tmp_path / "xdg"
    marker = tmp_path / "nvcc-was-run"
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text(f"#!/bin/sh\n: > '{marker}'\nexit 1\n")
    fake_nvcc.chmod(0o755)
    probe = r"""
import json, sys, threading, time
before = set(sys.modules)
t = time.perf_counter()
import flashjit
elapsed = time.perf_counter() - t
new = sorted(set(sys.modules) - before)
names = sorted(flashjit.__all__)
flashjit.KernelSpec  # lazy attribute: imports flashjit.spec only
after_spec = sorted(set(sys.modules) - before)
print(json.dumps({"new": new, "after_spec": after_spec, "threads": threading.active_count(),
                  "elapsed": elapsed, "names": names}))
"""
    env = subprocess_env(cache_dir, FLASHJIT_NVCC=str(fake_nvcc), XDG_CACHE_HOME=str(xdg))
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert set(info["new"]) <= {"flashjit", "flashjit._version"}, info["new"]
    for heavy in ("torch", "jinja2", "ctypes", "filelock", "flashjit.render", "flashjit.jit", "flashjit.ops"):
        assert heavy not in info["after_spec"], f"{heavy} imported by `import flashjit` / flashjit.KernelSpec"
    assert info["threads"] == 1
    assert not cache_dir.exists(), "import created the cache directory"
    assert not xdg.exists(), "import wrote the nvcc version memo"
    assert not marker.exists(), "import ran nvcc"
    assert info["elapsed"] < 0.05
    assert {"single_prefill_with_kv_cache", "single_decode_with_kv_cache", "tolerance", "build_many"} <= set(
        info["names"])


def test_import_flashjit_after_torch_is_fast():
    probe = ("import time, torch; t = time.perf_counter(); import flashjit; "
             "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=subprocess_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 0.05


def test_every_public_name_resolves():
    import flashjit

    for name in flashjit.__all__:
        assert getattr(flashjit, name) is not None
    assert callable(flashjit.tolerance) and isinstance(flashjit.Tolerance, type)
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(flashjit, "no_such_name")


@pytest.mark.parametrize("flags", [{"causal": True}, {"use_tensor_cores": True}, {"return_lse": True}])
def test_append_takes_no_variant_flags(flags):
    spec = KernelSpec.make("append_paged", "bfloat16", 128, **flags)
    with pytest.raises(ValueError, match="Nearest working choice: append_paged_bf16_d128$"):
        spec.validate()
    assert KernelSpec.make("append_paged", "bfloat16", 128).validate().name == "append_paged_bf16_d128"
