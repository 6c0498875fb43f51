"""Atomic file writes: the bytes go to a temporary sibling ``.<name>.tmp-<pid>-<random>``, which one rename puts
over the target (atomic on one filesystem), so a reader sees the old file or the new one, never a part of one.
The only module of either package that renames files (tests/test_import_graph.py checks it); the coordinator
reaches it through ``edge_sdk.shared`` and ``fl_server.atomic``."""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move(src: str | os.PathLike, dst: str | os.PathLike, fsync: bool = False) -> None:
    """Put the finished file or directory ``src`` at ``dst`` in one rename, replacing what was there (a directory
    only if empty); ``fsync``: flush ``dst``'s directory too, so the rename survives a power cut."""
    os.replace(src, dst)
    if fsync:
        _fsync(Path(dst).parent)


@contextmanager
def atomic_path(path: str | os.PathLike, mode: int = 0o666, fsync: bool = False) -> Iterator[Path]:
    """A fresh temporary sibling of ``path`` (created empty with ``mode``, less the umask) for the caller to write
    by name; on a clean exit it replaces ``path``, on an exception it is removed. ``fsync``: flush the file before
    the rename and the directory after it. Example: ``with atomic_path(p) as tmp: onnx.save(model, str(tmp))``"""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
    try:
        yield tmp
        if fsync:
            _fsync(tmp)
        move(tmp, path, fsync=fsync)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o666, fsync: bool = False) -> None:
    """``path`` holds ``data``, replaced atomically (``mode`` and ``fsync`` as :func:`atomic_path`'s; 0o600 for a
    secret)."""
    with atomic_path(path, mode, fsync) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = 0o666, fsync: bool = False) -> None:
    """``path`` holds ``text`` (UTF-8), replaced atomically; see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode(), mode, fsync)


def atomic_link(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``dst`` becomes the file ``src``: a hard link (the same file, no copy), else a copy where links fail;
    any old ``dst`` is replaced atomically."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and os.path.samefile(src, dst):
        return  # (renaming a link onto another link of the same file would do nothing and leave tmp behind)
    with atomic_path(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            tmp.write_bytes(src.read_bytes())
