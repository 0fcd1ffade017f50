"""pytest with fa3 reading an FP8 MLA cache: `mla_paged` added to
spec.FA3_FP8_OPS for this process, so that `auto` and backend="fa3" run fa3's
FP8 MLA kernel (not selected by default: docs/mla.md, "FP8 caches") and
tests/test_gpu_mla_fp8.py takes fa3 among its backends. The arguments go to
pytest.

Usage: python benchmarks/dev/pytest_fa3_fp8_mla.py -m gpu tests/test_gpu_mla_fp8.py
"""

from __future__ import annotations

import sys

import pytest

from flashjit import spec


def main() -> int:
    if "mla_paged" not in spec.FA3_FP8_OPS:
        spec.FA3_FP8_OPS = (*spec.FA3_FP8_OPS, "mla_paged")
    print(f"spec.FA3_FP8_OPS = {spec.FA3_FP8_OPS}", flush=True)
    return int(pytest.main(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
