"""edge_sdk numerics match torch; importing edge_sdk never imports torch."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from edge_sdk import entropy, log_softmax, softmax
from fl_server.algorithms.losses import entropy_from_logits


def test_entropy_matches_torch() -> None:
    logits = np.random.default_rng(0).normal(scale=5.0, size=(64, 10))
    np.testing.assert_allclose(entropy(logits), entropy_from_logits(torch.from_numpy(logits)).numpy(), atol=1e-12)
    np.testing.assert_allclose(softmax(logits).sum(-1), 1.0, atol=1e-12)
    assert np.isfinite(log_softmax(np.array([[1e4, 0.0]]))).all()
    assert abs(entropy(np.zeros((1, 10)))[0] - np.log(10)) < 1e-12


def test_import_edge_sdk_without_torch() -> None:
    code = "import sys, edge_sdk; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_sdk_dispatch_names_no_registered_method() -> None:
    """Device and the runner registry choose from the manifest's device_step: no name of a registered method
    (fl_server.algorithms.ALGORITHMS) is a string in their code (docstrings aside); the SDK's own list of
    method names (edge_sdk/tests/test_public_face.py) covers the registry."""
    import ast
    from pathlib import Path

    import edge_sdk
    from fl_server.algorithms import ALGORITHMS

    package = Path(edge_sdk.__file__).parent
    face = ast.parse((package.parent / "tests" / "test_public_face.py").read_text())
    sdk_list = next(ast.literal_eval(n.value) for n in face.body
                    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "METHODS")
    assert set(ALGORITHMS) - {"FedICON w/o TTA"} <= set(sdk_list)  # multi-word names: their words are listed
    for path in (package / "_device.py", package / "_registry.py"):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        words = {w for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and id(n) not in docs for w in n.value.replace("'", " ").split()}
        assert not words & set(ALGORITHMS), (path.name, words & set(ALGORITHMS))
