"""Limits at the API boundary, against a real coordinator process: body size, tensor shapes, the
hypernetwork's embedding dimension, finite and bounded values, bounded lists and strings. Each violation
is a documented 4xx with an exact message."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from coordinator_proc import ADMIN, UNSERVED_BTFL, Coordinator, auth, join, start_copy

pytestmark = pytest.mark.timeout(600)  # the first test of a session trains the shared store
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(trained_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    coord = start_copy(trained_store, tmp_path_factory.mktemp("limits") / "store")
    yield coord
    coord.stop()


@pytest.fixture(scope="module")
def client(server: Coordinator) -> dict:
    return join(server.url, "ODPFL-HN")


def field_error(loc: list, msg: str, type_: str) -> dict:
    return {"detail": [{"loc": loc, "msg": msg, "type": type_}]}


def test_body_over_1_mib_is_413_by_length_and_when_streamed(server: Coordinator, client: dict) -> None:
    url = f"{server.url}/v1/hypernetwork/generate"
    headers = {**auth(client["token"]), "Content-Type": "application/json"}
    expected = {"detail": f"request body over {LIMIT} bytes"}
    r = httpx.post(url, content=b"{" + b" " * LIMIT + b"}", headers=headers, timeout=60)
    assert (r.status_code, r.json()) == (413, expected)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the guard counts the streamed body
        yield b'{"embedding": ['
        for _ in range(LIMIT // 4096 + 1):
            yield b"0.0," * 1024
        yield b"0.0]}"

    r = httpx.post(url, content=chunks(), headers=headers, timeout=60)
    assert (r.status_code, r.json()) == (413, expected)  # was FastAPI's 400 "error parsing the body"
    named = b'{"bundle_id": "%s", "embedding": [' % client["manifest"]["bundle_id"].encode()
    just_under = named + b" " * (LIMIT - 200) + b"0.0]}"
    r = httpx.post(url, content=just_under, headers=headers, timeout=60)
    assert r.status_code == 422 and "embedding must have" in r.json()["detail"]  # under the limit: parsed


def test_embedding_must_match_the_hypernetwork(server: Coordinator, client: dict) -> None:
    dim, own = int(client["manifest"]["hyperparameters"]["embed_dim"]), {"bundle_id": client["manifest"]["bundle_id"]}
    url, headers = f"{server.url}/v1/hypernetwork/generate", auth(client["token"])
    r = httpx.post(url, json={"embedding": [0.1] * (dim - 1), **own}, headers=headers, timeout=30)
    assert (r.status_code, r.json()) == (422, {"detail": f"embedding must have {dim} values (the bundle's encoder "
                                                         f"output), got {dim - 1}"})
    r = httpx.post(url, json={"embedding": [0.1] * 4097, **own}, headers=headers, timeout=30)
    assert (r.status_code, r.json()) == (422, field_error(
        ["body", "embedding"], "List should have at most 4096 items after validation, not 4097", "too_long"))
    r = httpx.post(url, json={"embedding": [], **own}, headers=headers, timeout=30)
    assert (r.status_code, r.json()) == (422, field_error(
        ["body", "embedding"], "List should have at least 1 item after validation, not 0", "too_short"))
    tent = httpx.get(f"{server.url}/v1/manifest", params={"method": "TENT"}, timeout=30).json()["bundle_id"]
    r = httpx.post(url, json={"embedding": [0.1] * dim, "bundle_id": tent}, headers=headers, timeout=30)
    assert (r.status_code, r.json()) == (404, {"detail": f"no ODPFL-HN bundle {tent} is served here"})
    r = httpx.post(url, json={"embedding": [0.1] * dim}, headers=headers, timeout=30)  # which bundle's encoder?
    assert (r.status_code, r.json()) == (422, field_error(["body", "bundle_id"], "Field required", "missing"))
    r = httpx.post(url, json={"embedding": [0.1] * dim, "bundle_id": "../x"}, headers=headers, timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "bundle_id"]


def test_embedding_values_finite_and_bounded(server: Coordinator, client: dict) -> None:
    """1e300 used to overflow float32 and come back as NaN weights with 200."""
    dim, own = int(client["manifest"]["hyperparameters"]["embed_dim"]), {"bundle_id": client["manifest"]["bundle_id"]}
    url, headers = f"{server.url}/v1/hypernetwork/generate", auth(client["token"])
    for value, msg, type_ in ((1e300, "Input should be less than or equal to 1000000", "less_than_equal"),
                              (-2e6, "Input should be greater than or equal to -1000000", "greater_than_equal")):
        r = httpx.post(url, json={"embedding": [value] + [0.0] * (dim - 1), **own}, headers=headers, timeout=30)
        assert (r.status_code, r.json()) == (422, field_error(["body", "embedding", 0], msg, type_))
    for token in ("NaN", "Infinity", "-Infinity"):
        body = '{"embedding": [0.0, %s], "bundle_id": "%s"}' % (token, own["bundle_id"])
        r = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=30)
        assert (r.status_code, r.json()) == (422, field_error(["body", "embedding", 1],
                                                              "Input should be a finite number", "finite_number"))
    r = httpx.post(url, json={"embedding": [1e6] * dim, **own}, headers=headers, timeout=30)
    assert r.status_code == 200  # the bound itself is accepted


def test_dle_shapes_and_values(server: Coordinator, client: dict) -> None:
    url, headers = f"{server.url}/v1/btfl/dle", auth(client["token"])

    def post(freqs: object, num_samples: object = 5) -> httpx.Response:
        return httpx.post(url, json={"freqs": freqs, "num_samples": num_samples, "bundle_id": UNSERVED_BTFL},
                          headers=headers, timeout=30)

    cases = [
        (post([[0.5] * 17]), field_error(["body", "freqs", 0], "List should have at most 16 items after validation, "
                                                             "not 17", "too_long")),
        (post([[1.0]]), field_error(["body", "freqs", 0], "List should have at least 2 items after validation, "
                                                         "not 1", "too_short")),
        (post([[0.5, 0.5]] * 65537), field_error(["body", "freqs"], "List should have at most 65536 items after "
                                                                   "validation, not 65537", "too_long")),
        (post([[1.5, -0.5]]), {"detail": [
            {"loc": ["body", "freqs", 0, 0], "msg": "Input should be less than or equal to 1",
             "type": "less_than_equal"},
            {"loc": ["body", "freqs", 0, 1], "msg": "Input should be greater than or equal to 0",
             "type": "greater_than_equal"}]}),
        (post([[0.5, 0.5]], 0), field_error(["body", "num_samples"], "Input should be greater than or equal to 1",
                                            "greater_than_equal")),
        (post([[0.5, 0.5], [0.2, 0.3, 0.5]]), {"detail": "invalid DLE: every row of freqs must have the same "
                                                         "number of levels"}),
        (post([[0.7, 0.7]]), {"detail": "invalid DLE: freqs rows must be probability vectors (entries in [0, 1] "
                                        "summing to 1)"}),
    ]
    for r, expected in cases:
        assert (r.status_code, r.json()) == (422, expected)


def test_dle_shape_is_fixed_by_the_other_clients(server: Coordinator, client: dict) -> None:
    """A client may replace its own DLE with another shape while it is alone; it used to be locked out by
    its own first upload."""
    url = f"{server.url}/v1/btfl/dle"
    a = auth(client["token"])
    one = {"num_samples": 1, "bundle_id": UNSERVED_BTFL}
    assert httpx.post(url, json={"freqs": [[0.5, 0.5]], **one}, headers=a, timeout=30).status_code == 200
    dle = np.full((4, 2), 0.5).tolist()
    r = httpx.post(url, json={"freqs": dle, **one}, headers=a, timeout=30)
    assert r.status_code == 200 and (r.json()["clients"], r.json()["dims"]) == (1, 4)
    other = join(server.url)["token"]
    r = httpx.post(url, json={"freqs": [[0.5, 0.5]], **one}, headers=auth(other), timeout=30)
    assert (r.status_code, r.json()) == (422, {"detail": "DLE shape [1, 2] differs from the other clients' [4, 2]"})


def test_strings_and_headers_are_bounded(server: Coordinator) -> None:
    long = "x" * 65
    r = httpx.post(f"{server.url}/v1/clients", json={"method": long}, timeout=30)  # used to echo any length
    assert (r.status_code, r.json()) == (422, field_error(["body", "method"], "String should have at most 64 "
                                                                              "characters", "string_too_long"))
    r = httpx.get(f"{server.url}/v1/manifest", params={"method": long}, timeout=30)
    assert (r.status_code, r.json()) == (422, field_error(["query", "method"], "String should have at most 64 "
                                                                               "characters", "string_too_long"))
    m = httpx.get(f"{server.url}/v1/manifest", timeout=30).json()
    a = m["artifacts"][0]
    for header in ("bytes=" + "9" * 5000 + "-", "bytes=0-" + "9" * 5000, "bytes=-" + "9" * 5000):
        r = httpx.get(server.url + a["url"], headers={"Range": header}, timeout=30)  # used to be a 500
        assert r.status_code == 200 and len(r.content) == a["size"]  # malformed: ignored (RFC 9110)
    r = httpx.get(server.url + a["url"], headers={"Range": f"bytes={a['size']}-"}, timeout=30)
    assert (r.status_code, r.json()) == (416, {"detail": f"range 'bytes={a['size']}-' is outside the artifact's "
                                                         f"{a['size']} bytes"})


def test_malformed_bodies_and_methods(server: Coordinator) -> None:
    url = f"{server.url}/v1/clients"
    r = httpx.post(url, content=b"x\xff", headers={"Content-Type": "application/json"}, timeout=30)
    assert (r.status_code, r.json()) == (400, {"detail": "request body is not valid UTF-8 JSON"})
    r = httpx.post(url, content=b"{", headers={"Content-Type": "application/json"}, timeout=30)
    assert (r.status_code, r.json()) == (422, field_error(["body", 1], "JSON decode error", "json_invalid"))
    r = httpx.delete(f"{server.url}/v1/btfl/dle", timeout=30)  # Allow used to name only POST
    assert (r.status_code, r.headers["Allow"], r.json()) == (
        405, "GET, HEAD, POST", {"detail": "method DELETE is not allowed here; allowed: GET, HEAD, POST"})


def test_job_specs_are_bounded(server: Coordinator) -> None:
    """POST /v1/jobs is not fuzzed with valid bodies (each would train); its bounds are checked here."""
    url, headers = f"{server.url}/v1/jobs", auth(ADMIN)
    before = len(httpx.get(url, headers=headers, timeout=30).json())
    cases = [
        ({"rounds": 1001}, field_error(["body", "rounds"], "Input should be less than or equal to 1000",
                                       "less_than_equal")),
        ({"num_clients": 1}, field_error(["body", "num_clients"], "Input should be greater than or equal to 2",
                                         "greater_than_equal")),
        ({"alpha": 0, "partition": "dirichlet"}, field_error(["body", "alpha"], "Input should be greater than 0",
                                                             "greater_than")),
        ({"partition": "dirichlet"}, {"detail": "partition 'dirichlet' needs alpha"}),
        ({"method": "TENT", "extra": 1}, field_error(["body", "extra"], "Extra inputs are not permitted",
                                                     "extra_forbidden")),
    ]
    for body, expected in cases:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert (r.status_code, r.json()) == (422, expected), body
    assert len(httpx.get(url, headers=headers, timeout=30).json()) == before


def test_openapi_documents_every_error(server: Coordinator) -> None:
    paths = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
    want = {("post", "/v1/clients"): {"400", "404", "413", "422", "429", "503"},
            ("post", "/v1/hypernetwork/generate"): {"400", "401", "403", "404", "413", "422", "429", "503"},
            ("post", "/v1/btfl/dle"): {"400", "401", "403", "413", "422", "429"},
            ("get", "/v1/btfl/dle"): {"401", "403", "404", "429"},
            ("get", "/v1/jobs/{job_id}"): {"401", "403", "404", "422", "429"},
            ("get", "/v1/artifacts/{sha256}"): {"404", "416", "422"}}
    for (method, path), codes in want.items():
        responses = paths[path][method]["responses"]
        assert codes <= set(responses), (method, path)
        for code in codes:
            ref = responses[code]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/NotReady" if code == "503" else "/Error")
        if "429" in codes:
            assert "Retry-After" in responses["429"]["headers"]


def test_concurrent_first_dles_of_different_shapes(trained_store: Path, tmp_path: Path) -> None:
    """The first DLEs fix the shape, also when they arrive together (the shape check and the write used to
    be separate steps: two first uploads could both pass, and a mixed table fails every aggregation).
    Its own server: the DLE table must be empty."""
    from concurrent.futures import ThreadPoolExecutor

    server = start_copy(trained_store, tmp_path / "store")
    try:
        tokens = [join(server.url)["token"] for _ in range(16)]
        assert httpx.get(f"{server.url}/v1/btfl/dle", headers=auth(tokens[0]), timeout=30).status_code == 404

        def upload(i: int) -> int:
            dle = np.full((4 if i % 2 else 8, 2), 0.5).tolist()
            return httpx.post(f"{server.url}/v1/btfl/dle", json={"freqs": dle, "num_samples": 1,
                                                                 "bundle_id": UNSERVED_BTFL},
                              headers=auth(tokens[i]), timeout=60).status_code

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(upload, range(16)))
        assert sorted(set(codes)) == [200, 422] and codes.count(200) == 8  # one shape won, the other refused
        r = httpx.get(f"{server.url}/v1/btfl/dle", headers=auth(tokens[0]), timeout=30)
        assert r.status_code == 200 and r.json()["clients"] == 8
    finally:
        server.stop()
