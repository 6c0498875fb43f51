"""The import graph of the two distributions, fl_server/ (fl_server/export/ included) and edge_sdk/edge_sdk/.

- The product and its tests never import the results lab (lab/, outside the package and its wheel); only
  ``fl-server bench|report`` hands over to it (fl_server.cli.run_lab).
- No import circle among the modules of either package: every ``import`` and ``from ... import`` counts, at module
  level and inside functions; only ``if TYPE_CHECKING:`` blocks (never run) are left out. An import names the
  deepest module it reaches (``from a import b`` is module ``a.b`` when that file exists, else ``a``); a package's
  ``__init__`` is its own module, and importing a submodule is no edge to its parent package.
- No private name crosses a module boundary: no module imports ``_name`` (a function, class or constant) from
  another module, and no module imports a private module ``pkg._mod`` (``import pkg._mod``, ``from pkg._mod import
  x``, ``from pkg import _mod``) unless it lies inside ``pkg``: edge_sdk's implementation modules are private by
  design and import each other, fl_server imports the SDK only through its public names (``edge_sdk``,
  ``edge_sdk.shared``). Third-party modules are not checked.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_MODULES = ("fl_server.cli", "fl_server.service.app", "fl_server.service.worker", "fl_server.service.hypernet",
                   "fl_server.recipes", "fl_server.recipes.presets", "fl_server.rundir", "fl_server.export.run", "fl_server.export.btfl",
                   "fl_server.flower.task")
NO_LAB = ("fl_server", "examples", "tests")
PACKAGES = {"fl_server": REPO / "fl_server", "edge_sdk": REPO / "edge_sdk" / "edge_sdk"}  # the lab's own tests are lab/tests


def _imports(tree: ast.AST) -> set[str]:
    """Every module an AST imports, at any depth (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _is_lab(module: str) -> bool:
    return module == "lab" or module.startswith("lab.")


def test_product_modules_load_without_the_lab() -> None:
    code = (f"import sys\nfor m in {PRODUCT_MODULES!r}:\n    __import__(m)\n"
            "print(sorted(m for m in sys.modules if m == 'lab' or m.startswith('lab.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_product_or_product_test_file_imports_the_lab() -> None:
    offenders = []
    for p in (f for entry in NO_LAB for f in sorted((REPO / entry).rglob("*.py"))):
        tree = ast.parse(p.read_text())
        if p == REPO / "fl_server" / "cli.py":  # run_lab, the hand-over of `fl-server bench|report`, may
            tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "run_lab")]
        offenders += [f"{p.relative_to(REPO)}: {m}" for m in sorted(_imports(tree)) if _is_lab(m)]
    assert offenders == []


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of both packages."""
    out = {}
    for root in PACKAGES.values():
        for p in sorted(root.rglob("*.py")):
            parts = p.relative_to(root.parent).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module at any depth, but those under ``if TYPE_CHECKING:``."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(module imported from, name imported or None) for each alias; relative imports resolved."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [(base, a.name) for a in node.names]


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """(module -> the package modules it imports, cross-module private imports)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            for source, name in _targets(module, path, node):
                full = f"{source}.{name}" if name and f"{source}.{name}" in modules else source
                if full in modules and full != module:
                    edges[module].add(full)
                private += _private(module, source, name, full)
    return edges, private


def _private(module: str, source: str, name: str | None, full: str) -> list[str]:
    """The docstring's private rule for one imported name (``full``: the module it reaches)."""
    if full.split(".")[0] not in PACKAGES:
        return []
    out = []
    parts = full.split(".")
    owners = [".".join(parts[:i]) for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")]
    if owners and not module.startswith(owners[-1] + "."):  # owners[-1]: the package of the innermost private module
        out.append(f"{module}: imports private module {full}")
    if name and name.startswith("_") and not name.startswith("__") and full == source:
        out.append(f"{module}: from {source} import {name}")
    return out


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checks_see_a_circle_and_a_private_import() -> None:
    """The two checks below can fail: a planted circle and a planted private import are found."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from edge_sdk._bundle import MANIFEST\nfrom fl_server.export.steps import _hidden\n"
                     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from edge_sdk._device import Device\n")
    path = REPO / "fl_server" / "signing.py"
    found = [t for node in _runtime_imports(tree) for t in _targets("fl_server.signing", path, node)]
    assert ("edge_sdk._bundle", "MANIFEST") in found and ("fl_server.export.steps", "_hidden") in found
    assert ("edge_sdk._device", "Device") not in found  # typing-only imports never run
    assert _private("fl_server.signing", "edge_sdk._bundle", "MANIFEST", "edge_sdk._bundle")
    assert _private("fl_server.export.btfl", "fl_server.export.steps", "_hidden", "fl_server.export.steps")
    assert _private("edge_sdk._btfl.stream", "edge_sdk._btfl.dle", "_codes", "edge_sdk._btfl.dle")
    assert not _private("edge_sdk._device", "edge_sdk._bundle", "Bundle", "edge_sdk._bundle")  # inside its package
    assert not _private("fl_server.functional", "torch.utils", "_pytree", "torch.utils")  # third-party


def test_no_import_circle_in_either_package() -> None:
    edges, _ = _graph()
    assert {"fl_server.export.fedicon", "fl_server.export.steps", "edge_sdk._device"} <= set(edges)  # it sees them
    assert _circles(edges) == []


def test_no_private_name_or_private_module_crosses_a_module_boundary() -> None:
    assert _graph()[1] == []
