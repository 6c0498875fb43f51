"""BTFL served end to end: a real coordinator process (uvicorn) trains BTFL on the embedded digits, serves its
bundle, aggregates DLE uploads with the bundle's training-time DLE, and the streaming example runs BTFL on a
device (onnxruntime + numpy, no torch) against it."""
from __future__ import annotations

import html
import io
import json
import subprocess
import sys
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest

from coordinator_proc import ADMIN, REPO, UNSERVED_BTFL, Coordinator, auth, join, start, start_copy
import edge_sdk
from edge_sdk import _btfl as btfl
from fl_server.device_samples import client_samples
from fl_server.diagnostics import scored_model
from fl_server.recipes.run import client_data

pytestmark = pytest.mark.timeout(600)
SHARE = 0.02  # FL_SERVE_DLE_SOURCE_SHARE's default


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    coord = start(tmp_path_factory.mktemp("btfl") / "store", methods="BTFL", rounds=3, workers=1)
    coord.wait_bundles(1)
    yield coord
    coord.stop()


def _join(server: Coordinator) -> dict:
    return join(server.url, "BTFL")


def _auth(client: dict) -> dict[str, str]:
    return auth(client["token"])


def _bundle_dle(server: Coordinator, manifest: dict) -> tuple[np.ndarray, int]:
    url = next(a["url"] for a in manifest["artifacts"] if a["name"] == "btfl")
    with np.load(io.BytesIO(httpx.get(server.url + url, timeout=10).content)) as arrays:
        return arrays["global_dle"], int(arrays["dle_clients"][0])


def test_btfl_bundle_and_training_dle(server: Coordinator) -> None:
    c = _join(server)
    m = c["manifest"]
    assert m["method"] == "BTFL" and "BTFL" in c["methods"]
    assert {"features", "forward", "params", "btfl"} <= {a["name"] for a in m["artifacts"]}
    dle, clients = _bundle_dle(server, m)
    assert dle.ndim == 2 and dle.shape[1] == m["hyperparameters"]["dle_levels"]
    run = json.loads(next(server.store.glob("jobs/*/run/run.json")).read_text())
    assert clients == len(client_data(run).train) > 1  # the bundle's DLE counts as its training clients
    np.testing.assert_allclose(dle.sum(1), 1.0, atol=1e-12)  # rows are level frequencies
    view = httpx.get(f"{server.url}/v1/btfl/dle", headers=_auth(c), timeout=10).json()
    assert view["base"] == {"bundle_id": m["bundle_id"], "clients": clients}
    # the job's accuracy is the received model's (a device personalises on its own labels), and says so
    job = next(j for j in httpx.get(f"{server.url}/v1/jobs", headers=auth(ADMIN), timeout=10).json()
               if j["spec"]["method"] == "BTFL")
    assert (job["test_of"], job["safeguard"]) == ("received", None), job
    # and the job measured a device's: labeled on a random half of each new client, scored on the other half
    bundle = next(server.store.glob("jobs/*/bundle"))
    samples = client_samples(json.loads((bundle / "manifest.json").read_text()))
    x, y, offsets = samples["x"], samples["y"], samples["offsets"]
    accuracies, rng = [], np.random.default_rng(0)
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        rows = lo + rng.permutation(hi - lo)
        with warnings.catch_warnings():  # the job's own export, unsigned (the store signs what it serves)
            warnings.simplefilter("ignore")
            device = edge_sdk.open_bundle(bundle)
        device.personalize(x[rows[:(hi - lo) // 2]], y[rows[:(hi - lo) // 2]])
        accuracies.append((device.predict(x[rows[(hi - lo) // 2:]]).argmax(1) == y[rows[(hi - lo) // 2:]]).mean())
    assert abs(job["labeled_device_accuracy"] - np.mean(accuracies)) < 1e-9, (job, accuracies)
    assert job["labeled_device_accuracy"] > job["new_client_accuracy"] + 0.1  # what the received model's hid
    kept = html.escape(scored_model("received", None, "BTFL", job["labeled_device_accuracy"]))  # the summary's words
    assert f"% ({kept})</td>" in httpx.get(f"{server.url}/", timeout=10).text


def test_dle_upload_changes_the_served_global_dle(server: Coordinator) -> None:
    a, b = _join(server), _join(server)
    base, n_base = _bundle_dle(server, a["manifest"])
    url = f"{server.url}/v1/btfl/dle"
    before = httpx.get(url, headers=_auth(b), timeout=10).json()
    assert before["clients"] == 0  # nothing uploaded yet: the served global DLE is the training clients'
    np.testing.assert_allclose(before["global_dle"], base, atol=1e-12)
    rng = np.random.default_rng(1)
    dle_a = btfl.fit_dle(rng.exponential(2.0, size=(40, base.shape[0])))
    dle_b = btfl.fit_dle(rng.exponential(0.3, size=(60, base.shape[0])))
    # a and b joined from one address (open mode: their source): together they weigh at most 0.02 * n_base
    cap = SHARE * n_base
    served = a["manifest"]["bundle_id"]  # the bundle whose features each DLE was fitted on
    r = httpx.post(url, json={"freqs": dle_a.tolist(), "num_samples": 40, "bundle_id": served}, headers=_auth(a),
                   timeout=10)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["global_dle"], btfl.average_dles([base, dle_a], [n_base, cap]), atol=1e-12)
    np.testing.assert_allclose(r.json()["others_dle"], base, atol=1e-12)  # a's global DLE: everyone else's
    r = httpx.post(url, json={"freqs": dle_b.tolist(), "num_samples": 60, "bundle_id": served}, headers=_auth(b),
                   timeout=10)
    assert r.json()["clients"] == 2
    np.testing.assert_allclose(r.json()["global_dle"],
                               btfl.average_dles([base, dle_a, dle_b], [n_base, cap / 2, cap / 2]), atol=1e-12)
    seen_by_a = httpx.get(url, headers=_auth(a), timeout=10).json()  # b's upload reached a's global DLE
    np.testing.assert_allclose(seen_by_a["others_dle"], btfl.average_dles([base, dle_b], [n_base, cap / 2]),
                               atol=1e-12)
    wrong = np.full((base.shape[0] + 1, base.shape[1]), 1.0 / base.shape[1])
    bad = httpx.post(url, json={"freqs": wrong.tolist(), "num_samples": 5, "bundle_id": served}, headers=_auth(a),
                     timeout=10)
    assert bad.status_code == 422  # must match the bundle's [D, levels]
    # the served bundle's DLE is taken, another's would mix features
    same = httpx.post(url, json={"freqs": dle_a.tolist(), "num_samples": 40, "bundle_id": served},
                      headers=_auth(a), timeout=10)
    assert same.status_code == 200 and same.json()["clients"] == 2, same.text
    older = "0" * 64
    other = httpx.post(url, json={"freqs": dle_a.tolist(), "num_samples": 40, "bundle_id": older},
                       headers=_auth(a), timeout=10)
    assert other.status_code == 409 and other.json()["detail"] == (
        f"this coordinator serves BTFL bundle {served}; a DLE fitted on bundle {older}'s features would be "
        f"averaged with its clients': download the served bundle and personalise again")


def test_stream_example_runs_btfl(server: Coordinator, tmp_path: Path) -> None:
    from fl_server.cli import main as fl_server

    summary, png, data = tmp_path / "summary.json", tmp_path / "btfl.png", tmp_path / "device.npz"
    assert fl_server(["device-data", server.url, "--method", "btfl", "--per-phase", "60", "--out", str(data)]) == 0
    r = subprocess.run([sys.executable, str(REPO / "examples" / "stream_inference.py"), "--server", server.url,
                        "--method", "btfl", "--cache", str(tmp_path / "device"), "--json", str(summary),
                        "--png", str(png), "--data", str(data)], capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    s = json.loads(summary.read_text())
    assert s["bundle_method"] == "BTFL" and s["torch_imported"] is False and s["fl_server_imported"] is False
    info = s["btfl"]
    assert info["dle_base"] is not None and info["dle_uploaders"] >= 1
    e = info["mean_e"]
    assert all(0.0 <= v <= 1.0 for v in e.values())
    # BTFL's point: classes the device never had (EXD) shift weight to the global head
    assert e["external classes"] > e["in-distribution"]
    # the local head, trained on the device's own classes, beats the received global model on them
    assert s["accuracy"]["in-distribution"] > s["accuracy_received_model"]["in-distribution"]
    assert png.stat().st_size > 0


def test_btfl_device_batch_logits_follow_the_stream_order(server: Coordinator, tmp_path: Path) -> None:
    """BTFLParticipant.logits on a batch (one feature pass, the stream's batch update) = one sample at a time."""
    from edge_sdk import EdgeClient
    from edge_sdk._btfl import BTFLParticipant
    from fl_server.data import load_dataset

    digits = load_dataset("digits")
    key = httpx.get(f"{server.url}/v1/signing-key", timeout=10).json()["public_key"]
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=key) as client:
        bundle = client.download(client.join("BTFL").manifest)
    device = BTFLParticipant(bundle)
    device.fit(digits.x[:200], digits.y[:200])
    stream_x = digits.x[200:260]
    device.start()
    batched = device.logits(stream_x)
    e_batched = device.stream.last_weights.copy()  # type: ignore[union-attr]
    device.start()
    one_by_one = np.concatenate([device.logits(stream_x[i:i + 1]) for i in range(len(stream_x))])
    e_one_by_one = []
    device.start()
    for i in range(len(stream_x)):
        device.predict_one(stream_x[i:i + 1])
        e_one_by_one.append(device.stream.last_weight)  # type: ignore[union-attr]
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5)  # float32 features of batch 60 vs batch 1
    np.testing.assert_allclose(e_batched, e_one_by_one, atol=1e-5)
    assert len(set(np.round(e_batched, 3))) > 5  # the prior moves along the stream: the order matters


def test_a_dle_of_another_shape_stored_before_the_btfl_bundle_does_not_break_the_view(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without a BTFL bundle any shape is accepted; once a BTFL bundle of another shape is served, that row is
    left out of the aggregate (it used to make every GET and POST of /v1/btfl/dle a 500)."""
    coord = start(tmp_path_factory.mktemp("btfl-late") / "store", methods="TENT", rounds=1, workers=1)
    try:
        coord.wait_bundles(1)
        early = join(coord.url)  # no BTFL bundle yet
        url = f"{coord.url}/v1/btfl/dle"
        odd = btfl.fit_dle(np.random.default_rng(0).exponential(size=(20, 3)))  # [3, 2]: not the bundle's shape
        assert httpx.post(url, json={"freqs": odd.tolist(), "num_samples": 20, "bundle_id": UNSERVED_BTFL},
                          headers=_auth(early),
                          timeout=10).status_code == 200
        job = httpx.post(f"{coord.url}/v1/jobs", json={"method": "BTFL", "rounds": 2}, headers=auth(ADMIN), timeout=10)
        assert job.status_code == 201, job.text
        coord.wait_bundles(2)
        view = httpx.get(url, headers=_auth(early), timeout=10)
        assert view.status_code == 200, view.text
        body = view.json()
        assert body["clients"] == 0 and body["base"] is not None and body["dims"] != 3  # the odd row is left out
        late = _join(coord)
        dle = btfl.fit_dle(np.random.default_rng(1).exponential(size=(40, body["dims"])))
        r = httpx.post(url, json={"freqs": dle.tolist(), "num_samples": 40, "bundle_id": body["base"]["bundle_id"]},
                       headers=_auth(late), timeout=10)
        assert r.status_code == 200 and r.json()["clients"] == 1, r.text
    finally:
        coord.stop()


def test_one_device_interface_runs_btfl_and_fedthe(server: Coordinator, tmp_path: Path) -> None:
    """edge_sdk.open_bundle on the served BTFL bundle: BTFL (the DLE exchanged with the coordinator) gives what
    the BTFL device class gives; FedTHE on the same bundle gives fedthe_predict over the whole stream, the
    feature history carried from one predict call to the next."""
    from edge_sdk import EdgeClient, log_softmax, open_bundle
    from edge_sdk._btfl import BTFLParticipant
    from edge_sdk._fedthe import fedthe_predict
    from fl_server.data import load_dataset

    digits = load_dataset("digits")
    x, y, stream = digits.x[:200], digits.y[:200], digits.x[200:260]
    key = httpx.get(f"{server.url}/v1/signing-key", timeout=10).json()["public_key"]
    with EdgeClient(server.url, cache_dir=tmp_path, public_key=key) as client:
        bundle = client.download(client.join("BTFL").manifest)
        device = open_bundle(bundle, client=client)
        assert device.method == "BTFL" and device.needs_labels
        with pytest.raises(ValueError, match=r"call personalize\(x, y\)"):
            device.personalize(x)
        result = device.personalize(x, y)
        assert result.details["dle_clients"] >= 1 and result.details["dle_base"] is not None
        others = httpx.get(f"{server.url}/v1/btfl/dle", headers=auth(client.token), timeout=10).json()["others_dle"]
    reference = BTFLParticipant(bundle)
    fit = reference.fit(x, y)
    reference.start(np.asarray(others))
    np.testing.assert_allclose(device.predict(stream), reference.logits(stream), atol=1e-9)
    assert 0.0 <= device.global_weight <= 1.0  # type: ignore[operator]

    the = open_bundle(bundle, method="FedTHE")
    assert the.method == "FedTHE" and the.global_weight is None
    the.personalize(x, y)
    streamed = np.concatenate([the.predict(stream[:30]), the.predict(stream[30:])])
    z, g = reference.features(stream)
    mu_global = bundle.weights("btfl")["mu_global"]
    logits, _ = fedthe_predict(g, z @ fit.local_head.T, z, reference.features(x)[0].mean(0), mu_global, 30)
    np.testing.assert_allclose(streamed, log_softmax(logits), atol=1e-9)
    received = open_bundle(bundle, method="none")
    assert (streamed.argmax(1) == digits.y[200:260]).mean() >= (received.predict(stream).argmax(1)
                                                                 == digits.y[200:260]).mean() - 0.1


def _moved(before: list[list[float]], after: list[list[float]]) -> float:
    """The largest change of a row of the global DLE, relative to the row (L1: a row is a distribution)."""
    b, a = np.asarray(before), np.asarray(after)
    return float((np.abs(a - b).sum(axis=1) / np.abs(b).sum(axis=1)).max())


def _poison(dims: int, levels: int) -> list[list[float]]:
    rows = np.zeros((dims, levels))
    rows[:, -1] = 1.0  # every row's mass on its last level: what flipped all 200 rows before
    return rows.tolist()


def test_with_the_defaults_one_token_or_one_address_moves_no_row_by_5_percent(
        server: Coordinator, tmp_path: Path) -> None:
    """Issue 50, D8 and N12. With the settings a user gets (fl-server serve, the image): joining needs an
    enrollment token, and one fleet token uploading its maximum of poisoned DLEs moves no row of the global DLE by
    5% of its value; nor does one address of an open coordinator. The operator revokes the token (its clients'
    DLEs leave) and one client (its DLE leaves), over the API and with fl-server revoke."""
    from fl_server.cli import main

    coord = start_copy(server.store, tmp_path / "store", open_enrollment=False)  # the coordinator's defaults
    try:
        url = coord.url
        r = httpx.post(f"{url}/v1/clients", json={"method": "BTFL"}, timeout=30)
        assert r.status_code == 401, r.text  # an address alone joins nothing
        fleet = httpx.post(f"{url}/v1/enrollments", json={"uses": 40}, headers=auth(ADMIN), timeout=30).json()
        clients = [httpx.post(f"{url}/v1/clients", json={"method": "BTFL", "enrollment_token": fleet["token"]},
                              timeout=30).json() for _ in range(20)]
        dle_url = f"{url}/v1/btfl/dle"
        before = httpx.get(dle_url, headers=_auth(clients[0]), timeout=30).json()
        poison = {"freqs": _poison(before["dims"], before["levels"]), "num_samples": 10**9,
                  "bundle_id": before["base"]["bundle_id"]}
        codes = [httpx.post(dle_url, json=poison, headers=_auth(c), timeout=30).status_code for c in clients]
        assert codes == [200] * 16 + [403] * 4  # FL_SERVE_DLE_PER_SOURCE (16)
        after = httpx.get(dle_url, headers=_auth(clients[0]), timeout=30).json()
        assert after["clients"] == before["clients"] + 16
        assert 0.01 < _moved(before["global_dle"], after["global_dle"]) < 0.05  # was 1.0: every row flipped

        revoked = httpx.delete(f"{url}/v1/enrollments/{fleet['id']}", headers=auth(ADMIN), timeout=30)
        assert revoked.json() == {"id": fleet["id"], "clients_revoked": 20, "dles_removed": 16}, revoked.text
        assert httpx.get(dle_url, headers=_auth(clients[0]), timeout=30).status_code == 401
        assert httpx.post(f"{url}/v1/clients", json={"enrollment_token": fleet["token"]}, timeout=30).json() == {
            "detail": "this enrollment token is used up, expired or revoked; ask the operator for another"}
        fresh = httpx.post(f"{url}/v1/enrollments", json={"uses": 1}, headers=auth(ADMIN), timeout=30).json()
        reader = httpx.post(f"{url}/v1/clients", json={"method": "BTFL", "enrollment_token": fresh["token"]},
                            timeout=30).json()
        restored = httpx.get(dle_url, headers=_auth(reader), timeout=30).json()
        np.testing.assert_allclose(restored["global_dle"], before["global_dle"], atol=1e-9)
        assert httpx.delete(f"{url}/v1/enrollments/nope", headers=auth(ADMIN), timeout=30).status_code == 404
        assert httpx.delete(f"{url}/v1/clients/{reader['client_id']}", headers=_auth(reader),
                            timeout=30).status_code == 403  # admin only
    finally:
        coord.stop()

    # one address of an open coordinator (the module's server: FL_SERVE_ENROLLMENT=open, every join from here)
    dle_url = f"{server.url}/v1/btfl/dle"
    sybils = [_join(server) for _ in range(20)]
    before = httpx.get(dle_url, headers=_auth(sybils[0]), timeout=30).json()
    poison = {"freqs": _poison(before["dims"], before["levels"]), "num_samples": 10**9,
              "bundle_id": before["base"]["bundle_id"]}
    accepted = [c for c in sybils if httpx.post(dle_url, json=poison, headers=_auth(c), timeout=30).status_code == 200]
    after = httpx.get(dle_url, headers=_auth(sybils[0]), timeout=30).json()
    assert accepted and _moved(before["global_dle"], after["global_dle"]) < 0.05
    out = main(["revoke", "--server", server.url, "--client", accepted[0]["client_id"], "--admin-token", ADMIN])
    assert out == 0 and httpx.get(dle_url, headers=_auth(accepted[0]), timeout=30).status_code == 401
    left = httpx.get(dle_url, headers=_auth(sybils[-1]), timeout=30).json()
    assert left["clients"] == after["clients"] - 1


def test_ten_tokens_together_move_no_row_by_5_percent_and_an_honest_upload_still_counts(
        server: Coordinator, tmp_path: Path) -> None:
    """Sybil: the bound on one source's weight was per source, so ten enrollment tokens each uploading a poisoned
    DLE had ten times it (33% of a row). All uploads together now weigh at most FL_SERVE_DLE_UPLOADS_SHARE of
    the training clients: the ten move no row by 5%, and an honest device's upload still moves the aggregate."""
    coord = start_copy(server.store, tmp_path / "store", open_enrollment=False)
    try:
        url, dle_url = coord.url, f"{coord.url}/v1/btfl/dle"

        def enrolled() -> dict:
            token = httpx.post(f"{url}/v1/enrollments", json={"uses": 1}, headers=auth(ADMIN), timeout=30).json()
            return httpx.post(f"{url}/v1/clients", json={"method": "BTFL", "enrollment_token": token["token"]},
                              timeout=30).json()

        sybils, honest = [enrolled() for _ in range(10)], enrolled()
        base = _bundle_dle(coord, honest["manifest"])[0].tolist()  # the training federation's DLE
        before = httpx.get(dle_url, headers=_auth(honest), timeout=30).json()  # (with the module's uploads)
        poison = {"freqs": _poison(before["dims"], before["levels"]), "num_samples": 10**9,
                  "bundle_id": before["base"]["bundle_id"]}
        codes = [httpx.post(dle_url, json=poison, headers=_auth(c), timeout=30).status_code for c in sybils]
        assert codes == [200] * 10
        after = httpx.get(dle_url, headers=_auth(honest), timeout=30).json()
        assert after["clients"] == before["clients"] + 10
        assert _moved(base, after["global_dle"]) < 0.05  # was 0.33 with ten tokens
        uniform = np.full((before["dims"], before["levels"]), 1.0 / before["levels"])
        r = httpx.post(dle_url, json={"freqs": uniform.tolist(), "num_samples": 50,
                                      "bundle_id": before["base"]["bundle_id"]}, headers=_auth(honest), timeout=30)
        assert r.status_code == 200 and r.json()["clients"] == before["clients"] + 11
        assert _moved(after["global_dle"], r.json()["global_dle"]) > 1e-4  # the honest upload has an effect
        assert _moved(base, r.json()["global_dle"]) < 0.05
    finally:
        coord.stop()
