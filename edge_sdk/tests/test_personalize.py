"""The SDK personalises exported bundles on onnxruntime exactly as torch does on the server (no torch here): the
runners behind ``open_bundle``, with their per-step details."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_sdk import BundleError, Device, load_bundle, open_bundle
from edge_sdk.safeguard import mix

TOL = 1e-4  # float32 logits after several exported gradient steps


@pytest.fixture(scope="module")
def ref(sdk_fixture: Path) -> dict[str, np.ndarray]:
    with np.load(sdk_fixture / "reference.npz", allow_pickle=False) as arrays:
        return {k: arrays[k] for k in arrays.files}


def device(path: Path, **options: object) -> Device:
    """The bundle's device without its safeguard: these tests hold the adaptation itself to torch."""
    options.setdefault("safeguard", False)
    return open_bundle(path, public_key=(path.parent / "signing_key.pub").read_text().strip(), **options)


def test_fedtta_plus_plus_matches_torch(sdk_fixture: Path, ref: dict[str, np.ndarray]) -> None:
    p = device(sdk_fixture / "fedtta_pp")
    assert p.bundle.device_step == "fedtta_step" and p.bundle.hyperparameters["patience"] >= 1  # FedTTA++
    np.testing.assert_allclose(p.predict(ref["x"]), ref["fedtta_pp_base_logits"], atol=TOL)
    result = p.personalize(ref["x"])
    assert result.steps == int(ref["fedtta_pp_best_step"])
    np.testing.assert_allclose(result.details["entropy_history"], ref["fedtta_pp_history"], atol=1e-5)
    logits = p.predict(ref["x"])
    np.testing.assert_allclose(logits, ref["fedtta_pp_logits"], atol=TOL)
    assert (logits.argmax(-1) == ref["fedtta_pp_logits"].argmax(-1)).mean() == 1.0


def test_tent_matches_torch(sdk_fixture: Path, ref: dict[str, np.ndarray]) -> None:
    p = device(sdk_fixture / "tent")
    assert p.bundle.device_step == "tent_step"
    result = p.personalize(ref["x"])
    history = result.details["entropy_history"]
    assert result.steps == 2 and history[-1] < history[0]
    np.testing.assert_allclose(p.predict(ref["x"]), ref["tent_logits"], atol=TOL)


@pytest.mark.parametrize("bad, message", [
    (lambda x: x.astype(np.float64), "must be float32"),
    (lambda x: x[:, 0], "dimensions"),
    (lambda x: x[:0], "empty batch"),
    (lambda x: np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan, x).astype(np.float32), "NaN or inf"),
])
def test_bad_input_is_refused_before_onnxruntime(sdk_fixture: Path, ref: dict[str, np.ndarray], bad, message: str) -> None:  # type: ignore[no-untyped-def]
    p = device(sdk_fixture / "fedtta_pp")
    with pytest.raises(ValueError, match=message):
        p.personalize(bad(ref["x"]))


def test_tampered_bundle_is_refused(sdk_fixture: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(sdk_fixture / "tent", tmp_path / "tent"))
    onnx_file = next(copy.glob("*.onnx"))
    data = bytearray(onnx_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx_file.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256"):
        load_bundle(copy)


def test_int8_forward_is_smaller_and_agrees(sdk_fixture: Path, ref: dict[str, np.ndarray]) -> None:
    bundle = load_bundle(sdk_fixture / "fedtta_pp")
    fp32, int8 = open_bundle(bundle, safeguard=False), open_bundle(bundle, int8=True, safeguard=False)
    size = {a["name"]: a["size"] for a in bundle.manifest["artifacts"]}
    assert size["forward_int8"] < 0.3 * (size["forward"] + size["params"])
    received = int8.predict(ref["x"])
    agree = (fp32.predict(ref["x"]).argmax(-1) == received.argmax(-1)).mean()
    assert agree >= 0.95, agree
    assert np.abs(received - fp32.predict(ref["x"])).max() > 1e-4  # the int8 graph ran, not the float one
    # personalised weights always run on the fp32 graph (the int8 graph has the received weights baked in)
    int8.personalize(ref["x"])
    np.testing.assert_allclose(int8.predict(ref["x"]), ref["fedtta_pp_logits"], atol=TOL)
    # back on the received model (the safeguard's rollback): its int8 graph again, not the float one
    int8.runner.roll_back()
    np.testing.assert_array_equal(int8.predict(ref["x"]), received)
    # a partial decision mixes the received model's int8 logits with the personalised float ones
    int8.personalize(ref["x"])
    int8.runner.keep_partially()
    np.testing.assert_allclose(int8.predict(ref["x"]), mix(received, ref["fedtta_pp_logits"]), atol=TOL)


def test_odpfl_embeddings_match_torch(sdk_fixture: Path, ref: dict[str, np.ndarray]) -> None:
    np.testing.assert_allclose(device(sdk_fixture / "odpfl_hn").runner.embed(ref["x"]),
                               ref["odpfl_embedding"], atol=1e-5)
    p = device(sdk_fixture / "odpfl_hn_dp").runner
    np.testing.assert_allclose(p.embed(ref["x"]), ref["odpfl_dp_embedding"], atol=1e-5)  # eps = inf: no noise


def test_odpfl_private_embedding_matches_the_server_mechanism(sdk_fixture: Path, ref: dict[str, np.ndarray]) -> None:
    """The device's (eps = 1, delta = 0.01) embedding: noise on the pooled vector of its own |D| = len(x)
    samples, then psi; the same draw as the server-side simulation (ODPFLHN.privatize) from the same rng."""
    p = device(sdk_fixture / "odpfl_hn_dp").runner
    private = p.embed(ref["x"], epsilon=1.0, delta=0.01, rng=np.random.default_rng(5))
    np.testing.assert_allclose(private, ref["odpfl_dp_private_eps1_rng5"], atol=1e-4)
    assert np.abs(private - ref["odpfl_dp_embedding"]).max() > 1e-3  # the noise is there
    fewer = p.embed(ref["x"][:32], epsilon=1.0, delta=0.01, rng=np.random.default_rng(5))
    exact = p.embed(ref["x"][:32])
    assert np.linalg.norm(fewer - exact) > np.linalg.norm(private - ref["odpfl_dp_embedding"])  # smaller |D|: more noise


def test_odpfl_privacy_needs_a_dp_bundle_and_a_valid_budget(sdk_fixture: Path, ref: dict[str, np.ndarray]) -> None:
    with pytest.raises(BundleError, match="not the DP encoder"):
        device(sdk_fixture / "odpfl_hn").runner.embed(ref["x"], epsilon=1.0)
    p = device(sdk_fixture / "odpfl_hn_dp").runner
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        p.embed(ref["x"], epsilon=0.0)
    with pytest.raises(ValueError, match="delta must lie in"):
        p.embed(ref["x"], epsilon=1.0, delta=1.5)
