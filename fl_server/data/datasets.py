"""Dataset loaders returning plain numpy arrays (no torch).

Every loader returns an :class:`ArrayDataset` with images ``x`` as ``float32``
``[N, C, H, W]`` scaled to ``[0, 1]`` and labels ``y`` as ``int64`` ``[N]``.

Data root resolution (:func:`resolve_root`): the ``root`` argument, else the
``FL_DATA_DIR`` environment variable, else ``~/.cache/fl-edge/data``.

=================  =====================================================================
dataset            where it is looked for under ``root``
=================  =====================================================================
``digits``         nowhere: shipped in the package (``digits.npz``, scikit-learn's 1,797 x 8x8)
``mnist``          ``mnist/`` then ``./`` -- standard IDX names, plain or ``.gz``
``fashion_mnist``  ``fashion-mnist/``, ``fashion_mnist/`` then ``./`` -- same IDX names
``cifar10``        ``cifar-10-batches-bin/``, ``cifar-10-binary.tar.gz``,
                   ``cifar-10-batches-py/``, ``cifar-10-python.tar.gz`` in ``./``,
                   ``cifar10/`` and ``cifar-10/`` (first hit wins)
=================  =====================================================================

Splits: ``"train"``, ``"test"`` or ``"all"`` (train followed by test).

``digits`` has no official split: its train split is the first
:data:`DIGITS_TRAIN_SIZE` (1,500) samples in scikit-learn order and its test split
the remaining 297, so ``"all"`` is the whole set in its original order.

CIFAR-10's python version is a set of pickles. They are read with
:class:`RestrictedUnpickler`, which resolves only the handful of numpy/codec
globals a CIFAR batch dict needs and refuses every other global, so a
malicious file cannot execute code (it is reported as :class:`DataFileError`).
The binary version is preferred when both are present.
"""

from __future__ import annotations

import os
import pickle
import tarfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .errors import DataFileError
from .idx import read_idx_pair

__all__ = [
    "ArrayDataset",
    "DATASETS",
    "SPLITS",
    "DATA_DIR_ENV",
    "DEFAULT_DATA_DIR",
    "DIGITS_TRAIN_SIZE",
    "RestrictedUnpickler",
    "load_dataset",
    "resolve_root",
]

DATASETS: tuple[str, ...] = ("digits", "mnist", "fashion_mnist", "cifar10")
NUM_CLASSES: dict[str, int] = {name: 10 for name in DATASETS}  # each built-in data set has ten classes
SPLITS: tuple[str, ...] = ("train", "test", "all")
DATA_DIR_ENV = "FL_DATA_DIR"
DEFAULT_DATA_DIR = Path("~/.cache/fl-edge/data")
DIGITS_TRAIN_SIZE = 1500


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """An in-memory labelled image dataset.

    Attributes:
        name: dataset name (one of :data:`DATASETS` for loaded data).
        x: ``float32`` images ``[N, C, H, W]`` with values in ``[0, 1]``.
        y: ``int64`` labels ``[N]`` in ``0..num_classes-1``.
        num_classes: number of classes.

    ``eq=False``: instances compare/hash by identity (element-wise array
    comparison has no single truth value).
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if self.x.ndim != 4 or self.x.dtype != np.float32:
            raise ValueError(f"x must be float32 [N, C, H, W], got {self.x.dtype} {self.x.shape}")
        if self.y.ndim != 1 or self.y.dtype != np.int64:
            raise ValueError(f"y must be int64 [N], got {self.y.dtype} {self.y.shape}")
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} samples but y has {len(self.y)}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: Sequence[int] | np.ndarray) -> ArrayDataset:
        """Return a new dataset with the samples at ``indices`` (ints or a bool mask of length N)."""
        idx = np.asarray(indices)
        if idx.dtype != np.bool_:
            if idx.size and idx.dtype.kind not in "iu":
                raise TypeError(f"indices must be integers or a boolean mask, got dtype {idx.dtype}")
            idx = idx.astype(np.intp, copy=False)
        return ArrayDataset(self.name, self.x[idx], self.y[idx], self.num_classes)


# --------------------------------------------------------------------------- public API


def resolve_root(root: str | os.PathLike[str] | None = None) -> Path:
    """Data root: ``root`` if given, else ``$FL_DATA_DIR`` if set, else ``~/.cache/fl-edge/data``."""
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return DEFAULT_DATA_DIR.expanduser()


def load_dataset(name: str, root: str | os.PathLike[str] | None = None, split: str = "all") -> ArrayDataset:
    """Load ``name`` (one of :data:`DATASETS`) as an :class:`ArrayDataset`.

    Args:
        name: ``digits``, ``mnist``, ``fashion_mnist`` (``fashion-mnist`` accepted) or ``cifar10``.
        root: data directory (see :func:`resolve_root`); ignored for ``digits``.
        split: ``"train"``, ``"test"`` or ``"all"`` (train then test, concatenated).

    Returns:
        x ``float32 [N, C, H, W]`` in ``[0, 1]`` -- ``[N,1,8,8]`` digits,
        ``[N,1,28,28]`` (fashion-)MNIST, ``[N,3,32,32]`` CIFAR-10 -- and y ``int64 [N]``.

    Raises:
        ValueError: unknown name or split.
        DataFileError: data files missing, truncated, corrupt or inconsistent.
    """
    key = name.strip().lower().replace("-", "_")
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    parts = ("train", "test") if split == "all" else (split,)
    if key == "digits":
        return _load_digits(parts)
    data_root = resolve_root(root)
    loader = _load_cifar10_raw if key == "cifar10" else _load_idx_raw
    raw = [loader(key, data_root, part) for part in parts]
    images = raw[0][0] if len(raw) == 1 else np.concatenate([r[0] for r in raw])
    labels = raw[0][1] if len(raw) == 1 else np.concatenate([r[1] for r in raw])
    return ArrayDataset(key, _to_unit_float(images), labels.astype(np.int64, copy=False), 10)


# --------------------------------------------------------------------------- helpers


def _to_unit_float(images: np.ndarray) -> np.ndarray:
    """uint8 ``[N, H, W]`` or ``[N, C, H, W]`` -> float32 ``[N, C, H, W]`` in ``[0, 1]``."""
    x = images.astype(np.float32)
    if x.ndim == 3:
        x = x[:, None]
    x /= np.float32(255.0)
    return x


DIGITS_FILE = Path(__file__).with_name("digits.npz")


def _load_digits(parts: Iterable[str]) -> ArrayDataset:
    """scikit-learn's 8x8 digits; train = first 1,500 samples, test = last 297.

    Read from ``digits.npz`` beside this module (``images`` uint8 [1797, 8, 8] in 0..16, ``target`` uint8),
    the arrays of ``sklearn.datasets.load_digits()`` in its order (a copy of the UCI ML hand-written digits
    test set, E. Alpaydin and C. Kaynak, CC BY 4.0), so neither scikit-learn nor a download is needed."""
    with np.load(DIGITS_FILE, allow_pickle=False) as f:
        images, target = f["images"], f["target"]
    x = (images.astype(np.float32) / np.float32(16.0))[:, None]  # [1797, 1, 8, 8]
    y = target.astype(np.int64)
    slices = {"train": slice(0, DIGITS_TRAIN_SIZE), "test": slice(DIGITS_TRAIN_SIZE, None)}
    sel = [slices[p] for p in parts]
    xs = np.concatenate([x[s] for s in sel]) if len(sel) > 1 else x[sel[0]]
    ys = np.concatenate([y[s] for s in sel]) if len(sel) > 1 else y[sel[0]]
    return ArrayDataset("digits", np.ascontiguousarray(xs), np.ascontiguousarray(ys), 10)


# ----- MNIST / Fashion-MNIST (IDX)

_IDX_SUBDIRS: dict[str, tuple[str, ...]] = {
    "mnist": ("mnist", "."),
    "fashion_mnist": ("fashion-mnist", "fashion_mnist", "."),
}
#: split -> (images file, labels file, expected count)
_IDX_FILES: dict[str, tuple[str, str, int]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60_000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10_000),
}


def _fetch_hint(name: str, root: Path) -> str:
    return (
        f"to get the data run `fl-server data fetch {name} --dir {root}` "
        f"(or set {DATA_DIR_ENV} to a directory that already has it)"
    )


def _find_file(directory: Path, base: str) -> Path | None:
    """``directory/base`` or ``directory/base.gz``, whichever exists first."""
    for candidate in (directory / base, directory / f"{base}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _idx_dir(name: str, root: Path, bases: Sequence[str], hint: str) -> Path:
    """First candidate directory that holds any of ``bases`` (files are never mixed across dirs)."""
    dirs = [root / sub if sub != "." else root for sub in _IDX_SUBDIRS[name]]
    for d in dirs:
        if any(_find_file(d, b) for b in bases):
            return d
    looked = ", ".join(str(d) for d in dirs)
    raise DataFileError(dirs[0] / f"{bases[0]}[.gz]", f"not found (looked in {looked})", hint)


def _load_idx_raw(name: str, root: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """One split of (fashion-)MNIST as ``(uint8 [N, 28, 28], int64 [N])``."""
    images_base, labels_base, count = _IDX_FILES[split]
    hint = _fetch_hint(name, root)
    directory = _idx_dir(name, root, (labels_base, images_base), hint)
    # a missing file is reported by read_idx_pair when it gets to it (labels are read first)
    paths = {b: _find_file(directory, b) or directory / f"{b}[.gz]" for b in (labels_base, images_base)}
    return read_idx_pair(paths[images_base], paths[labels_base], expected_count=count, hint=hint)


# ----- CIFAR-10

_CIFAR_BATCHES: dict[str, tuple[str, ...]] = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
_CIFAR_RECORD = 1 + 3 * 32 * 32
_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"

Parsed = tuple[np.ndarray, np.ndarray]  # (uint8 [N, 3, 32, 32], int64 [N])


def _cifar_hint(root: Path) -> str:
    return (
        f"download cifar-10-python.tar.gz or cifar-10-binary.tar.gz from {_CIFAR_URL} into {root} "
        f"(or set {DATA_DIR_ENV}); `fl-server data fetch` cannot fetch CIFAR-10"
    )


def _parse_cifar_binary(data: bytes, where: str | Path, hint: str) -> Parsed:
    """Binary batch: records of 1 label byte + 3072 pixel bytes (R, G, B planes of 32x32)."""
    if not data or len(data) % _CIFAR_RECORD:
        raise DataFileError(where, f"size {len(data)} is not a positive multiple of the {_CIFAR_RECORD}-byte "
                            "CIFAR-10 record; truncated or not a CIFAR-10 binary batch", hint)
    rec = np.frombuffer(data, dtype=np.uint8).reshape(-1, _CIFAR_RECORD)
    return _check_cifar(rec[:, 1:].reshape(-1, 3, 32, 32), rec[:, 0].astype(np.int64), where, hint)


def _check_cifar(x: np.ndarray, y: np.ndarray, where: str | Path, hint: str) -> Parsed:
    if len(y) and (y.min() < 0 or y.max() > 9):
        raise DataFileError(where, f"label outside 0..9 (min {y.min()}, max {y.max()})", hint)
    return x, y


def _latin1_encode(obj: object, encoding: str = "utf-8") -> bytes:
    """Stand-in for ``_codecs.encode`` (pickle protocol <3 writes bytes as ``encode(str, 'latin1')``)."""
    if not isinstance(obj, str) or encoding.lower().replace("-", "").replace("_", "") != "latin1":
        raise pickle.UnpicklingError("refusing _codecs.encode other than str -> latin1")
    return obj.encode("latin-1")


def _empty_bytes() -> bytes:
    """Stand-in for ``bytes()`` (protocol <3 pickles ``b''`` as a call to ``bytes``)."""
    return b""


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """The numpy constructors that ndarray/dtype pickles reference, taken from numpy itself."""
    allowed: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    found = {
        "_reconstruct": np.empty(0).__reduce_ex__(2)[0],  # protocol <5 ndarray
        "_frombuffer": np.empty(1).__reduce_ex__(5)[0],  # protocol 5 contiguous ndarray
        "scalar": np.float32(0).__reduce__()[0],  # numpy scalars
    }
    modules = {"_reconstruct": "multiarray", "_frombuffer": "numeric", "scalar": "multiarray"}
    for fname, func in found.items():
        if getattr(func, "__name__", None) == fname:  # fail closed if numpy changes its pickling
            for pkg in ("numpy.core", "numpy._core"):
                allowed[(f"{pkg}.{modules[fname]}", fname)] = func
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for CIFAR batch dicts that cannot execute code.

    ``find_class`` (the only way a pickle can reach callables) resolves just:
    ``numpy.ndarray``, ``numpy.dtype``, numpy's own ``_reconstruct`` /
    ``_frombuffer`` / ``scalar`` (under ``numpy.core.*`` and ``numpy._core.*``),
    ``_codecs.encode`` restricted to str -> latin-1 bytes, and ``bytes()`` with
    no arguments. Anything else (``os.system``, ``builtins.eval``, ...) raises
    :class:`pickle.UnpicklingError`. Persistent ids are refused too.
    """

    _ALLOWED: dict[tuple[str, str], Any] = {
        **_numpy_globals(),
        ("_codecs", "encode"): _latin1_encode,
        ("builtins", "bytes"): _empty_bytes,
        ("__builtin__", "bytes"): _empty_bytes,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name} (only numpy arrays are allowed in CIFAR-10 batches)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing persistent id in CIFAR-10 batch")


def _parse_cifar_pickle(f: IO[bytes], where: str | Path, hint: str) -> Parsed:
    """Python batch: dict with ``data`` uint8 ``[N, 3072]`` and ``labels`` (list of N ints)."""
    try:
        obj = RestrictedUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # noqa: BLE001 - any failure of an untrusted pickle is a data error
        raise DataFileError(where, f"not a valid CIFAR-10 python batch ({type(exc).__name__}: {exc})", hint) from None
    if not isinstance(obj, dict):
        raise DataFileError(where, f"expected a dict, found {type(obj).__name__}", hint)
    d = {(k.decode("latin-1") if isinstance(k, bytes) else k): v for k, v in obj.items()}
    data, labels = d.get("data"), d.get("labels")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataFileError(where, f"'data' must be a uint8 [N, 3072] array, found {desc}", hint)
    try:
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError):
        raise DataFileError(where, "'labels' missing or not a list of integers", hint) from None
    if len(y) != len(data):
        raise DataFileError(where, f"has {len(data)} images but {len(y)} labels", hint)
    return _check_cifar(data.reshape(-1, 3, 32, 32), y, where, hint)


def _read_dir_batches(directory: Path, files: Sequence[str], parse: Callable[..., Parsed], hint: str,
                      binary: bool) -> list[Parsed]:
    out = []
    for fname in files:
        path = directory / fname
        try:
            with open(path, "rb") as f:
                out.append(parse(f.read(), path, hint) if binary else parse(f, path, hint))
        except FileNotFoundError:
            raise DataFileError(path, "not found", hint) from None
        except OSError as exc:
            raise DataFileError(path, f"cannot be read ({exc})", hint) from None
    return out


def _read_tar_batches(tar_path: Path, inner_dir: str, files: Sequence[str], parse: Callable[..., Parsed],
                      hint: str, binary: bool) -> list[Parsed]:
    """Parse ``inner_dir/<file>`` members in one forward pass (nothing is extracted to disk)."""
    wanted = set(files)
    got: dict[str, Parsed] = {}
    try:
        with tarfile.open(tar_path, "r:*") as tf:
            for member in tf:
                parent, _, base = member.name.lstrip("./").rpartition("/")
                if base not in wanted or base in got or not member.isfile() or parent.rpartition("/")[2] != inner_dir:
                    continue
                where = f"{tar_path}:{member.name}"
                fobj = tf.extractfile(member)
                if fobj is None:
                    continue
                got[base] = parse(fobj.read(), where, hint) if binary else parse(fobj, where, hint)
                if len(got) == len(wanted):
                    break
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise DataFileError(tar_path, f"corrupt or truncated archive ({type(exc).__name__}: {exc})", hint) from None
    missing = [f for f in files if f not in got]
    if missing:
        raise DataFileError(tar_path, f"archive lacks {inner_dir}/{missing[0]}", hint)
    return [got[f] for f in files]


def _load_cifar10_raw(name: str, root: Path, split: str) -> Parsed:
    """One split of CIFAR-10 as ``(uint8 [N, 3, 32, 32], int64 [N])`` from the first source found."""
    hint = _cifar_hint(root)
    batches = _CIFAR_BATCHES[split]
    bin_files = [f"{b}.bin" for b in batches]
    dirs = [root, root / "cifar10", root / "cifar-10"]
    parsed: list[Parsed] | None = None
    for d in dirs:
        if (d / "cifar-10-batches-bin").is_dir():
            parsed = _read_dir_batches(d / "cifar-10-batches-bin", bin_files, _parse_cifar_binary, hint, True)
        elif (d / "cifar-10-binary.tar.gz").is_file():
            parsed = _read_tar_batches(d / "cifar-10-binary.tar.gz", "cifar-10-batches-bin", bin_files,
                                       _parse_cifar_binary, hint, True)
        elif (d / "cifar-10-batches-py").is_dir():
            parsed = _read_dir_batches(d / "cifar-10-batches-py", batches, _parse_cifar_pickle, hint, False)
        elif (d / "cifar-10-python.tar.gz").is_file():
            parsed = _read_tar_batches(d / "cifar-10-python.tar.gz", "cifar-10-batches-py", batches,
                                       _parse_cifar_pickle, hint, False)
        if parsed is not None:
            break
    if parsed is None:
        looked = ", ".join(str(d) for d in dirs)
        raise DataFileError(root / "cifar-10-python.tar.gz", "not found (looked for cifar-10-batches-bin/, "
                            f"cifar-10-binary.tar.gz, cifar-10-batches-py/, cifar-10-python.tar.gz in {looked})", hint)
    return np.concatenate([p[0] for p in parsed]), np.concatenate([p[1] for p in parsed])
