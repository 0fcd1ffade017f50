"""pytest with another tensor-core FP8 decode tiling: the GPU tests with
kernels.fa2.FA2_FP8_DECODE_TILINGS[128] (every head dim that takes the d128
tiling) replaced by the kernels.fa2.Fa2Tiling on the command line, built into
a cache of its own (one per tiling, kept in the temporary folder for the next
run). The arguments after the tiling go to pytest.

Usage: python benchmarks/dev/pytest_fp8_decode_tiling.py \\
           'Fa2Tiling(4, 64, 3, False, 2, split_keys=True)' -m gpu tests/test_gpu_fp8_tc.py
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import pytest

from flashjit import jit, kernels
from flashjit.kernels.fa2 import Fa2Tiling


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    tiling = eval(sys.argv[1], {"Fa2Tiling": Fa2Tiling})
    if not isinstance(tiling, Fa2Tiling):
        raise ValueError(f"tiling: expected a Fa2Tiling(...) expression, got {sys.argv[1]!r}")
    print(f"fa2 FP8 decode tiling: {tiling}", flush=True)
    # The cached-load fast path finds entries by the generator's files, which a
    # tiling set at run time does not change: a cache of the tiling's own.
    digest = hashlib.sha256(repr(tiling).encode()).hexdigest()[:12]
    os.environ["FLASHJIT_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"flashjit-fp8-decode-tiling-{digest}")
    kernels.fa2.FA2_FP8_DECODE_TILINGS[128] = tiling
    jit._modules.clear()
    return int(pytest.main(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
