"""The lab's modules import one another without a circle, and every experiment builds its engine runs through
the recipe layer (fl_server.recipes), never by constructing the engine itself."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_graph import _imports

REPO = Path(__file__).resolve().parents[2]
LAB = REPO / "lab"


def test_the_lab_has_no_import_circle() -> None:
    modules = {p.stem: p for p in LAB.glob("*.py") if p.stem not in ("__init__", "__main__")}
    edges = {name: {m.split(".")[1] for m in _imports(ast.parse(p.read_text()))
                    if m.startswith("lab.") and m.split(".")[1] in modules and m.split(".")[1] != name}
             for name, p in modules.items()}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import circle: {' -> '.join([*path[path.index(node):], node])}"
        if node in done:
            return
        for nxt in sorted(edges[node]):
            visit(nxt, [*path, node])
        done.add(node)

    for name in sorted(modules):
        visit(name, [])


def _calls(tree: ast.AST) -> set[str]:
    """The names every call in ``tree`` calls (``Simulation(...)`` and ``engine.Simulation(...)`` alike)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


# the experiments with their own procedure: each builds its runs through the recipe layer (runner.own_simulation
# or runner.build_simulation over fl_server.recipes.run.simulation)
OWN_RUNNERS = {"shift": "own_simulation", "map_incomplete": "own_simulation", "hetero": "own_simulation",
               "odpfl": "own_simulation", "btgfl": "own_simulation", "data_size": "build_simulation",
               "unseen": "build_simulation"}


def test_the_lab_builds_every_run_through_recipes() -> None:
    engine = {"Simulation", "RunConfig", "build_model"}  # what building a run outside the recipe layer calls
    offenders = [f"{p.relative_to(REPO)}: {sorted(_calls(ast.parse(p.read_text())) & engine)}"
                 for p in sorted(LAB.glob("*.py")) if _calls(ast.parse(p.read_text())) & engine]
    assert offenders == []
    for module, builder in OWN_RUNNERS.items():
        tree = ast.parse((LAB / f"{module}.py").read_text())
        assert builder in _calls(tree), f"{module} builds no run through {builder}"
        assert f"lab.runner.{builder}" in _imports(tree), module
    runner = ast.parse((LAB / "runner.py").read_text())
    assert "fl_server.recipes.run.simulation" in _imports(runner) and "simulation" in _calls(runner)
