"""The product path (service, the CLI's train/serve/export, export/, recipes, the Flower app) never imports the
research harness (fl_server.bench), the harness's own modules import one another without a circle, and every
experiment builds its engine runs through the recipe layer (fl_server.recipes), never by constructing the engine
itself."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT_MODULES = ("fl_server.cli", "fl_server.service.app", "fl_server.service.worker", "fl_server.service.hypernet",
                   "fl_server.recipes", "fl_server.recipes.presets", "fl_server.rundir", "export.run", "export.btfl",
                   "fl_server.flower.task")
PRODUCT_FILES = ("fl_server/service", "fl_server/recipes", "export", "fl_server/rundir.py", "fl_server/engine",
                 "fl_server/algorithms", "fl_server/models", "fl_server/data", "fl_server/flower")
CLI_PRODUCT_COMMANDS = ("train_recipe", "cmd_train", "cmd_serve", "cmd_export", "cmd_data")


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


def _files(entry: str) -> list[Path]:
    path = REPO / entry
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_product_modules_load_without_the_bench() -> None:
    code = (f"import sys\nfor m in {PRODUCT_MODULES!r}:\n    __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('fl_server.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_product_file_imports_the_bench_anywhere() -> None:
    offenders = [f"{p.relative_to(REPO)}: {m}" for entry in PRODUCT_FILES for p in _files(entry)
                 for m in _imports(ast.parse(p.read_text())) if m.startswith("fl_server.bench")]
    cli = ast.parse((REPO / "fl_server/cli.py").read_text())
    for fn in (n for n in cli.body if isinstance(n, ast.FunctionDef) and n.name in CLI_PRODUCT_COMMANDS):
        offenders += [f"cli.py:{fn.name}: {m}" for m in _imports(fn) if m.startswith("fl_server.bench")]
    assert offenders == []


def test_the_bench_has_no_import_circle() -> None:
    modules = {p.stem: p for p in (REPO / "fl_server/bench").glob("*.py") if p.stem != "__init__"}
    edges = {name: {m.split(".")[2] for m in _imports(ast.parse(p.read_text()))
                    if m.startswith("fl_server.bench.") and m.split(".")[2] in modules and m.split(".")[2] != name}
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


def test_the_bench_builds_every_run_through_recipes() -> None:
    engine = {"Simulation", "RunConfig", "build_model"}  # what building a run outside the recipe layer calls
    offenders = [f"{p.relative_to(REPO)}: {sorted(_calls(ast.parse(p.read_text())) & engine)}"
                 for p in _files("fl_server/bench") if _calls(ast.parse(p.read_text())) & engine]
    assert offenders == []
    for module, builder in OWN_RUNNERS.items():
        tree = ast.parse((REPO / "fl_server/bench" / f"{module}.py").read_text())
        assert builder in _calls(tree), f"{module} builds no run through {builder}"
        assert f"fl_server.bench.runner.{builder}" in _imports(tree), module
    runner = ast.parse((REPO / "fl_server/bench/runner.py").read_text())
    assert "fl_server.recipes.run.simulation" in _imports(runner) and "simulation" in _calls(runner)
