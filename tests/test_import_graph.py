"""No import circles among flashjit's modules.

The rule: module A imports module B when any import statement in A's source
names B, wherever the statement sits: at module level, or inside a function or
class body (a deferred import hides a circle from the interpreter, not from a
reader, who still has to know both modules to change either). Statements under
`if TYPE_CHECKING:` never run and do not count. `from P import name` imports
P.name where that is a module, else P; importing P.Q also runs P's __init__,
except where P is a package that holds A (it is imported before A). The
modules of flashjit/ and what they import must form a graph without cycles.

torch.library registration (flashjit.ops._library) is the top layer of
flashjit.ops: it imports the op modules and only the package's __init__
imports it; the ops ask ops._dispatch whether a call is traced.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(root: Path, package: str = "flashjit") -> dict[str, tuple[Path, bool]]:
    """Every module of the package under root: dotted name -> (file, is a package)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _statements(tree: ast.Module):
    """Every import statement that can run, TYPE_CHECKING blocks left out."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports(root: Path, package: str = "flashjit") -> dict[str, set[str]]:
    """module -> the package's modules it imports, by the rule of this file's docstring."""
    found = modules(root, package)
    graph = {name: set() for name in found}
    for name, (path, is_package) in found.items():
        holders = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in _statements(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    prefix = here[:len(here) - node.level + 1]
                    base = ".".join(prefix + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in found else base for a in node.names]
            for target in targets:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    step = ".".join(parts[:i])
                    if step in found and step not in holders:
                        graph[name].add(step)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each
    as one circle through its modules, sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def test_flashjit_modules_import_without_circles():
    graph = imports(ROOT)
    assert "flashjit.ops.prefill" in graph["flashjit.ops._library"]  # the graph sees imports at all
    found = cycles(graph)
    assert not found, "import circles (each a set of modules that import each other): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_only_the_ops_package_imports_the_torch_library_layer():
    importers = sorted(m for m, targets in imports(ROOT).items() if "flashjit.ops._library" in targets)
    assert importers == ["flashjit.ops"]


def test_a_function_level_import_closes_a_circle(tmp_path):
    """The rule's own check: a deferred import counts, a TYPE_CHECKING one and the
    import of a package that holds the module do not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
                              "def later():\n    from .a import name\n")
    (pkg / "c.py").write_text("from . import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("import pkg.sub\nfrom .. import c\n")
    graph = imports(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.sub.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
