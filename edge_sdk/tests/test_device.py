"""One device interface (edge_sdk.open_bundle) for every method, on real exported bundles: the same calls give
what torch computed on the server (reference.npz), without torch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edge_sdk
from edge_sdk.bundle import BundleError, load_bundle

TOL = 1e-4  # float32 logits after several exported gradient steps


@pytest.fixture(scope="module")
def ref(sdk_fixture: Path) -> dict[str, np.ndarray]:
    with np.load(sdk_fixture / "reference.npz", allow_pickle=False) as arrays:
        return {k: arrays[k] for k in arrays.files}


@pytest.fixture(scope="module")
def key(sdk_fixture: Path) -> str:
    return (sdk_fixture / "signing_key.pub").read_text().strip()


@pytest.mark.parametrize("name, method, adapted", [("fedtta_pp", "FedTTA++", "fedtta_pp_logits"),
                                                   ("tent", "TENT", "tent_logits")])
def test_one_interface_personalises_like_torch(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray], name: str,
                                               method: str, adapted: str) -> None:
    device = edge_sdk.open_bundle(sdk_fixture / name, public_key=key)
    assert device.method == method and not device.needs_labels and device.preprocess is None
    before = device.predict(ref["x"])
    result = device.personalize(ref["x"])
    assert result.method == method and result.samples == len(ref["x"]) and result.steps >= 1
    np.testing.assert_allclose(device.predict(ref["x"]), ref[adapted], atol=TOL)
    assert np.abs(device.predict(ref["x"]) - before).max() > 1e-3  # personalising changed the model
    streamed = np.stack(list(device.stream(ref["x"][:5])))
    np.testing.assert_allclose(streamed, ref[adapted][:5], atol=TOL)


def test_method_none_is_the_received_model(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray]) -> None:
    device = edge_sdk.open_bundle(load_bundle(sdk_fixture / "fedtta_pp", public_key=key), method="none")
    assert device.method == "none"
    assert device.personalize(ref["x"]).steps == 0
    np.testing.assert_allclose(device.predict(ref["x"]), ref["fedtta_pp_base_logits"], atol=TOL)


def test_odpfl_hn_needs_the_coordinator(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray]) -> None:
    device = edge_sdk.open_bundle(sdk_fixture / "odpfl_hn", public_key=key)
    assert device.method == "ODPFL-HN"
    with pytest.raises(BundleError, match=r"open_bundle\(bundle, client=EdgeClient\)"):
        device.personalize(ref["x"])


@pytest.mark.parametrize("method, message", [("BTFL", "cannot run BTFL"),
                                             ("FedTHE", "FedTHE runs on a BTFL bundle")])
def test_a_method_the_bundle_cannot_run_is_refused(sdk_fixture: Path, key: str, method: str, message: str) -> None:
    with pytest.raises(BundleError, match=message):
        edge_sdk.open_bundle(sdk_fixture / "tent", public_key=key, method=method)


def test_bad_input_is_refused(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray]) -> None:
    device = edge_sdk.open_bundle(sdk_fixture / "tent", public_key=key)
    with pytest.raises(ValueError, match="must be float32"):
        device.personalize(ref["x"].astype(np.float64))
