"""One device interface (edge_sdk.open_bundle) for every method, on real exported bundles: the same calls give
what torch computed on the server (reference.npz), without torch."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edge_sdk
from edge_sdk._btfl import BTFLParticipant
from edge_sdk._bundle import BundleError, load_bundle
from edge_sdk._fedthe import fedthe_predict
from edge_sdk._numerics import log_softmax
from edge_sdk.safeguard import SafeguardRule, mix

TOL = 1e-4  # float32 logits after several exported gradient steps


@pytest.fixture(scope="module")
def ref(sdk_fixture: Path) -> dict[str, np.ndarray]:
    with np.load(sdk_fixture / "reference.npz", allow_pickle=False) as arrays:
        return {k: arrays[k] for k in arrays.files}


@pytest.fixture(scope="module")
def key(sdk_fixture: Path) -> str:
    return (sdk_fixture / "signing_key.pub").read_text().strip()


@pytest.mark.parametrize("name, method, adapted", [("fedtta_pp", "FedTTA++", "fedtta_pp_logits"),
                                                   ("tent", "TENT", "tent_logits"),
                                                   ("fedicon", "FedICON", "fedicon_logits")])
def test_one_interface_personalises_like_torch(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray], name: str,
                                               method: str, adapted: str) -> None:
    device = edge_sdk.open_bundle(sdk_fixture / name, public_key=key, safeguard=False)  # the adaptation itself
    assert device.method == method and not device.needs_labels and device.preprocess is None
    before = device.predict(ref["x"])
    result = device.personalize(ref["x"])
    assert result.method == method and result.samples == len(ref["x"]) and result.steps >= 1
    np.testing.assert_allclose(device.predict(ref["x"]), ref[adapted], atol=TOL)
    assert np.abs(device.predict(ref["x"]) - before).max() > 1e-3  # personalising changed the model
    streamed = np.stack(list(device.stream(ref["x"][:5])))
    np.testing.assert_allclose(streamed, ref[adapted][:5], atol=TOL)


@pytest.mark.parametrize("name", ["fedtta_pp", "tent", "fedicon"])
def test_the_bundles_safeguard_decides_after_personalising(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray],
                                                           name: str) -> None:
    """Every personalising bundle carries its method's rule; personalize reports the decision and its evidence,
    and the device then predicts with what it decided: the received model exactly after a rollback, the
    personalised one, or the mean of both models' probabilities (partial)."""
    device = edge_sdk.open_bundle(sdk_fixture / name, public_key=key)
    rule = device.bundle.safeguard
    assert rule is not None and device.safeguard == rule
    received = device.predict(ref["x"])
    result = device.personalize(ref["x"])
    decision = result.safeguard
    assert decision is not None and decision.rule == rule.name
    assert decision.action == rule.action(decision.evidence)
    if rule.keeps_received:  # keeps the received model whatever: nothing is adapted
        assert decision.evidence == {} and result.steps == 0 and "always keeps" in result.details["skipped"]
        assert decision.message == "safeguard: kept the received model (rule rollback)"
    else:
        assert 0.0 <= decision.evidence["disagreement"] <= 1.0 and decision.message.startswith("safeguard: ")
    unguarded = edge_sdk.open_bundle(sdk_fixture / name, public_key=key, safeguard=False)
    unguarded.personalize(ref["x"])
    adapted = unguarded.predict(ref["x"])
    expected = {"received": received, "personalised": adapted, "partial": mix(received, adapted)}[decision.action]
    np.testing.assert_allclose(device.predict(ref["x"]), expected, atol=TOL)
    for action, spec in (("received", SafeguardRule("rollback")), ("partial", SafeguardRule("rollback", partial=True))):
        forced = edge_sdk.open_bundle(sdk_fixture / name, public_key=key, safeguard=spec)
        assert forced.personalize(ref["x"]).safeguard.action == action  # type: ignore[union-attr]
        want = received if action == "received" else mix(received, adapted)
        np.testing.assert_allclose(forced.predict(ref["x"]), want, atol=TOL)


def test_method_none_is_the_received_model(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray]) -> None:
    device = edge_sdk.open_bundle(load_bundle(sdk_fixture / "fedtta_pp", public_key=key), method="none")
    assert device.method == "none"
    assert device.personalize(ref["x"]).steps == 0
    np.testing.assert_allclose(device.predict(ref["x"]), ref["fedtta_pp_base_logits"], atol=TOL)


def test_odpfl_hn_needs_the_coordinator(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray]) -> None:
    device = edge_sdk.open_bundle(sdk_fixture / "odpfl_hn", public_key=key, safeguard=False)
    assert device.method == "ODPFL-HN"
    with pytest.raises(BundleError, match=r"open_bundle\(bundle, client=EdgeClient\)"):
        device.personalize(ref["x"])
    # its declared rule (rollback) keeps the received model whatever the weights: no embedding leaves the device
    declared = edge_sdk.open_bundle(sdk_fixture / "odpfl_hn", public_key=key)
    assert declared.safeguard is not None and declared.safeguard.name == "rollback"
    before = declared.predict(ref["x"])
    result = declared.personalize(ref["x"])
    assert result.steps == 0 and result.safeguard is not None and result.safeguard.action == "received"
    np.testing.assert_array_equal(declared.predict(ref["x"]), before)


def test_btfl_and_fedthe_on_a_served_btfl_bundle(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray]) -> None:
    """The BTFL bundle as the coordinator serves it: its features graph gives what torch gave; BTFL (the bundle's
    training DLE, no coordinator) gives what the BTFL device class gives; FedTHE's stream, cut over two predict
    calls, is fedthe_predict over the whole stream (the feature history carried), and beats the received model."""
    x, y = ref["x"], ref["y"]
    labeled, half = len(x) // 2, len(x) * 3 // 4
    bundle = load_bundle(sdk_fixture / "btfl", public_key=key)
    reference = BTFLParticipant(bundle)
    z, g = reference.features(x)
    np.testing.assert_allclose(z, ref["btfl_features"], atol=TOL)
    np.testing.assert_allclose(g, ref["btfl_global_logits"], atol=TOL)
    fit = reference.fit(x[:labeled], y[:labeled])

    btfl = edge_sdk.open_bundle(bundle)
    assert btfl.method == "BTFL" and btfl.needs_labels
    assert btfl.personalize(x[:labeled], y[:labeled]).samples == labeled
    reference.start()
    np.testing.assert_allclose(btfl.predict(x[labeled:]), reference.logits(x[labeled:]), atol=1e-9)
    assert 0.0 <= btfl.global_weight <= 1.0  # type: ignore[operator]

    the = edge_sdk.open_bundle(bundle, method="FedTHE")
    assert the.method == "FedTHE" and the.needs_labels and the.global_weight is None
    the.personalize(x[:labeled], y[:labeled])
    streamed = np.concatenate([the.predict(x[labeled:half]), the.predict(x[half:])])
    zs, gs = z[labeled:], g[labeled:]
    logits, w = fedthe_predict(gs, zs @ fit.local_head.T, zs, z[:labeled].mean(0),
                               bundle.weights("btfl")["mu_global"], half - labeled)
    np.testing.assert_allclose(streamed, log_softmax(logits), atol=1e-9)
    assert np.abs(w - 0.5).max() > 0.05  # the ensemble weights moved
    received = edge_sdk.open_bundle(bundle, method="none").predict(x[labeled:])
    assert (streamed.argmax(1) == y[labeled:]).mean() > (received.argmax(1) == y[labeled:]).mean()


@pytest.mark.parametrize("method, message", [("BTFL", "cannot run BTFL"),
                                             ("FedTHE", "FedTHE runs on bundles whose device step is .btfl.")])
def test_a_method_the_bundle_cannot_run_is_refused(sdk_fixture: Path, key: str, method: str, message: str) -> None:
    with pytest.raises(BundleError, match=message):
        edge_sdk.open_bundle(sdk_fixture / "tent", public_key=key, method=method)


def test_bad_input_is_refused(sdk_fixture: Path, key: str, ref: dict[str, np.ndarray]) -> None:
    device = edge_sdk.open_bundle(sdk_fixture / "tent", public_key=key)
    with pytest.raises(ValueError, match="must be float32"):
        device.personalize(ref["x"].astype(np.float64))


def test_labels_and_a_privacy_budget_are_checked_never_ignored(sdk_fixture: Path, key: str,
                                                               ref: dict[str, np.ndarray]) -> None:
    """Labels for a method that learns without them, labels that are not one class per sample, and a privacy
    budget that is none are refused with one line, also where the safeguard's rule would adapt nothing."""
    x, y = ref["x"], ref["y"]
    tent = edge_sdk.open_bundle(sdk_fixture / "tent", public_key=key)
    with pytest.raises(ValueError, match=r"^TENT takes no labels: call personalize\(x\)"):
        tent.personalize(x, y)
    with pytest.raises(ValueError, match=r"^epsilon must be > 0 \(math.inf for no privacy\), got -3$"):
        tent.personalize(x, epsilon=-3)
    with pytest.raises(ValueError, match=r"^epsilon must be > 0 \(math.inf for no privacy\), got True$"):
        tent.personalize(x, epsilon=True)
    tent.personalize(x, epsilon=np.float32(1.0), delta=np.float64(1e-5))  # numpy's scalars are numbers
    rollback = edge_sdk.open_bundle(sdk_fixture / "odpfl_hn", public_key=key)  # rule 'rollback': no runner call
    assert rollback.safeguard is not None and rollback.safeguard.keeps_received
    with pytest.raises(ValueError, match=r"^delta must lie in \(0, 1\), got 2$"):
        rollback.personalize(x, epsilon=1.0, delta=2)
    btfl = edge_sdk.open_bundle(sdk_fixture / "btfl", public_key=key)
    with pytest.raises(ValueError, match=rf"^y must be \[N\] integer class labels, one per sample of x \(N={len(x)}\), "
                                         rf"got int64 of shape \[{len(x) - 1}\]$"):
        btfl.personalize(x, y[:-1].astype(np.int64))
    with pytest.raises(ValueError, match="got float32 of shape"):
        btfl.personalize(x, y.astype(np.float32))


def test_raw_images_go_through_the_manifests_preprocessing(sdk_fixture: Path, ref: dict[str, np.ndarray],
                                                           tmp_path: Path) -> None:
    """A bundle whose manifest carries a preprocess block takes raw uint8 NHWC images: the device applies it and
    then runs exactly what the float32 NCHW input of the same images gives."""
    import json
    import shutil
    import warnings

    from edge_sdk._bundle import UnverifiedSignatureWarning
    from edge_sdk._preprocess import Preprocess

    root = Path(shutil.copytree(sdk_fixture / "tent", tmp_path / "tent"))
    (root / "manifest.sig").unlink()
    manifest = json.loads((root / "manifest.json").read_text())
    pre = Preprocess(layout="NHWC", scale=1 / 255)
    manifest["preprocess"] = pre.to_dict()
    (root / "manifest.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedSignatureWarning)
        device = edge_sdk.open_bundle(root, safeguard=False)
    assert device.preprocess == pre
    raw = np.round(ref["x"].transpose(0, 2, 3, 1) * 255).astype(np.uint8)  # real images as a camera gives them
    model_input = raw.transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255)
    plain = edge_sdk.open_bundle(load_bundle(sdk_fixture / "tent", public_key=(sdk_fixture / "signing_key.pub")
                                             .read_text().strip()), safeguard=False)
    np.testing.assert_allclose(device.predict(raw), plain.predict(model_input), atol=1e-6)
    device.personalize(raw)
    plain.personalize(model_input)
    np.testing.assert_allclose(device.predict(raw), plain.predict(model_input), atol=1e-5)
    with pytest.raises(ValueError, match="batch of images"):
        device.predict(raw[0, :, :, 0].ravel())
