"""SASS of CPU builds, for the tests that check what a kernel compiled to
(cuobjdump from the nvidia-cuda-cuobjdump wheel of the test extra, else PATH)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest


def cuobjdump() -> Path | None:
    """cuobjdump from the nvidia-cuda-cuobjdump wheel (test extra), else from PATH."""
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for found in Path(root).glob("*/bin/cuobjdump"):
            return found
    import shutil

    found = shutil.which("cuobjdump")
    return Path(found) if found else None


def sass(library: Path) -> str:
    tool = cuobjdump()
    if tool is None:
        pytest.skip("needs cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = {**os.environ, "PATH": f"{tool.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([str(tool), "-sass", str(library)], capture_output=True, text=True, check=True,
                          env=env).stdout


_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*/\*", re.MULTILINE)


def functions(text: str) -> dict[str, list[tuple[int, str]]]:
    """Each function of a cuobjdump -sass listing: its (address, instruction) pairs."""
    out = {}
    for part in text.split("Function : ")[1:]:
        name = part.split(None, 1)[0]
        out[name] = [(int(a, 16), ins) for a, ins in _INSTRUCTION.findall(part)]
    return out


def innermost_loop(code: list[tuple[int, str]], must_hold) -> list[str]:
    """The instructions of the shortest loop (a branch back to a lower address)
    whose body holds every string in must_hold, in address order."""
    best = None
    for address, ins in code:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", ins)
        if not m or int(m.group(1), 16) >= address:
            continue
        body = [i for a, i in code if int(m.group(1), 16) <= a <= address]
        if all(any(s in i for i in body) for s in must_hold) and (best is None or len(body) < len(best)):
            best = body
    assert best is not None, f"no loop holds {must_hold}"
    return best
