"""Reader for the IDX file format used by MNIST and Fashion-MNIST.

An IDX file is a big-endian header followed by raw ``uint8`` data::

    bytes 0-1  zero
    byte  2    data type (0x08 = unsigned byte, the only type accepted here)
    byte  3    number of dimensions (1 for labels, 3 for images)
    then one big-endian uint32 per dimension, then prod(dims) bytes of data.

So the magic number (bytes 0-3 as a big-endian int) is ``0x00000803`` for
image files ``[N, rows, cols]`` and ``0x00000801`` for label files ``[N]``.
Files may be plain or gzip-compressed (detected from the content, not the
name). Every problem is reported as :class:`DataFileError`.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .errors import DataFileError

__all__ = ["IDX_IMAGES_MAGIC", "IDX_LABELS_MAGIC", "read_idx", "read_idx_pair"]

IDX_IMAGES_MAGIC = 0x00000803
IDX_LABELS_MAGIC = 0x00000801
_NDIM_BY_MAGIC = {IDX_LABELS_MAGIC: 1, IDX_IMAGES_MAGIC: 3}
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20
_MAX_PAYLOAD = 1 << 30  # refuse absurd headers (over 1 GiB of pixels; MNIST's train images are 47 MB)


def _open(path: Path, hint: str | None) -> BinaryIO:
    """Open ``path`` for binary reading, transparently un-gzipping it."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 - returned to the caller
    except FileNotFoundError:
        raise DataFileError(path, "not found", hint) from None
    except OSError as exc:
        raise DataFileError(path, f"cannot be opened ({exc.strerror or exc})", hint) from None
    if raw.read(2) == _GZIP_MAGIC:
        raw.seek(0)
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    raw.seek(0)
    return raw


def _read_exact(f: BinaryIO, n: int) -> bytearray:
    """Read up to ``n`` bytes (fewer only at end of file), in bounded chunks: memory grows with what the file
    holds, not with what its header claims."""
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(min(_CHUNK, n - len(buf)))
        if not chunk:
            break
        buf += chunk
    return buf


def _parse_header(f: BinaryIO, path: Path, hint: str | None) -> tuple[int, ...]:
    """Read and validate the magic number and dimensions; return the dims."""
    head = _read_exact(f, 4)
    if len(head) < 4:
        raise DataFileError(path, f"too short for an IDX header ({len(head)} bytes)", hint)
    (magic,) = struct.unpack(">I", head)
    if magic not in _NDIM_BY_MAGIC:
        raise DataFileError(
            path,
            f"bad IDX magic number 0x{magic:08x} (expected 0x{IDX_IMAGES_MAGIC:08x} for images "
            f"or 0x{IDX_LABELS_MAGIC:08x} for labels); not an IDX file or corrupt",
            hint,
        )
    ndim = _NDIM_BY_MAGIC[magic]
    raw_dims = _read_exact(f, 4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise DataFileError(path, "truncated IDX header (dimension sizes missing)", hint)
    dims = struct.unpack(f">{ndim}I", raw_dims)
    if any(d == 0 for d in dims):
        raise DataFileError(path, f"IDX header has a zero dimension {dims}", hint)
    return dims


def read_idx(path: str | os.PathLike[str], *, hint: str | None = None) -> np.ndarray:
    """Read one IDX ``uint8`` file (plain or ``.gz``).

    Args:
        path: the file.
        hint: how-to-get-the-data text appended to error messages.

    Returns:
        ``uint8`` array of shape ``[N]`` (labels, magic 0x801) or
        ``[N, rows, cols]`` (images, magic 0x803).

    Raises:
        DataFileError: missing file, bad magic, bad header, payload shorter or
            longer than the header promises, or corrupt/truncated gzip data.
    """
    p = Path(path)
    f = _open(p, hint)
    try:
        with f:
            dims = _parse_header(f, p, hint)
            expected = math.prod(dims)  # exact (an int64 product of three 32-bit sizes can wrap)
            if expected > _MAX_PAYLOAD:
                raise DataFileError(p, f"IDX header claims an implausible size {dims}", hint)
            data = _read_exact(f, expected)
            if len(data) < expected:
                raise DataFileError(
                    p, f"truncated: header {dims} promises {expected} data bytes but only {len(data)} present", hint
                )
            if f.read(1):
                raise DataFileError(
                    p, f"has extra bytes after the {expected} data bytes promised by header {dims}", hint
                )
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise DataFileError(p, f"corrupt or truncated gzip data ({type(exc).__name__}: {exc})", hint) from None
    except OSError as exc:  # e.g. read errors on a broken disk / network mount
        raise DataFileError(p, f"read error ({type(exc).__name__}: {exc})", hint) from None
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def read_idx_pair(
    images_path: str | os.PathLike[str],
    labels_path: str | os.PathLike[str],
    *,
    expected_count: int | None,
    image_shape: tuple[int, int] = (28, 28),
    num_classes: int = 10,
    hint: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Read and cross-validate an (images, labels) IDX pair.

    Labels are read first (small file, fast failure). Checks: the magic of each
    file matches its role, counts equal ``expected_count`` (if given) and each
    other, images are ``image_shape`` and labels lie in ``0..num_classes-1``.

    Returns:
        ``(images uint8 [N, H, W], labels int64 [N])``.
    """
    labels = read_idx(labels_path, hint=hint)
    if labels.ndim != 1:
        raise DataFileError(
            labels_path, f"expected a label file (magic 0x{IDX_LABELS_MAGIC:08x}), found image data", hint
        )
    _check_count(labels_path, len(labels), expected_count, "labels", hint)
    if labels.max(initial=0) >= num_classes:
        raise DataFileError(labels_path, f"label {int(labels.max())} outside 0..{num_classes - 1}", hint)
    images = read_idx(images_path, hint=hint)
    if images.ndim != 3:
        raise DataFileError(
            images_path, f"expected an image file (magic 0x{IDX_IMAGES_MAGIC:08x}), found label data", hint
        )
    _check_count(images_path, len(images), expected_count, "images", hint)
    if images.shape[1:] != tuple(image_shape):
        raise DataFileError(images_path, f"images are {images.shape[1]}x{images.shape[2]}, expected "
                            f"{image_shape[0]}x{image_shape[1]}", hint)
    if len(images) != len(labels):
        raise DataFileError(labels_path, f"has {len(labels)} labels but {Path(images_path).name} has "
                            f"{len(images)} images", hint)
    return images, labels.astype(np.int64)


def _check_count(path: str | os.PathLike[str], n: int, expected: int | None, what: str, hint: str | None) -> None:
    """Raise if ``n`` differs from ``expected`` (when ``expected`` is given)."""
    if expected is not None and n != expected:
        raise DataFileError(path, f"has {n} {what}, expected {expected}", hint)
