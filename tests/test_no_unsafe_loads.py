"""No code path deserialises untrusted bytes into code: a scan of every Python file in the repository for
pickle-family modules, ``torch.load``, ``np.load(allow_pickle=True)``, ``yaml.load`` and ``eval``/``exec``.
Each legitimate use is allow-listed with its reason; an allow-list entry that no longer matches fails too."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", ".git", "runs", "build", "dist", "node_modules", "__pycache__", ".pytest_cache"}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
ALWAYS_UNSAFE = {"pickle.load", "pickle.loads", "pickle.Unpickler", "marshal.load", "marshal.loads", "shelve.open",
                 "joblib.load", "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads",
                 "pandas.read_pickle", "pd.read_pickle", "torch.jit.load", "eval", "exec", "yaml.unsafe_load"}

# (file, finding) -> why it is safe
ALLOWED = {
    ("fl_server/data/datasets.py", "import pickle"):
        "CIFAR-10's python batches are pickles; read only through RestrictedUnpickler",
    ("fl_server/data/datasets.py", "class RestrictedUnpickler(pickle.Unpickler)"):
        "RestrictedUnpickler: find_class resolves a fixed set of numpy constructors, refuses everything else "
        "(tests/test_datasets.py::test_cifar10_malicious_pickle_is_refused)",
    ("tests/test_datasets.py", "import pickle"):
        "the test writes CIFAR-format and malicious pickles (pickle.dumps only) to check the restricted reader",
    ("fl_server/export/graphs.py", "exec"):
        "a fixed template that defines forward(self, <input names>) for the traced graph; names come from our "
        "own StepSpec, never from a file",
}


def _name(node: ast.AST) -> str:
    """Dotted name of a call target: np.load, torch.load, pickle.Unpickler, eval."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return ""


def _const_kw(call: ast.Call, name: str) -> object:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else "<expr>"
    return None


def findings(source: str) -> list[tuple[int, str]]:
    """(line, finding) for every unsafe construct in ``source``."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            out.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.ClassDef):
            out += [(node.lineno, f"class {node.name}({_name(b)})") for b in node.bases if _name(b).endswith("Unpickler")]
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            if name in ALWAYS_UNSAFE or (name.endswith(".Unpickler") and name.split(".")[0] in PICKLE_MODULES):
                out.append((node.lineno, name))
            elif name == "torch.load" and _const_kw(node, "weights_only") is not True:
                out.append((node.lineno, "torch.load without weights_only=True"))
            elif name in ("np.load", "numpy.load") and _const_kw(node, "allow_pickle") not in (None, False):
                out.append((node.lineno, f"{name}(allow_pickle={_const_kw(node, 'allow_pickle')})"))
            elif name == "yaml.load" and "SafeLoader" not in ast.unparse(node):
                out.append((node.lineno, "yaml.load without SafeLoader"))
    return out


def python_files() -> list[Path]:
    return sorted(p for p in REPO.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(REPO).parts))


def test_scanner_catches_what_it_should() -> None:
    bad = """
import pickle, dill
from joblib import load
class U(pickle.Unpickler): pass
import numpy as np, torch, yaml
pickle.loads(b"")
torch.load("x.pt")
torch.load("x.pt", weights_only=False)
np.load("a.npy", allow_pickle=True)
yaml.load(open("c"))
eval("1")
"""
    got = {f for _, f in findings(bad)}
    assert got == {"import pickle", "import dill", "from joblib import", "class U(pickle.Unpickler)", "pickle.loads",
                   "torch.load without weights_only=True", "np.load(allow_pickle=True)", "yaml.load without SafeLoader",
                   "eval"}, got
    good = """
import numpy as np, torch, yaml
np.load("a.npz", allow_pickle=False)
np.load("a.npz")
torch.load("ckpt.pt", weights_only=True)
yaml.load(open("c"), Loader=yaml.SafeLoader)
"""
    assert findings(good) == []


def test_no_unsafe_deserialisation_in_the_repository() -> None:
    files = python_files()
    assert len(files) > 50 and any(p.name == "_client.py" for p in files)
    seen, unexpected = set(), []
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        for line, finding in findings(path.read_text()):
            if (rel, finding) in ALLOWED:
                seen.add((rel, finding))
            else:
                unexpected.append(f"{rel}:{line}: {finding}")
    assert not unexpected, "unsafe deserialisation (allow-list it in this file with a reason if it is safe):\n" + \
        "\n".join(unexpected)
    assert seen == set(ALLOWED), f"stale allow-list entries: {set(ALLOWED) - seen}"
