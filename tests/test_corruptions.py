"""Tests for fl_server.data.corruptions on real MNIST digits and seeded RGB images."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

from fl_server.data.corruptions import CORRUPTIONS, corrupt, corrupt_dataset

SEVERITIES = (1, 2, 3, 4, 5)
CIFAR_C_NAMES = {
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur",
    "motion_blur", "zoom_blur", "snow", "frost", "fog", "brightness", "contrast",
    "elastic_transform", "pixelate", "jpeg_compression",
}
DETERMINISTIC = {"defocus_blur", "zoom_blur", "brightness", "contrast", "pixelate",
                 "jpeg_compression"}
# Severity steps may shrink the mean absolute change by at most this fraction
# (glass_blur: a larger blur sigma at a higher severity smooths the shuffle).
MONOTONE_RTOL, MONOTONE_ATOL = 0.05, 1e-4


def _read_idx_images(path: Path, count: int) -> np.ndarray:
    """Minimal IDX3 reader: 16-byte big-endian header, then uint8 pixels."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, n, rows, cols = np.frombuffer(data[:16], dtype=">u4")
    assert magic == 0x803, f"not an IDX3 image file: magic {magic:#x}"
    images = np.frombuffer(data, dtype=np.uint8, offset=16).reshape(n, rows, cols)
    return images[:count]


@pytest.fixture(scope="module")
def mnist(data_root: Path) -> np.ndarray:
    images = _read_idx_images(data_root / "mnist" / "t10k-images-idx3-ubyte.gz", 64)  # $FL_DATA_DIR (conftest)
    return (images.astype(np.float32) / 255.0)[:, None]


@pytest.fixture(scope="module")
def rgb() -> np.ndarray:
    """Seeded random RGB images, spatially smoothed so they have image-like structure."""
    noise = np.random.default_rng(1234).random((24, 3, 32, 32))
    x = ndimage.gaussian_filter(noise, sigma=(0, 0, 1.5, 1.5), mode="wrap")
    lo = x.min(axis=(1, 2, 3), keepdims=True)
    hi = x.max(axis=(1, 2, 3), keepdims=True)
    return ((x - lo) / (hi - lo)).astype(np.float32)


@pytest.fixture(scope="module", params=["mnist", "rgb"])
def images(request: pytest.FixtureRequest) -> np.ndarray:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def outputs(images: np.ndarray) -> dict[tuple[str, int], np.ndarray]:
    """Every corruption at every severity, seed 0 (computed once per dataset)."""
    before = images.copy()
    out = {(n, s): corrupt(images, n, s, seed=0) for n in CORRUPTIONS for s in SEVERITIES}
    np.testing.assert_array_equal(images, before)  # input left untouched
    return out


# ----------------------------------------------------------------- contract


def test_corruption_names() -> None:
    assert len(CORRUPTIONS) >= 12
    assert len(set(CORRUPTIONS)) == len(CORRUPTIONS)
    assert set(CORRUPTIONS) <= CIFAR_C_NAMES


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_output_contract(name: str, images: np.ndarray, outputs: dict) -> None:
    for s in SEVERITIES:
        y = outputs[name, s]
        assert y.shape == images.shape and y.dtype == np.float32
        assert y.min() >= 0.0 and y.max() <= 1.0 and np.isfinite(y).all()
        per_image = np.abs(y - images).reshape(len(y), -1).max(axis=1)
        assert (per_image > 1e-6).all(), f"{name} s{s} left some images unchanged"
        assert np.abs(y - images).mean() > 1e-4, f"{name} s{s} barely changes the input"


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_deterministic(name: str, images: np.ndarray, outputs: dict) -> None:
    for s in SEVERITIES:
        np.testing.assert_array_equal(corrupt(images, name, s, seed=0), outputs[name, s])
    # a Generator seed is used as the random stream directly
    np.testing.assert_array_equal(
        corrupt(images, name, 3, seed=np.random.default_rng(0)), outputs[name, 3])
    other = corrupt(images, name, 3, seed=1)
    if name in DETERMINISTIC:
        np.testing.assert_array_equal(other, outputs[name, 3])
    else:
        assert not np.array_equal(other, outputs[name, 3])


@pytest.mark.parametrize("name", [
    pytest.param("elastic_transform", marks=pytest.mark.xfail(
        strict=True, reason="CIFAR-10-C parameters shrink the affine jitter with severity "
                            "(0.08 -> 0.03 x size), so pixel change decreases")),
    *[n for n in CORRUPTIONS if n != "elastic_transform"]])
def test_severity_increases_change(name: str, images: np.ndarray, outputs: dict) -> None:
    change = [float(np.abs(outputs[name, s] - images).mean()) for s in SEVERITIES]
    for lo, hi in zip(change, change[1:]):
        assert hi >= lo * (1 - MONOTONE_RTOL) - MONOTONE_ATOL, f"{name}: {change}"
    assert change[-1] > change[0], f"{name}: {change}"


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_single_image_and_float64(name: str, mnist: np.ndarray, rgb: np.ndarray) -> None:
    for x in (mnist[:1], rgb[:1].astype(np.float64)):
        y = corrupt(x, name, 5, seed=7)
        assert y.shape == x.shape and y.dtype == np.float32
        assert 0.0 <= y.min() and y.max() <= 1.0


# ------------------------------------------------------ semantic spot checks


def test_contrast_keeps_channel_means(rgb: np.ndarray) -> None:
    y = corrupt(rgb, "contrast", 5)
    np.testing.assert_allclose(y.mean(axis=(2, 3)), rgb.mean(axis=(2, 3)), atol=1e-5)


def test_brightness_grayscale_and_hue(mnist: np.ndarray, rgb: np.ndarray) -> None:
    np.testing.assert_allclose(corrupt(mnist, "brightness", 2),
                               np.clip(mnist + 0.1, 0, 1), atol=1e-6)
    # RGB: HSV value + 0.05 with hue and saturation kept == scaling by (v + 0.05) / v
    x = rgb.astype(np.float64)
    v = x.max(axis=1, keepdims=True)
    expected = np.where(v > 0, x * np.minimum(v + 0.05, 1) / np.maximum(v, 1e-12), 0.05)
    np.testing.assert_allclose(corrupt(rgb, "brightness", 1), expected, atol=1e-6)


@pytest.mark.parametrize("name", ["defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
                                  "elastic_transform", "pixelate", "jpeg_compression"])
def test_spatial_ops_keep_flat_images(name: str) -> None:
    """Normalised kernels / resamplers leave a constant image (almost) unchanged."""
    x = np.full((3, 3, 32, 32), 0.4, dtype=np.float32)
    np.testing.assert_allclose(corrupt(x, name, 5), x, atol=5e-3)  # JPEG: DC step ~1/255


def _pil_reference(x: np.ndarray, op) -> np.ndarray:
    """Apply a PIL round trip to each uint8 image of a [N, C, H, W] batch."""
    pil_image = pytest.importorskip("PIL.Image", reason="Pillow not installed")
    u8 = np.round(x * 255).astype(np.uint8)
    out = []
    for img in u8:
        arr = img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)
        res = np.asarray(op(pil_image, pil_image.fromarray(arr)), dtype=np.float32) / 255
        out.append(res[None] if res.ndim == 2 else res.transpose(2, 0, 1))
    return np.stack(out), u8.astype(np.float32) / 255


@pytest.mark.parametrize("severity", SEVERITIES)
def test_pixelate_matches_pil_box(severity: int, mnist: np.ndarray, rgb: np.ndarray) -> None:
    c = [0.95, 0.9, 0.85, 0.75, 0.65][severity - 1]

    def box(pil, im):
        size = im.size[0]
        small = im.resize((int(size * c), int(size * c)), pil.BOX)
        return small.resize((size, size), pil.BOX)

    for x in (mnist[:16], rgb[:16]):
        ref, x8 = _pil_reference(x, box)
        np.testing.assert_allclose(corrupt(x8, "pixelate", severity), ref, atol=1 / 255 + 1e-6)


@pytest.mark.parametrize("severity", SEVERITIES)
def test_jpeg_close_to_pil(severity: int, mnist: np.ndarray, rgb: np.ndarray) -> None:
    quality = [80, 65, 58, 50, 40][severity - 1]

    def jpeg(pil, im):
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
        return pil.open(buf)

    for x in (mnist[:16], rgb[:16]):
        ref, x8 = _pil_reference(x, jpeg)
        err = np.abs(corrupt(x8, "jpeg_compression", severity) - ref).mean()
        assert err < 0.25 * np.abs(ref - x8).mean(), err  # far below the JPEG error itself


def test_corrupt_dataset(mnist: np.ndarray) -> None:
    out = corrupt_dataset(mnist[:4], names=["fog", "contrast"], severity=2, seed=3)
    assert set(out) == {"fog", "contrast"}
    np.testing.assert_array_equal(out["contrast"], corrupt(mnist[:4], "contrast", 2))
    again = corrupt_dataset(mnist[:4], names=["fog"], severity=2, seed=3)
    np.testing.assert_array_equal(out["fog"], again["fog"])


# --------------------------------------------------------------- errors


def _ok() -> np.ndarray:
    return np.full((2, 1, 28, 28), 0.5, dtype=np.float32)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown corruption 'rain'") as err:
        corrupt(_ok(), "rain", 1)
    assert all(n in str(err.value) for n in CORRUPTIONS)


@pytest.mark.parametrize("severity", [0, 6, -1, 2.5, True, "3"])
def test_bad_severity(severity: object) -> None:
    with pytest.raises(ValueError, match="severity must be an integer in 1..5"):
        corrupt(_ok(), "contrast", severity)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(28, 28), (1, 28, 28), (1, 1, 1, 28, 28)])
def test_wrong_ndim(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"shape \[N, C, H, W\]"):
        corrupt(np.zeros(shape, np.float32), "contrast", 1)


@pytest.mark.parametrize("dtype", [np.uint8, np.int64, bool])
def test_non_float_input(dtype: type) -> None:
    with pytest.raises(ValueError, match="floating-point"):
        corrupt(np.zeros((1, 1, 28, 28), dtype), "contrast", 1)


@pytest.mark.parametrize("value", [-0.01, 1.01, 255.0, np.nan])
def test_values_outside_unit_range(value: float) -> None:
    x = _ok()
    x[0, 0, 3, 3] = value
    with pytest.raises(ValueError, match=r"values must lie in \[0, 1\]"):
        corrupt(x, "contrast", 1)


@pytest.mark.parametrize("channels", [2, 4])
def test_bad_channel_count(channels: int) -> None:
    with pytest.raises(ValueError, match="1 \\(grayscale\\) or 3 \\(RGB\\) channels"):
        corrupt(np.zeros((1, channels, 32, 32), np.float32), "contrast", 1)
