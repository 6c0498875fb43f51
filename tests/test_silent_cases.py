"""docs/silent-cases.md cannot drift from the code: every test it names exists (its file defines that function),
and every line it quotes (``fails: `...```, ``warns: `...```) is one the package can print: it matches a string
template of fl_server/, fl_server/export/ or edge_sdk/'s package, whose f-string fields (resolved through the module's and
the function's own string constants) stand for any value. Pure parsing: nothing is trained or run."""
from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "silent-cases.md"
PACKAGES = [ROOT / "fl_server", ROOT / "edge_sdk" / "edge_sdk"]
QUOTED = re.compile(r"\b(?:fails|warns)\b[^`]*?: `([^`]+)`")
TEST_REF = re.compile(r"`((?:tests|edge_sdk/tests)/[\w/]+\.py)::(\w+)`")
ANY = "(?s:.+?)"  # a field the code fills in


def rows() -> list[list[str]]:
    """The table's rows as [what a user did, what happens now, held by] cells."""
    lines = [line for line in DOC.read_text().splitlines() if line.startswith("|")]
    assert lines[0].startswith("| what a user did") and set(lines[1]) <= {"|", "-"}, lines[:2]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]


class Templates:
    """Every string expression of the packages as (a regex that fullmatches what it can print, its literal
    characters): constants and f-strings, with a field that names a string constant (of its function, its
    module or any module of the packages) replaced by that constant's template, and an ``a if c else b`` of
    strings by both."""

    def __init__(self) -> None:
        trees = [ast.parse(f.read_text()) for p in PACKAGES for f in sorted(p.rglob("*.py"))]
        self.shared = self._constants(tree.body for tree in trees)  # module constants (NONFINITE_FIX, ...)
        self.found: list[tuple[str, int]] = []
        for tree in trees:
            module = {**self.shared, **self._constants([tree.body])}
            for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
                env = module if scope is tree else {**module, **self._constants([list(ast.walk(scope))])}
                for node in ast.walk(scope):
                    if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                        self.found.append(self._render(node, env, frozenset()))

    @staticmethod
    def _constants(bodies: Iterable[Iterable[ast.AST]]) -> dict[str, list[ast.expr]]:
        """``NAME = <string expression>`` assignments of ``bodies``: name -> every value it is given."""
        out: dict[str, list[ast.expr]] = {}
        for body in bodies:
            for node in body:
                if isinstance(node, ast.Assign) and isinstance(node.value, (ast.JoinedStr, ast.Constant, ast.IfExp)):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            out.setdefault(target.id, []).append(node.value)
        return out

    def _render(self, node: ast.expr, env: dict[str, list[ast.expr]], seen: frozenset[str]) -> tuple[str, int]:
        if isinstance(node, ast.Constant):
            return (re.escape(node.value), len(node.value)) if isinstance(node.value, str) else (ANY, 0)
        if isinstance(node, ast.JoinedStr):
            parts = [self._render(v, env, seen) for v in node.values]
            return "".join(p for p, _ in parts), sum(n for _, n in parts)
        if isinstance(node, ast.FormattedValue) and node.format_spec is None and isinstance(node.value, ast.Name) \
                and node.value.id in env and node.value.id not in seen:
            return self._either(env[node.value.id], env, seen | {node.value.id})
        if isinstance(node, ast.FormattedValue) and isinstance(node.value, ast.IfExp):
            return self._either([node.value.body, node.value.orelse], env, seen)
        if isinstance(node, ast.IfExp):
            return self._either([node.body, node.orelse], env, seen)
        return ANY, 0

    def _either(self, nodes: list[ast.expr], env: dict[str, list[ast.expr]], seen: frozenset[str]) -> tuple[str, int]:
        parts = [self._render(n, env, seen) for n in nodes]
        return "(?:" + "|".join(p for p, _ in parts) + ")", min(n for _, n in parts)

    def prints(self, line: str) -> bool:
        """Whether a template of the packages prints ``line``, its literal text at least half of the line (so
        that a bare ``f"error: {exc}"`` does not count)."""
        return any(2 * literal >= len(line) and re.fullmatch(pattern, line)
                   for pattern, literal in self.found if literal)


@functools.lru_cache(maxsize=None)
def templates() -> Templates:
    return Templates()


def test_every_row_names_existing_tests_and_quotes_lines_the_code_prints() -> None:
    table = rows()
    assert len(table) >= 16 and all(len(row) == 3 for row in table), [r for r in table if len(r) != 3]
    quoted = 0
    for did, now, held in table:
        refs = TEST_REF.findall(held)
        assert refs and len(refs) == held.count("::"), f"{did}: no test named as `tests/FILE.py::test_name`"
        for file, name in refs:
            tree = ast.parse((ROOT / file).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert name in names, f"{did}: {file} defines no {name}"
        lines = QUOTED.findall(now)
        assert lines or "fails" not in now and "warns" not in now, f"{did}: a fails/warns without a quoted line"
        for line in lines:
            assert templates().prints(line), f"{did}: no string of the package prints {line!r}"
            quoted += 1
    assert quoted >= 11


def test_the_check_can_fail() -> None:
    """A line the code does not print, a message with a changed word, and a bare field are all refused."""
    t = templates()
    assert t.prints("warning: new-client accuracy 9.5% is at chance (10.0% for 10 classes): the model learnt "
                    "(almost) nothing; train longer, lower the learning rate or check the labels before shipping "
                    "this bundle")
    assert not t.prints("warning: new-client accuracy 9.5% is at chance (10.0% for 10 classes): the model learnt "
                        "nothing at all; train longer")
    assert not t.prints("error: anything at all goes here")
    assert not t.prints("the model is fine")
