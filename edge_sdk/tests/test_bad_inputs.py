"""Bad input on the device, for every runner (FedTTA++, TENT, plain inference, the ODPFL-HN encoder, the
BTFL stream): a ValueError naming the problem, or the documented behaviour (edge_sdk._runners docstring) --
never an error from inside onnxruntime."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import edge_sdk
from edge_sdk._btfl import BTFLStream, fit_dle
from reliability_log import record

RUNNERS = {"FedTTA++": ("fedtta_pp", None), "TENT": ("tent", None), "plain": ("tent", "none"),
           "ODPFL-HN encoder": ("odpfl_hn", None)}


@pytest.fixture(scope="module")
def x(sdk_fixture: Path) -> np.ndarray:
    with np.load(sdk_fixture / "reference.npz", allow_pickle=False) as ref:
        return ref["x"][:24]


@pytest.fixture(scope="module")
def runners(sdk_fixture: Path) -> dict[str, edge_sdk.Device]:
    return {name: edge_sdk.open_bundle(load(sdk_fixture / d), method=m) for name, (d, m) in RUNNERS.items()}


def load(path: Path) -> edge_sdk.Bundle:
    return edge_sdk.load_bundle(path, public_key=(path.parent / "signing_key.pub").read_text().strip())


def _set(x: np.ndarray, index: tuple[int, ...], value: float) -> np.ndarray:
    y = x.copy()
    y[index] = value
    return y


# input -> (make it from a valid batch, expected ValueError message)
REFUSED: dict[str, tuple[Callable[[np.ndarray], Any], str]] = {
    "NaN pixel": (lambda x: _set(x, (0, 0, 3, 3), np.nan), "NaN or inf"),
    "+inf pixel": (lambda x: _set(x, (5, 0, 0, 0), np.inf), "NaN or inf"),
    "-inf pixel": (lambda x: _set(x, (2, 0, 7, 1), -np.inf), "NaN or inf"),
    "float64 batch": (lambda x: x.astype(np.float64), "must be float32, got float64"),
    "uint8 batch": (lambda x: (x * 255).astype(np.uint8), "must be float32, got uint8"),
    "Python list": (lambda x: x.tolist(), "must be a numpy float32 array, got list"),
    "None": (lambda x: None, "must be a numpy float32 array, got NoneType"),
    "missing channel axis": (lambda x: x[:, 0], r"must have 4 dimensions .*got shape \(24, 28, 28\)"),
    "extra axis": (lambda x: x[None], "must have 4 dimensions"),
    "wrong image size": (lambda x: x[:, :, :20, :20], "has size 20 on axis 2, the model expects 28"),
    "wrong channel count": (lambda x: np.repeat(x, 3, axis=1), "has size 3 on axis 1, the model expects 1"),
    "empty batch": (lambda x: x[:0], "empty batch"),
    "finite but overflowing (3e38)": (lambda x: np.full_like(x, 3e38), "output is not finite for this input"),
}


def _run(p: edge_sdk.Device, batch: Any) -> tuple[np.ndarray, Any]:
    """What a device does with a batch: ODPFL-HN embeds it, the others personalise and predict (returning the
    personalised weights)."""
    if p.bundle.device_step == "encoder":
        return p.runner.embed(batch), None
    p.personalize(batch)
    return p.predict(batch), p.weights


@pytest.mark.parametrize("case", list(REFUSED))
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_bad_batches_are_refused(runners: dict[str, edge_sdk.Device], x: np.ndarray, runner: str, case: str) -> None:
    make, message = REFUSED[case]
    with pytest.raises(ValueError, match=message) as info:
        _run(runners[runner], make(x))
    assert "onnxruntime" not in type(info.value).__module__
    record("bad-input", case, f"ValueError: {info.value}", runner=runner)


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("value", [0.0, 1.0])
def test_constant_image_stream(runners: dict[str, edge_sdk.Device], x: np.ndarray, runner: str, value: float) -> None:
    """Blank frames are valid input: five batches of one constant image each adapt and predict finitely, and
    every copy of the image gets the same output."""
    p = runners[runner]
    for _ in range(5):
        out, result = _run(p, np.full_like(x, value))
        assert np.isfinite(out).all()
        if result is not None:
            assert all(np.isfinite(w).all() for w in result.values())
            assert np.ptp(out, axis=0).max() < 1e-5  # identical rows for identical images
    record("bad-input", f"stream of constant images (all {value:g}), 5 batches",
           "defined: adapts and predicts; finite, identical outputs", runner=runner)


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_defined_edge_cases(runners: dict[str, edge_sdk.Device], x: np.ndarray, runner: str) -> None:
    p = runners[runner]
    one, _ = _run(p, x[:1])  # a batch of one sample
    assert np.isfinite(one).all()
    fortran, _ = _run(p, np.asfortranarray(x))  # non-contiguous memory: same as contiguous
    np.testing.assert_allclose(fortran, _run(p, np.ascontiguousarray(x))[0], atol=1e-6)
    try:  # large, finite input: either finite outputs (a step that overflows ends adaptation) or the clear error
        big, result = _run(p, np.full_like(x, 1e20))
        assert np.isfinite(big).all()
        big_outcome = "finite outputs (overflowing steps end adaptation)"
    except ValueError as exc:
        assert "output is not finite" in str(exc)
        big_outcome = f"ValueError: {exc}"
    record("bad-input", "batch of one sample", "defined: works", runner=runner)
    record("bad-input", "non-contiguous (Fortran-order) batch", "defined: same outputs as contiguous", runner=runner)
    record("bad-input", "large finite values (1e20)", big_outcome, runner=runner)


GENERATED = {
    "not a dict": (lambda w: [1, 2], "generate returned list"),
    "a weight missing": (lambda w: dict(list(w.items())[1:]), "weights lack"),
    "wrong shape": (lambda w: {k: v[..., :-1] for k, v in w.items()}, "has shape .* the graph expects"),
    "float64 weights": (lambda w: {k: v.astype(np.float64) for k, v in w.items()}, "must be a float32 array, got float64"),
    "NaN weight": (lambda w: {k: _set(v, (0,) * v.ndim, np.nan) for k, v in w.items()}, "contains NaN or inf"),
}


@pytest.mark.parametrize("case", list(GENERATED))
def test_bad_generated_weights_are_refused(runners: dict[str, edge_sdk.Device], x: np.ndarray, case: str) -> None:
    """ODPFL-HN: weights returned by the coordinator are checked against the bundle's model before use."""
    p = runners["ODPFL-HN encoder"].runner
    good = {f"psi.{k}": v for k, v in p.base.items()}  # a well-formed answer: the received weights
    np.testing.assert_allclose(p.logits(x, p.generated(good)), p.predict(x), atol=1e-6)
    make, message = GENERATED[case]
    with pytest.raises(ValueError, match=message):
        p.generated(make(good))
    record("bad-input", f"coordinator-generated weights: {case}", "ValueError before onnxruntime",
           runner="ODPFL-HN personalise")


@pytest.mark.parametrize("change", ["NaN written in place", "array reshaped in place"])
def test_weights_changed_after_their_check_never_reach_onnxruntime(runners: dict[str, edge_sdk.Device], x: np.ndarray,
                                                                  change: str) -> None:
    """predict checks a weight set once and runs the copy it checked: changing the caller's arrays afterwards
    changes nothing (a new dict is checked again)."""
    device = runners["TENT"]
    device.personalize(x)
    p = device.runner
    weights = {k: v.copy() for k, v in device.weights.items()}
    before = p.logits(x, weights)
    name = next(k for k, v in weights.items() if v.ndim == 2)
    if change == "NaN written in place":
        weights[name][0, 0] = np.nan
    else:
        weights[name].shape = (weights[name].size,)
    np.testing.assert_array_equal(p.logits(x, weights), before)
    with pytest.raises(ValueError, match="NaN or inf|has shape"):
        p.logits(x, dict(weights))  # another weight set: checked, refused
    record("bad-input", f"weights changed after their check ({change})", "ignored (the checked copy runs); "
           "a new dict with them is refused", runner="TENT predict")


# ------------------------------------------------------------------ BTFL stream
@pytest.fixture(scope="module")
def stream_args() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return fit_dle(rng.exponential(size=(200, 16))), fit_dle(rng.exponential(0.3, size=(200, 16)))


def _btfl(stream_args: tuple[np.ndarray, np.ndarray]) -> BTFLStream:
    return BTFLStream(*stream_args, h_local_bar=1.0, h_global_bar=1.5)


_rng = np.random.default_rng(1)
LO, GL, FT = _rng.normal(size=(6, 10)), _rng.normal(size=(6, 10)), _rng.exponential(size=(6, 16))
BTFL_REFUSED = {
    "NaN logit": ((_set(LO, (0, 0), np.nan), GL, FT), "must be finite"),
    "inf feature": ((LO, GL, _set(FT, (0, 2), np.inf)), "features must be finite"),
    "negative feature (not post-ReLU)": ((LO, GL, -FT), "non-negative"),
    "wrong feature dimension": ((LO, GL, FT[:, :3]), "16"),
    "heads with different class counts": ((LO, GL[:, :4], FT), "10"),
    "one class": ((LO[:, :1], GL[:, :1], FT), "2"),
    "text": (("a", "b", "c"), "must be numeric"),
    "empty batch": ((LO[:0], GL[:0], FT[:0]), "empty|C >= 2"),
    "3-D batch": ((LO[None], GL[None], FT[None]), "2-D|got"),
}


@pytest.mark.parametrize("call", ["predict", "predict_one"])
@pytest.mark.parametrize("case", list(BTFL_REFUSED))
def test_btfl_stream_refuses_bad_input(stream_args: tuple[np.ndarray, np.ndarray], case: str, call: str) -> None:
    args, message = BTFL_REFUSED[case]
    if call == "predict_one":
        args = tuple(a if isinstance(a, str) else (a[0] if a.ndim >= 2 and len(a) else a.reshape(-1)) for a in args)
    s = _btfl(stream_args)
    before = (s.alpha, s.beta)
    with pytest.raises(ValueError, match=message) as info:
        getattr(s, call)(*args)
    assert (s.alpha, s.beta) == before  # a refused sample does not move the prior
    record("bad-input", case, f"ValueError: {info.value}", runner=f"BTFL stream {call}")


def test_btfl_constant_stream(stream_args: tuple[np.ndarray, np.ndarray]) -> None:
    """A stream of identical (blank-frame) samples: valid probabilities throughout; per-sample and batched
    processing agree."""
    s, t = _btfl(stream_args), _btfl(stream_args)
    lo, gl, ft = np.zeros((50, 10)), np.zeros((50, 10)), np.zeros((50, 16))
    batched = s.predict(lo, gl, ft)
    single = np.stack([t.predict_one(lo[i], gl[i], ft[i]) for i in range(50)])
    assert np.isfinite(batched).all() and np.allclose(batched.sum(1), 1.0)
    np.testing.assert_allclose(single, batched, atol=1e-12)
    record("bad-input", "stream of 50 identical blank samples", "defined: valid probabilities; batch == one by one",
           runner="BTFL stream")
