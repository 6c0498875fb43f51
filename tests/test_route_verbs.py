"""The HTTP layer asks the coordinator's Service for what it needs (``svc.jobs()``, ``svc.add_client(...)``, ...);
no module of fl_server/service that speaks HTTP (imports fastapi or starlette: the routers, their dependencies,
the app) reaches into the Service's stores: its database (``store``), its content-addressed objects
(``artifacts``), the job runner that writes jobs into the database (``runner``) and the DLE uploads (``dles``). The Service owns their use:
limits, enrollment mode, what revoking a client also removes, checking an object before it is streamed."""
from __future__ import annotations

import ast
from pathlib import Path

SERVICE = Path(__file__).resolve().parents[1] / "fl_server" / "service"
STORES = {"store", "artifacts", "runner", "dles"}  # the Service's attributes an HTTP module never reaches into


def _speaks_http(tree: ast.AST) -> bool:
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return bool(roots & {"fastapi", "starlette"})


def _store_uses(tree: ast.AST) -> list[str]:
    return [f"line {n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in STORES]


def test_the_scan_sees_a_route_that_reaches_into_the_store() -> None:
    planted = ast.parse("from fastapi import APIRouter\ndef f(svc):\n    return svc.store.jobs()\n"
                        "def g(svc, sha):\n    return svc.artifacts.path(sha), svc.runner.cancel(sha)\n")
    assert _speaks_http(planted)
    assert _store_uses(planted) == ["line 3: svc.store", "line 5: svc.artifacts", "line 5: svc.runner"]
    assert _store_uses(ast.parse("svc.job_outcome(job)\nb['manifest']['artifacts']\n")) == []
    assert not _speaks_http(ast.parse("from fl_server.service.store import Store\n"))


def test_no_route_module_touches_the_store() -> None:
    http = {p.name: ast.parse(p.read_text()) for p in sorted(SERVICE.glob("*.py"))}
    http = {name: tree for name, tree in http.items() if _speaks_http(tree)}
    assert {"routes.py", "dashboard.py", "auth.py", "publish_api.py", "app.py"} <= set(http)  # it sees them
    offenders = {name: uses for name, tree in http.items() if (uses := _store_uses(tree))}
    assert offenders == {}, "call a verb of fl_server.service.state.Service instead (add one if none fits)"
