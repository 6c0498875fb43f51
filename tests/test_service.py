"""Integration tests of the coordinator: a real uvicorn process over HTTP (httpx), real training jobs on
the embedded digits, real onnxruntime on the served artifacts."""
from __future__ import annotations

import base64
import hashlib
import html
import json
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest

from coordinator_proc import ADMIN, UNSERVED_BTFL, Coordinator, auth, join, start, start_copy
from edge_sdk import _btfl as btfl, _tensors as tensors
from fl_server.diagnostics import scored_model

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    store = tmp_path_factory.mktemp("coord") / "store"
    coord = start(store)
    early = httpx.post(f"{coord.url}/v1/clients", json={}, timeout=10)  # nothing trained yet
    early_unknown = httpx.get(f"{coord.url}/v1/manifest", params={"method": "FedTTA++"}, timeout=10)  # no job
    early_training = httpx.get(f"{coord.url}/v1/manifest", params={"method": "ODPFL-HN"}, timeout=10)
    coord.wait_bundles(2)
    coord.early = early  # type: ignore[attr-defined]
    coord.early_unknown, coord.early_training = early_unknown, early_training  # type: ignore[attr-defined]
    yield coord
    coord.stop()


@pytest.fixture(scope="module")
def client(server: Coordinator) -> dict:
    return join(server.url, "ODPFL-HN")


def test_join_before_bundle_is_503_with_retry_after(server: Coordinator) -> None:
    r = server.early  # type: ignore[attr-defined]
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) > 0
    assert {j["method"] for j in r.json()["detail"]["jobs"]} == {"TENT", "ODPFL-HN"}


def test_a_method_no_job_produces_is_404_naming_the_coming_methods(server: Coordinator) -> None:
    """Before any bundle: a method that is training gets 503 (retry), one that no job will produce gets 404
    at once, naming what is training (a device does not wait out its deadline for nothing)."""
    training = server.early_training  # type: ignore[attr-defined]
    assert training.status_code == 503 and int(training.headers["Retry-After"]) > 0
    r = server.early_unknown  # type: ignore[attr-defined]
    assert r.status_code == 404 and "Retry-After" not in r.headers
    detail = r.json()["detail"]  # TENT (1 round) may finish in between: it is then served, not training
    assert detail.startswith("no bundle and no job for method 'FedTTA++', so none will come; available now: ")
    assert "ODPFL-HN" in detail.split("; in training: ")[1] and "TENT" in detail


def test_nothing_served_or_training_is_404(tmp_path: Path) -> None:
    coord = start(tmp_path / "store", methods="")  # no default jobs: nothing will ever be served
    try:
        for call in (lambda: httpx.post(f"{coord.url}/v1/clients", json={}, timeout=10),
                     lambda: httpx.get(f"{coord.url}/v1/manifest", timeout=10)):
            r = call()
            assert r.status_code == 404, r.text
            assert r.json()["detail"] == ("no bundle and no job for method 'default', so none will come; "
                                          "available now: none; in training: none")
    finally:
        coord.stop()


def test_join_and_manifest(server: Coordinator, client: dict) -> None:
    assert {"TENT", "ODPFL-HN", "none"} <= set(client["methods"])
    assert client["token"].startswith("flc_") and len(client["client_id"]) == 32
    m = client["manifest"]
    assert m["method"] == "ODPFL-HN" and {"forward", "encoder", "params", "enc"} <= {a["name"] for a in m["artifacts"]}
    default = httpx.get(f"{server.url}/v1/manifest", timeout=10)
    assert default.status_code == 200 and default.json()["method"] == "TENT"
    assert default.headers["ETag"] == f'"{default.json()["bundle_id"]}"'
    same = httpx.get(f"{server.url}/v1/manifest", params={"method": "ODPFL-HN"}, timeout=10).json()
    assert same == m
    r = httpx.get(f"{server.url}/v1/manifest", params={"method": "NoSuchMethod"}, timeout=10)
    assert r.status_code == 404 and "available" in r.json()["detail"]
    r = httpx.post(f"{server.url}/v1/clients", json={"method": "TENT", "extra": 1}, timeout=10)
    assert r.status_code == 422


@pytest.fixture(scope="module")
def streaming_server(trained_store: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A coordinator that keeps no artifact in memory: every download is streamed from disk."""
    coord = start_copy(trained_store, tmp_path_factory.mktemp("stream") / "store",
                       env={"FL_SERVE_ARTIFACT_CACHE_FILE_MAX": "0"})
    yield coord
    coord.stop()


@pytest.fixture(params=["in-memory", "streamed"])
def artifact_server(request: pytest.FixtureRequest) -> Coordinator:
    return request.getfixturevalue("server" if request.param == "in-memory" else "streaming_server")


def test_artifact_download_range_and_etag(artifact_server: Coordinator) -> None:
    server = artifact_server
    m = httpx.get(f"{server.url}/v1/manifest", timeout=10).json()
    a = next(a for a in m["artifacts"] if a["name"] == "params")
    url = server.url + a["url"]
    full = httpx.get(url, timeout=10)
    assert full.status_code == 200 and len(full.content) == a["size"] == int(full.headers["Content-Length"])
    assert hashlib.sha256(full.content).hexdigest() == a["sha256"]
    assert full.headers["ETag"] == f'"{a["sha256"]}"' and full.headers["Accept-Ranges"] == "bytes"
    assert httpx.get(url, headers={"If-None-Match": full.headers["ETag"]}, timeout=10).status_code == 304
    part = httpx.get(url, headers={"Range": "bytes=100-999"}, timeout=10)
    assert part.status_code == 206 and part.content == full.content[100:1000] and part.headers["Content-Length"] == "900"
    assert part.headers["Content-Range"] == f"bytes 100-999/{a['size']}"
    tail = httpx.get(url, headers={"Range": "bytes=-50"}, timeout=10)
    assert tail.status_code == 206 and tail.content == full.content[-50:]
    rest = httpx.get(url, headers={"Range": f"bytes={a['size'] - 7}-"}, timeout=10)
    assert rest.content == full.content[-7:]
    bad = httpx.get(url, headers={"Range": f"bytes={a['size']}-"}, timeout=10)
    assert bad.status_code == 416 and bad.headers["Content-Range"] == f"bytes */{a['size']}"
    # the manifest itself is content-addressed: its bytes hash to the bundle id
    raw = httpx.get(f"{server.url}/v1/artifacts/{m['bundle_id']}", timeout=10).content
    assert hashlib.sha256(raw).hexdigest() == m["bundle_id"] and json.loads(raw)["method"] == "TENT"
    assert httpx.get(f"{server.url}/v1/artifacts/{'0' * 64}", timeout=10).status_code == 404
    assert httpx.get(f"{server.url}/v1/artifacts/..%2Fcoordinator.sqlite3", timeout=10).status_code == 404


def test_artifact_fast_path_answers_like_the_route(artifact_server: Coordinator) -> None:
    """A plain GET is answered by fastpath.ArtifactFastPath, the same GET with an If-Range that matches by the
    documented route (a full 200 as well): same status, bytes and headers, for an artifact and a manifest.
    Streamed from disk (a server that caches nothing), the same bytes and headers again."""
    server = artifact_server
    m = httpx.get(f"{server.url}/v1/manifest", timeout=10).json()
    for sha in (m["bundle_id"], *(a["sha256"] for a in m["artifacts"])):
        url = f"{server.url}/v1/artifacts/{sha}"
        fast = httpx.get(url, timeout=10)
        routed = httpx.get(url, headers={"If-Range": f'"{sha}"'}, timeout=10)
        assert fast.status_code == routed.status_code == 200 and fast.content == routed.content
        drop = {"date", "server"}
        assert ({k: v for k, v in fast.headers.items() if k not in drop}
                == {k: v for k, v in routed.headers.items() if k not in drop})
    assert "x-manifest-signature" in httpx.get(f"{server.url}/v1/artifacts/{m['bundle_id']}", timeout=10).headers
    upper = httpx.get(f"{server.url}/v1/artifacts/{m['bundle_id'].upper()}", timeout=10)
    assert upper.status_code == 404  # not a published address: the route's documented 404
    whole = httpx.get(f"{server.url}/v1/artifacts/{m['bundle_id']}", timeout=10).content
    head = httpx.head(f"{server.url}/v1/artifacts/{m['bundle_id']}", timeout=10)  # HEAD wherever GET (issue 36)
    assert (head.status_code, head.content, head.headers["content-length"]) == (200, b"", str(len(whole)))


def test_server_only_state_is_not_served(server: Coordinator) -> None:
    """theta (the hypernetwork) is in the artifact store but never downloadable."""
    objects = [p.name for p in (server.store / "objects").glob("*/*")]
    public = set()
    for method in ("TENT", "ODPFL-HN"):
        m = httpx.get(f"{server.url}/v1/manifest", params={"method": method}, timeout=10).json()
        public |= {m["bundle_id"], *(a["sha256"] for a in m["artifacts"])}
    private = [o for o in objects if o not in public]
    assert private, "the hypernetwork's theta should be stored"
    for sha in private:
        assert httpx.get(f"{server.url}/v1/artifacts/{sha}", timeout=10).status_code == 404


def _embedding(server: Coordinator, manifest: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A new client's embedding computed on the device graph (encoder.onnx) from real digits."""
    from fl_server.data import load_dataset

    files = {a["name"]: httpx.get(server.url + a["url"], timeout=10).content for a in manifest["artifacts"]}
    tmp = server.store.parent / "device"
    tmp.mkdir(exist_ok=True)
    (tmp / "enc.npz").write_bytes(files["enc"])
    gamma = dict(np.load(tmp / "enc.npz", allow_pickle=False))
    enc = ort.InferenceSession(files["encoder"], providers=["CPUExecutionProvider"])
    ds = load_dataset("digits", split="all")
    x, y = ds.x[:200].astype(np.float32), ds.y[:200]
    (e,) = enc.run(["embedding"], {"x": x, **{f"gamma.{k}": v for k, v in gamma.items()}})
    return e, x, y


def test_generate(server: Coordinator, client: dict) -> None:
    m = client["manifest"]
    e, x, _ = _embedding(server, m)
    url, bid = f"{server.url}/v1/hypernetwork/generate", {"bundle_id": m["bundle_id"]}
    assert httpx.post(url, json={"embedding": e.tolist(), **bid}, timeout=10).status_code == 401
    assert httpx.post(url, json={"embedding": e.tolist(), **bid}, headers=auth(ADMIN), timeout=10).status_code == 403
    r = httpx.post(url, json={"embedding": e.tolist(), **bid}, headers=auth(client["token"]), timeout=30)
    assert r.status_code == 200, r.text
    params = r.json()["params"]
    forward = ort.InferenceSession(httpx.get(server.url + next(a["url"] for a in m["artifacts"]
                                                               if a["name"] == "forward"), timeout=10).content)
    feeds = {"x": x}
    for inp in forward.get_inputs()[1:]:
        t = params[inp.name]
        arr = np.frombuffer(base64.b64decode(t["data"]), dtype="<f4").reshape(t["shape"])
        assert list(arr.shape) == inp.shape
        feeds[inp.name] = arr
    (logits,) = forward.run(["logits"], feeds)
    assert logits.shape == (len(x), 10) and np.isfinite(logits).all()
    binary = httpx.post(url, json={"embedding": e.tolist(), **bid}, timeout=30,
                        headers={**auth(client["token"]), "Accept": tensors.MEDIA_TYPE})
    assert binary.headers["content-type"] == tensors.MEDIA_TYPE and len(binary.content) < len(r.content)
    arrays, meta = tensors.decode(binary.content)
    assert meta == {"bundle_id": m["bundle_id"]} and set(arrays) == set(params)
    for name, arr in arrays.items():  # the same weights as the JSON reply, bit for bit
        assert arr.tobytes() == base64.b64decode(params[name]["data"])
    other = httpx.post(url, json={"embedding": (e + 1.0).tolist(), **bid}, headers=auth(client["token"]), timeout=30)
    assert other.json()["params"] != params  # the weights depend on the embedding
    for bad in ({"embedding": e.tolist()[:-1], **bid}, {"embedding": [], **bid},
                {"embedding": e.tolist(), "data": [1.0], **bid}, {"embedding": e.tolist()}):  # the last: no bundle
        r = httpx.post(url, json=bad, headers=auth(client["token"]), timeout=10)
        assert r.status_code == 422, bad
    nan = '{"embedding": [NaN%s], "bundle_id": "%s"}' % (", 0.0" * (len(e) - 1), m["bundle_id"])
    r = httpx.post(url, content=nan, headers={**auth(client["token"]), "Content-Type": "application/json"})
    assert r.status_code == 422
    big = httpx.post(url, content=b"{" + b" " * (2 << 20) + b"}",
                     headers={**auth(client["token"]), "Content-Type": "application/json"}, timeout=30)
    assert big.status_code == 413


def test_concurrent_generates_are_batched_correctly(server: Coordinator, client: dict) -> None:
    """Concurrent requests share one batched forward; each reply must still be its own embedding's."""
    from concurrent.futures import ThreadPoolExecutor

    e, _, _ = _embedding(server, client["manifest"])
    embs = [(e * s).tolist() for s in np.linspace(-3, 3, 12)]
    url, headers = f"{server.url}/v1/hypernetwork/generate", auth(client["token"])

    def call(emb: list[float]) -> dict:
        return httpx.post(url, json={"embedding": emb, "bundle_id": client["manifest"]["bundle_id"]}, headers=headers,
                          timeout=60).json()["params"]

    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(call, embs))
    for emb, got in zip(embs, together):
        alone = call(emb)
        for name, t in alone.items():
            a = np.frombuffer(base64.b64decode(t["data"]), dtype="<f4")
            b = np.frombuffer(base64.b64decode(got[name]["data"]), dtype="<f4")
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert together[0] != together[-1]


def test_btfl_dle_upload_and_reaggregation(server: Coordinator) -> None:
    rng = np.random.default_rng(0)
    a = httpx.post(f"{server.url}/v1/clients", json={}, timeout=10).json()
    b = httpx.post(f"{server.url}/v1/clients", json={}, timeout=10).json()
    dle_a = btfl.fit_dle(rng.exponential(size=(50, 16)))
    dle_b = btfl.fit_dle(rng.exponential(0.2, size=(150, 16)))
    url, named = f"{server.url}/v1/btfl/dle", {"bundle_id": UNSERVED_BTFL}
    r = httpx.post(url, json={"freqs": dle_a.tolist(), "num_samples": 50, **named}, headers=auth(a["token"]), timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["clients"] == 1 and r.json()["others_dle"] is None
    np.testing.assert_allclose(r.json()["global_dle"], dle_a)
    # b claims 10^9 samples: every client weighs the same (BTFL Sec. 4.1), so the claim cannot outweigh a
    r = httpx.post(url, json={"freqs": dle_b.tolist(), "num_samples": 10**9, **named}, headers=auth(b["token"]),
                   timeout=10)
    body = r.json()
    assert body["clients"] == 2 and (body["dims"], body["levels"]) == (16, 2)
    np.testing.assert_allclose(body["global_dle"], (dle_a + dle_b) / 2, atol=1e-12)
    np.testing.assert_allclose(body["others_dle"], dle_a)
    bad_rows = np.full((16, 2), 0.7)
    for bad in ({"freqs": bad_rows.tolist(), "num_samples": 5}, {"freqs": dle_a[:8].tolist(), "num_samples": 5},
                {"freqs": dle_a.tolist(), "num_samples": 0}, {"freqs": [[0.5]], "num_samples": 1}):
        bad = {**bad, "bundle_id": UNSERVED_BTFL}
        assert httpx.post(url, json=bad, headers=auth(a["token"]), timeout=10).status_code == 422
    unnamed = httpx.post(url, json={"freqs": dle_a.tolist(), "num_samples": 5}, headers=auth(a["token"]), timeout=10)
    assert unnamed.status_code == 422 and unnamed.json()["detail"][0]["loc"] == ["body", "bundle_id"]
    assert httpx.post(url, json={"freqs": dle_a.tolist(), "num_samples": 5, "bundle_id": UNSERVED_BTFL},
                      timeout=10).status_code == 401


def test_jobs_need_admin(server: Coordinator, client: dict) -> None:
    url = f"{server.url}/v1/jobs"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers=auth("flc_not-a-token"), timeout=10).status_code == 401
    assert httpx.get(url, headers=auth(client["token"]), timeout=10).status_code == 403
    jobs = httpx.get(url, headers=auth(ADMIN), timeout=10).json()
    assert {j["spec"]["method"] for j in jobs} == {"TENT", "ODPFL-HN"}
    assert all(j["method"] == j["spec"]["method"] for j in jobs)
    assert all(j["status"] == "done" and j["rounds_done"] == 1 and j["is_default"] for j in jobs)
    one = httpx.get(f"{url}/{jobs[0]['id']}", headers=auth(ADMIN), timeout=10).json()
    assert len(one["rounds"]) == 1 and 0 <= one["rounds"][0]["val"] <= 1
    assert one["best_round"] == 0 and 0 <= one["new_client_accuracy"] <= 1
    # the rule the job's devices apply: ODPFL-HN's keeps the received model, so its number is that model's
    assert {j["spec"]["method"]: j["safeguard"] for j in jobs} == {"TENT": "disagreement<=0.2",
                                                                   "ODPFL-HN": "rollback"}
    assert {j["test_of"] for j in jobs} == {"device"}
    assert httpx.get(f"{url}/nope", headers=auth(ADMIN), timeout=10).status_code == 404
    bad = httpx.post(url, json={"method": "NoSuch"}, headers=auth(ADMIN), timeout=10)
    assert bad.status_code == 422
    assert httpx.post(url, json={"partition": "dirichlet"}, headers=auth(ADMIN), timeout=10).status_code == 422
    new = httpx.post(url, json={"method": "FedAvg", "rounds": 1, "num_clients": 10}, headers=auth(ADMIN),
                     timeout=10)
    assert new.status_code == 201 and new.json()["status"] in ("queued", "running")


def test_metrics_and_dashboard(server: Coordinator) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'fl_http_requests_total{method="POST",route="/v1/clients",status="201"}' in text
    assert "fl_clients " in text and 'fl_jobs{status="done"} 2.0' in text
    assert 'fl_http_request_duration_seconds_bucket{le="0.2",method="GET",route="/healthz"}' in text
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "python_info"):
        assert f"\n{name}" in text, name  # prometheus_client's process and platform collectors
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and "<svg" in page.text and "ODPFL-HN" in page.text
    kept = html.escape(scored_model("device", "rollback", "ODPFL-HN"))  # the train summary's words
    assert page.text.count(f"% ({kept})</td>") == 1  # ODPFL-HN's job, not TENT's
    assert "python-httpx" not in page.text  # public page: no client user agents (nor job log tails)
    assert "<th>first authenticated request</th>" in page.text
    paths = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["paths"]
    assert {"/healthz", "/v1/clients", "/v1/manifest", "/v1/artifacts/{sha256}", "/v1/hypernetwork/generate",
            "/v1/btfl/dle", "/v1/jobs", "/v1/jobs/{job_id}", "/metrics"} <= set(paths)


def test_a_jobs_new_client_accuracy_is_what_a_device_gets_from_its_bundle(server: Coordinator,
                                                                          tmp_path: Path) -> None:
    """GET /v1/jobs/{id}'s new_client_accuracy (a job tests its best round only, so its rounds carry none) is the
    mean over the run's new clients of what the torch-free device gets from the job's served bundle (TENT: each
    client personalises on its own samples, the safeguard on)."""
    from edge_sdk import EdgeClient, open_bundle
    from fl_server.device_samples import client_samples

    jobs = httpx.get(f"{server.url}/v1/jobs", headers=auth(ADMIN), timeout=10).json()
    job = next(j for j in jobs if j["spec"]["method"] == "TENT" and j["is_default"])
    assert job["new_client_accuracy"] is not None and all(r["test"] is None for r in
                                                          httpx.get(f"{server.url}/v1/jobs/{job['id']}",
                                                                    headers=auth(ADMIN), timeout=10).json()["rounds"])
    with EdgeClient(server.url, cache_dir=tmp_path) as c:
        bundle = c.download(c.manifest("TENT"))
    assert bundle.id == job["bundle_id"]
    samples = client_samples(bundle.manifest)
    accuracies = []
    for lo, hi in zip(samples["offsets"][:-1], samples["offsets"][1:]):
        x, y = samples["x"][lo:hi], samples["y"][lo:hi]
        device = open_bundle(bundle)
        device.personalize(x)
        accuracies.append(float((device.predict(x).argmax(1) == y).mean()))
    assert abs(float(np.mean(accuracies)) - job["new_client_accuracy"]) <= 1e-3, (accuracies, job)
    page = httpx.get(f"{server.url}/", timeout=10).text
    assert f"{100 * job['new_client_accuracy']:.1f}%" in page  # the dashboard shows the same number


def test_the_stream_example_says_when_a_rule_keeps_the_received_model(server: Coordinator, tmp_path: Path) -> None:
    """ODPFL-HN's rule keeps the received model whatever adaptation does: the device adapts nothing, and the
    example says so rather than that it personalised."""
    import os
    import subprocess
    import sys

    from fl_server.cli import main as fl_server

    repo = Path(__file__).resolve().parents[1]
    data = tmp_path / "odpfl.npz"
    assert fl_server(["device-data", server.url, "--method", "odpfl-hn", "--wait", "300", "--out", str(data)]) == 0
    run = subprocess.run([sys.executable, str(repo / "examples" / "stream_inference.py"), "--server", server.url,
                          "--method", "odpfl-hn", "--data", str(data), "--cache", str(tmp_path / "cache"),
                          "--png", str(tmp_path / "s.png")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "edge_sdk")])})
    assert run.returncode == 0, run.stderr
    assert ("did not personalise (the safeguard rule rollback always keeps the received model; --safeguard off "
            "adapts) in ") in run.stdout and "(0 step(s))" in run.stdout, run.stdout


def test_new_client_request_carries_only_the_embedding(server: Coordinator, tmp_path: Path) -> None:
    """A new ODPFL-HN client personalises on its device through edge_sdk; every byte it sends is recorded on the
    wire. Under ODPFL-HN's declared safeguard (rollback: the received model whatever comes back) nothing is sent
    but the join. Without it, the only other body with data is the generate request, and it holds exactly the
    embedding e = g_gamma(D) and the id of the device's bundle: no samples, no labels, nothing of size |D|."""
    from edge_sdk import EdgeClient, open_bundle
    from fl_server.data import load_dataset

    sent: list[tuple[str, str, bytes]] = []

    class RecordingTransport(httpx.HTTPTransport):  # real HTTP; only records what leaves the device
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            sent.append((request.method, request.url.path, request.read()))
            return super().handle_request(request)

    ds = load_dataset("digits", split="all")
    x, y = ds.x[:300].astype(np.float32), ds.y[:300]
    with EdgeClient(server.url, cache_dir=tmp_path, transport=RecordingTransport()) as device:
        info = device.join("ODPFL-HN")
        bundle = device.download(info.manifest)
        declared = open_bundle(bundle, client=device)
        assert declared.personalize(x).safeguard.action == "received"  # type: ignore[union-attr]
        assert [(m, p) for m, p, b in sent if b] == [("POST", "/v1/clients")]  # no embedding left the device
        model = open_bundle(bundle, client=device, safeguard=False)
        model.personalize(x)
        embedding = model.runner.embed(x)
    assert (model.predict(x).argmax(1) == y).mean() > 0.2  # a working model came back
    bodies = [(m, p, b) for m, p, b in sent if b]
    assert [(m, p) for m, p, _ in bodies] == [("POST", "/v1/clients"), ("POST", "/v1/hypernetwork/generate")]
    assert json.loads(bodies[0][2]) == {"method": "ODPFL-HN"}
    gen = json.loads(bodies[1][2])
    assert set(gen) == {"embedding", "bundle_id"} and gen["bundle_id"] == bundle.id == info.manifest["bundle_id"]
    assert len(gen["embedding"]) == len(embedding) == 32  # E floats, whatever |D| is (here 300 x 64 pixels)
    np.testing.assert_allclose(gen["embedding"], embedding, rtol=1e-6)
    assert len(bodies[1][2]) < 2_000 < x.nbytes
    assert all(m == "GET" for m, _, b in sent if not b)


def test_restart_keeps_state(server: Coordinator, client: dict, tmp_path: Path) -> None:
    before = {p: httpx.get(f"{server.url}{p}", headers=auth(ADMIN), timeout=10).json()
              for p in ("/v1/jobs", "/v1/manifest")}
    dle = httpx.get(f"{server.url}/v1/btfl/dle", headers=auth(client["token"]), timeout=10).json()
    server.stop()
    again = start(server.store)
    try:
        after_jobs = httpx.get(f"{again.url}/v1/jobs", headers=auth(ADMIN), timeout=10).json()
        done_before = {j["id"]: j for j in before["/v1/jobs"] if j["status"] == "done"}
        done_after = {j["id"]: j for j in after_jobs if j["id"] in done_before}
        assert done_after == done_before  # finished jobs and their bundles, untouched
        assert {j["id"] for j in after_jobs} == {j["id"] for j in before["/v1/jobs"]}  # the queued one too
        manifest = httpx.get(f"{again.url}/v1/manifest", timeout=10).json()
        old_release, new_release = (json.loads(m.pop("signature")["release"])
                                    for m in (before["/v1/manifest"], manifest))
        assert manifest == before["/v1/manifest"]
        # the same release (bundle, method, version), signed afresh: only its expiry moved on
        assert {**new_release, "expires": None} == {**old_release, "expires": None}
        assert new_release["expires"] >= old_release["expires"]
        # the client's token still works, and the DLE aggregate survived
        assert httpx.get(f"{again.url}/v1/btfl/dle", headers=auth(client["token"]), timeout=10).json() == dle
        assert len(httpx.get(f"{again.url}/v1/jobs", headers=auth(ADMIN), timeout=10).json()) == 3
    finally:
        again.stop()



def test_a_device_keeps_its_own_bundles_hypernetwork_after_a_newer_release(trained_store: Path,
                                                                           tmp_path: Path) -> None:
    """ODPFL-HN: the coordinator releases a newer ODPFL-HN bundle (a retrain, another seed) while a device keeps
    the one it downloaded. Personalising again, the device gets its own bundle's hypernetwork's weights, not the
    newer one's: the same shapes for another encoder, which nothing on the device could tell apart."""
    from edge_sdk import EdgeClient, open_bundle

    coord = start_copy(trained_store, tmp_path / "store")
    try:
        with EdgeClient(coord.url, cache_dir=tmp_path / "device") as c:
            c.join("ODPFL-HN")
            old = c.download(c.manifest("ODPFL-HN"))
            raw = old.manifest["preprocess"]["raw"]
            x = np.random.default_rng(0).integers(int(raw["range"][0]), int(raw["range"][1]) + 1,
                                                  (24, *raw["shape"])).astype(raw["dtype"])
            device = open_bundle(old, client=c, safeguard=False)
            device.personalize(x)
            own = dict(device.runner.weights)
            job = httpx.post(f"{coord.url}/v1/jobs", json={"method": "ODPFL-HN", "rounds": 1, "seed": 1},
                             headers=auth(ADMIN), timeout=30)
            assert job.status_code == 201, job.text
            coord.wait_bundles(3)
            assert c.manifest("ODPFL-HN")["bundle_id"] != old.id  # a newer ODPFL-HN bundle is served now
            device.personalize(x)
            for name, w in own.items():
                np.testing.assert_array_equal(device.runner.weights[name], w)
            newest = c.generate(device.runner.embed(x), c.manifest("ODPFL-HN")["bundle_id"])  # the newer one's
            assert any(not np.allclose(newest[f"psi.{name}"], w) for name, w in own.items())
    finally:
        coord.stop()

