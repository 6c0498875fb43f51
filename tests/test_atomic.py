"""Atomic writes: one helper a distribution (``fl_server/atomic.py`` on top of the SDK's ``edge_sdk/_atomic.py``),
and no other module of either package renames a file by hand."""
from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from fl_server.atomic import (atomic_link, atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_npz,
                              atomic_write_text)

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (REPO / "fl_server", REPO / "edge_sdk" / "edge_sdk")
HELPERS = {REPO / "fl_server" / "atomic.py", REPO / "edge_sdk" / "edge_sdk" / "_atomic.py"}


def _renames(source: str) -> list[str]:
    """The renames spelled in ``source``: ``os.replace``/``os.rename``/``shutil.move``, any ``.rename(...)``, and a
    ``.replace(target)`` with one argument (``Path.replace``; ``str.replace`` takes two, ``dataclasses.replace``
    keywords), or one of them imported by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil"):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name in ("replace", "rename", "move")]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        attr = node.func.attr
        if (attr == "rename" or (owner, attr) in (("os", "replace"), ("shutil", "move"))
                or (attr == "replace" and len(node.args) == 1 and not node.keywords)):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def test_the_scan_sees_each_way_to_rename() -> None:
    planted = ("import os, shutil\nfrom os import rename\nos.replace(a, b)\nos.rename(a, b)\ntmp.replace(path)\n"
               "tmp.rename(path)\nshutil.move(a, b)\n")
    assert len(_renames(planted)) == 6
    assert _renames("s.replace('-', '_')\ndataclasses.replace(r, rounds=2)\nrecipe.replace(**changes)\n") == []


def test_only_the_helpers_rename_files() -> None:
    offenders = [f"{p.relative_to(REPO)}: {r}" for root in PACKAGES for p in sorted(root.rglob("*.py"))
                 if p not in HELPERS for r in _renames(p.read_text())]
    assert offenders == [], "write through fl_server.atomic (the SDK: edge_sdk._atomic) instead"


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    target.write_text("old")
    atomic_write_json(target, {"a": 1})
    assert target.read_text() == '{"a": 1}'
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:  # a writer that fails half-way
        tmp.write_text('{"a": 2')
        raise RuntimeError("disk full")
    assert target.read_text() == '{"a": 1}' and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    atomic_write_npz(tmp_path / "a.npz", {"x": np.arange(3)})  # np.savez adds no second ".npz"
    with np.load(tmp_path / "a.npz") as arrays:
        assert arrays["x"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "f.json"]


def test_a_secret_is_private_and_other_files_follow_the_umask(tmp_path: Path) -> None:
    atomic_write_text(tmp_path / "key", "secret", mode=0o600, fsync=True)
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o600
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "plain", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o644


def test_a_link_is_the_same_file_and_replaces_the_old_one(tmp_path: Path) -> None:
    src, dst = tmp_path / "best.npz", tmp_path / "best.ckpt.npz"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    atomic_link(src, dst)
    atomic_link(src, dst)  # already the same file: nothing to do, nothing left behind
    assert os.path.samefile(src, dst) and dst.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt.npz", "best.npz"]
