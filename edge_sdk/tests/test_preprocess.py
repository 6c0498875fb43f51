"""edge_sdk._preprocess: the device's half of a recipe's preprocessing (numpy only)."""
from __future__ import annotations

import numpy as np
import pytest

from edge_sdk._preprocess import Preprocess


def test_raw_uint8_nhwc_becomes_normalised_nchw() -> None:
    raw = np.arange(2 * 4 * 4 * 3, dtype=np.uint8).reshape(2, 4, 4, 3)
    pre = Preprocess(layout="NHWC", scale=1 / 255, mean=(0.5, 0.4, 0.3), std=(0.2, 0.2, 0.1))
    out = pre.apply(raw)
    assert out.dtype == np.float32 and out.shape == (2, 3, 4, 4)
    expected = (raw.transpose(0, 3, 1, 2) / 255 - np.array([0.5, 0.4, 0.3]).reshape(1, 3, 1, 1)) / \
        np.array([0.2, 0.2, 0.1]).reshape(1, 3, 1, 1)
    assert np.abs(out - expected).max() < 1e-5
    assert Preprocess(size=(2, 2)).apply(np.ones((1, 1, 4, 4), np.float32)).shape == (1, 1, 2, 2)
    assert Preprocess.identity().apply(raw.transpose(0, 3, 1, 2).astype(np.float32)).max() == raw.max()


@pytest.mark.parametrize("bad, message", [
    ({"layout": "HWC"}, "preprocess layout must be 'NHWC' or 'NCHW', got 'HWC'"),
    ({"size": (0, 4)}, r"preprocess size must be \(height, width\) of positive integers, got \(0, 4\)"),
    ({"std": (0.0,)}, r"preprocess std must be positive, got \(0.0,\)"),
    ({"scale": float("nan")}, "preprocess scale must be a finite non-zero number, got nan"),
])
def test_bad_settings_are_one_line(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        Preprocess(**bad)


def test_from_dict_is_strict_and_round_trips() -> None:
    pre = Preprocess(layout="NHWC", size=(28, 28), scale=1 / 255, mean=(0.1307,), std=(0.3081,))
    assert Preprocess.from_dict(pre.to_dict()) == pre
    with pytest.raises(ValueError, match=r"preprocess mean must be a list of numbers, got '0.5'"):
        Preprocess.from_dict({**pre.to_dict(), "mean": "0.5"})
    with pytest.raises(ValueError, match="preprocess must be an object, got list"):
        Preprocess.from_dict([])
    three = Preprocess(mean=(0.1, 0.2), std=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"^preprocess mean has 2 values for images with 3 channels$"):
        three.apply(np.zeros((1, 3, 2, 2), np.float32))


def test_raw_input_refuses_images_unlike_the_recipes_in_one_line() -> None:
    from edge_sdk._preprocess import RawInput

    floats = Preprocess(raw=RawInput("float32", (0, 1), (1, 28, 28)))  # a built-in set: float32 NCHW in [0, 1]
    assert Preprocess.from_dict(floats.to_dict()) == floats and floats.is_identity
    floats.apply(np.full((2, 1, 28, 28), 0.5, np.float32))
    with pytest.raises(ValueError, match=r"^this bundle expects raw pixels in \[0, 1\] \(float32\); got uint8 values "
                                         r"in \[0, 255\]: scale them into \[0, 1\] as the recipe's data was \(8-bit "
                                         r"pixels: x / 255\)$"):
        floats.apply(np.array([0, 255], np.uint8).repeat(392).reshape(1, 1, 28, 28))
    with pytest.raises(ValueError, match=r"^this bundle expects raw pixels in \[0, 1\] \(float32\); got int64 values "
                                         r"in \[0, 16\]: scale them into \[0, 1\] as the recipe's data was$"):
        floats.apply(np.array([0, 16]).repeat(392).reshape(1, 1, 28, 28))  # 0..16 (scikit-learn's digits): not / 255
    resized = Preprocess(layout="NHWC", size=(32, 32), scale=1 / 255, raw=RawInput("uint8", (0, 255), (None, None, 3)))
    assert resized.apply(np.zeros((1, 40, 20, 3), np.uint8)).shape == (1, 3, 32, 32)  # any size: resized
    with pytest.raises(ValueError, match=r"^expected raw images \[N, H, W, 3\] \(uint8, layout NHWC\), got "
                                         r"\[1, 40, 20\]"):
        resized.apply(np.zeros((1, 40, 20), np.uint8))
    with pytest.raises(ValueError, match=r"^preprocess raw must be an object with keys dtype, range, shape"):
        Preprocess.from_dict({**resized.to_dict(), "raw": {"dtype": "uint8"}})
    with pytest.raises(ValueError, match=r"^preprocess raw range must be \[low, high\] with low < high, got \(1, 0\)$"):
        RawInput("float32", (1, 0))


def test_data_in_no_known_range_warns_of_a_batch_on_another_scale() -> None:
    """Feature vectors (1x1 NHWC images, a channel per feature) in no range a device recognises: the manifest holds
    each feature's mean and standard deviation (``input_moments``, beside ``preprocess``), and a batch normalised
    already, or raw where the data was normalised, is warned of; the data itself, a shifted batch (two standard
    deviations), single samples and a sample whose rare feature is set pass."""
    import warnings

    from edge_sdk import InputScaleWarning
    from edge_sdk._preprocess import RawInput

    rng = np.random.default_rng(0)
    mean, std = np.array([40.0, 2000.0, 50.0, 7.0, 0.01]), np.array([12.0, 900.0, 20.0, 0.0, 0.1])  # 3: constant
    data = (mean + std * rng.normal(size=(256, 5))).reshape(-1, 1, 1, 5).astype(np.float32)
    data[..., 4] = (rng.random((256, 1, 1)) < 0.01)  # a flag set in 1% of the samples
    mean[4], std[4] = data[..., 4].mean(), data[..., 4].std()
    pre = Preprocess(layout="NHWC", mean=tuple(mean), std=tuple(np.maximum(std, 1)),
                     raw=RawInput("float32", None, (1, 1, 5), (tuple(mean), tuple(std))))
    manifest = {"preprocess": pre.to_dict(), "input_moments": pre.moments_dict()}
    assert set(manifest["preprocess"]["raw"]) == {"dtype", "range", "shape"}  # what older SDKs check, as before
    assert Preprocess.from_dict(manifest["preprocess"]).with_moments(manifest["input_moments"]) == pre
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputScaleWarning)
        pre.apply(data)
        pre.apply(data + (2 * std).astype(np.float32))  # a test-time shift
        for row in data[:16]:
            pre.apply(row[None])
        flagged = data[:1].copy()
        flagged[..., 4] = 1.0  # the rare flag set: that feature is far out, the median channel is not
        pre.apply(flagged)
    normalised = ((data - mean) / np.maximum(std, 1e-3)).astype(np.float32)
    with pytest.warns(InputScaleWarning, match=r" and spread 0\.0\d+ times as widely, so its predictions"):
        pre.apply(normalised)
    with pytest.warns(InputScaleWarning, match=r"^this batch is on another scale than the bundle's data \(channel means "
                                               r"\[40, 2e\+03, 50, \.\.\. \(5 channels\)\], standard deviations \[12, "
                                               r"900, 20, \.\.\. \(5 channels\)\]\): for the median channel, its "
                                               r"values lie \d+\.\d of those standard deviations from the mean \(root "
                                               r"mean square\), so"):
        pre.apply(data[:1] * 1000)  # one sample on a scale a thousand times larger: where it lies says so alone
    with warnings.catch_warnings():
        warnings.simplefilter("error", InputScaleWarning)
        pre.apply(np.full_like(data[:4], np.nan))  # NaN is not a question of scale
    with pytest.raises(ValueError, match=r"^preprocess raw moments must be \[means, stds\], one finite value per "
                                         r"channel \(stds not negative\), got \(\(1\.0,\), \(-1\.0,\)\)$"):
        RawInput("float32", None, None, ((1.0,), (-1.0,)))
    with pytest.raises(ValueError, match=r"^input_moments must be an object with lists mean and std, got \[1\]$"):
        Preprocess.from_dict(manifest["preprocess"]).with_moments([1])
