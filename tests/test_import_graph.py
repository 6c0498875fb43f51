"""The product (fl_server/, export/, the examples) and its tests never import the results lab (lab/, outside
the package and its wheel); only ``fl-server bench|report`` hands over to it (fl_server.cli.run_lab)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_MODULES = ("fl_server.cli", "fl_server.service.app", "fl_server.service.worker", "fl_server.service.hypernet",
                   "fl_server.recipes", "fl_server.recipes.presets", "fl_server.rundir", "export.run", "export.btfl",
                   "fl_server.flower.task")
NO_LAB = ("fl_server", "export", "examples", "tests")  # the lab's own tests are lab/tests


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
