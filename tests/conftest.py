"""Shared fixtures: GPU skipping, the prewarm of every swept configuration in
one parallel build, and the per-configuration error report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_HAS_GPU = None
_REPORT: list[dict] = []


def has_gpu() -> bool:
    global _HAS_GPU
    if _HAS_GPU is None:
        import torch

        _HAS_GPU = torch.cuda.is_available()
    return _HAS_GPU


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prewarmed():
    """Builds every configuration the GPU sweep uses in one ninja run."""
    from sweep import all_specs, build_for_gpu

    return build_for_gpu(all_specs())


@pytest.fixture
def error_report():
    """Tests append {config, max err/bound, ...}; written to $FLASHJIT_ERROR_REPORT at the end."""
    return _REPORT


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FLASHJIT_ERROR_REPORT")
    if path and _REPORT:
        Path(path).write_text(json.dumps(_REPORT, indent=0))


def pytest_runtest_setup(item):
    if "nvcc" in item.keywords:
        from flashjit import arch

        if arch.find_nvcc() is None:
            pytest.skip("needs nvcc")
