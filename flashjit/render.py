"""Renders a configuration's CUDA source from the Jinja templates.

One `jinja2.Environment` (StrictUndefined: a missing variable is an error, not
an empty string) over the templates directory, created on first use so that
`import flashjit` renders nothing. `render()` is pure: it writes no file; the
build writes the source inside the configuration's lock.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .kernels import template_for
from .spec import KernelSpec

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def templates_dir() -> Path:
    """templates/ inside an installed wheel, or beside the package in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / "include").is_dir():
            return candidate
    raise FileNotFoundError(f"flashjit templates not found next to {here}; the installation is incomplete")


@functools.lru_cache(maxsize=1)
def environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["cbool"] = lambda value: "true" if value else "false"
    return env


@dataclass(frozen=True)
class RenderedSource:
    spec: KernelSpec
    filename: str                  # e.g. single_prefill_bf16_d128_fa2_cc.cu
    text: str
    headers: dict[str, bytes]      # path relative to include/ -> content, transitively included

    def digest_inputs(self) -> dict:
        """Content hashes that enter the cache key."""
        return {
            "source_sha256": hashlib.sha256(self.text.encode()).hexdigest(),
            "headers_sha256": {path: hashlib.sha256(data).hexdigest()
                               for path, data in sorted(self.headers.items())},
        }


@functools.lru_cache(maxsize=64)
def generator_digest(template_name: str) -> str:
    """Hash of everything besides the spec that decides what `render` produces
    for one template: its text, the headers it includes (found from the raw
    text: includes are never templated), and the Python that picks templates,
    tilings and compiler flags. Lets a cached configuration be found without
    importing jinja2 or rendering; editing an unrelated template leaves it alone."""
    root = templates_dir()
    text = (root / template_name).read_text()
    h = hashlib.sha256(text.encode())
    for rel, data in sorted(_included_headers(text, root / "include").items()):
        h.update(rel.encode())
        h.update(data)
    here = Path(__file__).resolve().parent
    modules = sorted((here / "kernels").glob("*.py")) + [here / m for m in ("render.py", "spec.py", "arch.py", "build.py")]
    for module in modules:
        h.update(module.read_bytes())
    return h.hexdigest()


def _included_headers(text: str, include_root: Path) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    pending = [(None, name) for name in _INCLUDE_RE.findall(text)]
    while pending:
        parent, name = pending.pop()
        # Quoted includes resolve beside the including header first, then on -Iinclude.
        candidates = [parent / name] if parent is not None else []
        candidates.append(Path(name))
        for rel in candidates:
            path = include_root / rel
            if path.is_file():
                key = str((include_root / rel).resolve().relative_to(include_root.resolve()))
                if key not in found:
                    found[key] = path.read_bytes()
                    pending.extend((Path(key).parent, n) for n in _INCLUDE_RE.findall(found[key].decode()))
                break
        else:
            raise FileNotFoundError(f"header {name!r} included by the templates is missing from {include_root}")
    return found


def render(spec: KernelSpec, arches=None) -> RenderedSource:
    """Source text and included headers of a validated spec, for a build that
    targets `arches` (None: unknown; some tilings need every target to fit them).
    Raises ValueError for a spec with no template and jinja2.UndefinedError for
    a template bug."""
    template_name, context = template_for(spec, arches)
    text = environment().get_template(template_name).render(**context)
    headers = _included_headers(text, templates_dir() / "include")
    return RenderedSource(spec=spec, filename=f"{spec.name}.cu", text=text, headers=headers)
