"""pytest with the fa3 MLA kernels of another tiling: the GPU tests of a
kernels.fa3.Fa3MlaTiling other than the shipped one, built into
a cache of its own (benchmarks/common.py, fa3_mla_tiling). The arguments after
the tiling go to pytest.

Usage: python benchmarks/dev/pytest_mla_tiling.py 'Fa3MlaTiling(stages=2, key_groups=1)' -m gpu -k mla tests
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
from common import fa3_mla_tiling, parse_fa3_mla_tiling

import pytest


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    tiling = parse_fa3_mla_tiling(sys.argv[1])
    print(f"fa3 MLA tiling: {tiling}", flush=True)
    with fa3_mla_tiling(tiling):
        return int(pytest.main(sys.argv[2:]))


if __name__ == "__main__":
    sys.exit(main())
