"""Property-based fuzzing of the coordinator's HTTP API from its own OpenAPI schema (schemathesis +
Hypothesis) against a real server. Shared by the CI profile (tests/test_api_fuzz.py) and the long profile
(scripts/fuzz_api.py).

Every operation is fuzzed with schema-valid (positive) and schema-invalid (negative) requests, plus
targeted cases that get past the checks a schema cannot express (the bundle's embedding dimension,
probability rows of a DLE). Checks on every response: no 5xx; the status code, content type, headers and
body are the ones the schema documents; schema-invalid input is rejected; a secured operation rejects a
missing or invalid token; every error is JSON with a short, non-empty message; generated weights are finite.
POST /v1/jobs is fuzzed with invalid bodies only (a valid one would start a training job).
"""
from __future__ import annotations

import base64
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import hypothesis.errors
import numpy as np
import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (content_type_conformance, ignored_auth, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

MAX_DETAIL_CHARS = 4096  # an error body never echoes a large input (20 field errors fit)


@schemathesis.check
def clear_error(ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """Every 4xx/5xx is JSON {"detail": ...} with a non-empty, bounded message."""
    if response.status_code < 400:
        return
    body = response.json()
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):
        assert detail and all(isinstance(e, dict) and e.get("msg") for e in detail), f"no messages: {body}"
    elif isinstance(detail, dict):
        assert detail.get("message"), f"no message: {body}"
    else:
        assert isinstance(detail, str) and detail.strip(), f"no detail: {response.text[:200]}"
    assert len(response.text) <= MAX_DETAIL_CHARS, f"error body of {len(response.text)} characters"


@schemathesis.check
def finite_weights(ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case) -> None:
    """A generate reply's weights are finite float32 arrays of the stated shapes."""
    if response.status_code != 200 or not case.operation.path.endswith("/generate"):
        return
    for name, t in response.json()["params"].items():
        w = np.frombuffer(base64.b64decode(t["data"]), dtype="<f4")
        assert w.size == int(np.prod(t["shape"])), f"{name}: {w.size} values for shape {t['shape']}"
        assert np.isfinite(w).all(), f"{name}: non-finite generated weights"


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection, ignored_auth, clear_error, finite_weights]
NEGATIVE_ONLY = {"POST /v1/jobs"}
# the fuzzed server runs without rate limits: a 429 is documented, but it would keep cases from the code
NO_LIMITS = {"FL_SERVE_TOKEN_RATE": "0", "FL_SERVE_JOIN_RATE": "0", "FL_SERVE_ADDRESS_RATE": "0",
             "FL_SERVE_ADMIN_FAIL_RATE": "0"}


@dataclass
class Tokens:
    client: str
    admin: str

    def headers(self, op: schemathesis.APIOperation) -> dict[str, str]:
        if not op.definition.raw.get("security"):
            return {}
        token = self.admin if {"jobs", "admin"} & set(op.definition.raw.get("tags", [])) else self.client
        return {"Authorization": f"Bearer {token}"}


@dataclass
class Report:
    cases: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    seconds_by: dict[str, float] = field(default_factory=dict)
    server_5xx: int = 0  # 5xx answers counted by the server itself (GET /metrics)
    jobs_created: int = 0


def _targeted(op: schemathesis.APIOperation, context: dict[str, Any]) -> st.SearchStrategy | None:
    """Bodies that satisfy what the schema cannot say, for the operations that need them."""
    if op.label == "POST /v1/hypernetwork/generate":
        value = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
        bundle = st.sampled_from([context["hn_bundle"], context["other_bundle"]])
        return st.builds(lambda e, b: {"embedding": e, "bundle_id": b},
                         st.lists(value, min_size=context["embed_dim"], max_size=context["embed_dim"]), bundle)
    if op.label == "POST /v1/btfl/dle":
        def dle(dims: int, levels: int, seed: int, n: int) -> dict[str, Any]:
            p = np.random.default_rng(seed).dirichlet(np.full(levels, 0.3), size=dims)
            return {"freqs": p.tolist(), "num_samples": n, "bundle_id": "b" * 64}  # no BTFL bundle is served
        return st.builds(dle, st.integers(1, 64), st.integers(2, 16), st.integers(0, 2**32 - 1),
                         st.integers(1, 10**9))
    return None


def _invalid_body(case: schemathesis.Case) -> bool:
    """The case's body violates the schema (a negative case may be negative only in a header that the
    fuzzer's own Authorization then replaces, which would make it a valid request)."""
    info = case.meta.components.get(ParameterLocation.BODY) if case.meta else None
    return info is not None and info.mode == GenerationMode.NEGATIVE


def _strategies(op: schemathesis.APIOperation, context: dict[str, Any]) -> list[tuple[str, st.SearchStrategy]]:
    if op.label in NEGATIVE_ONLY:
        return [("negative", op.as_strategy(generation_mode=GenerationMode.NEGATIVE).filter(_invalid_body))]
    out = [(mode.value, op.as_strategy(generation_mode=mode))
           for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    body = _targeted(op, context)
    if body is not None:
        out.append(("targeted", body.map(lambda b: op.Case(body=b, media_type="application/json"))))
    return out


def context_of(url: str) -> dict[str, Any]:
    """What the targeted cases need from the live server: ODPFL-HN's bundle and embedding dimension."""
    hn = requests.get(f"{url}/v1/manifest", params={"method": "ODPFL-HN"}, timeout=30).json()
    other = requests.get(f"{url}/v1/manifest", timeout=30).json()
    return {"hn_bundle": hn["bundle_id"], "embed_dim": int(hn["hyperparameters"]["embed_dim"]),
            "other_bundle": other["bundle_id"]}


def _run_cases(strategy: st.SearchStrategy, send: Callable[[schemathesis.Case], None], max_examples: int,
               seed: int) -> None:
    """Up to ``max_examples`` cases of ``strategy`` through ``send``; a failing check raises after shrinking."""

    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=max_examples, deadline=None, database=None, print_blob=False,
                         suppress_health_check=list(hypothesis.HealthCheck),
                         phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate, hypothesis.Phase.shrink))
    @hypothesis.given(strategy)
    def one(case: schemathesis.Case) -> None:
        send(case)

    one()


def fuzz(url: str, tokens: Tokens, max_examples: int, seed: int) -> Report:
    """Fuzz every operation of the server at ``url``: ``max_examples`` cases per operation and mode."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    context, report, session = context_of(url), Report(), requests.Session()

    def send(case: schemathesis.Case) -> None:
        report.cases[case.operation.label] += 1
        case.call_and_validate(base_url=url, session=session, headers=tokens.headers(case.operation), checks=CHECKS)

    start = time.perf_counter()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode, strategy in _strategies(op, context):
            name, t0 = f"{op.label} [{mode}]", time.perf_counter()
            try:
                _run_cases(strategy, send, max_examples, seed)
            except hypothesis.errors.Unsatisfiable:  # nothing in this operation can be made schema-invalid
                report.skipped.append(name)
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 (a failed check: record it, go on)
                report.failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:3000]}")
            report.seconds_by[name] = round(time.perf_counter() - t0, 2)
    report.seconds = time.perf_counter() - start
    return report


def fuzz_coordinator(url: str, admin: str, max_examples: int, seed: int) -> Report:
    """Join as a client and fuzz the server at ``url``; then read the server's own view: the 5xx it
    answered (GET /metrics) and the training jobs created (none may be)."""
    token = requests.post(f"{url}/v1/clients", json={"method": "ODPFL-HN"}, timeout=30).json()["token"]
    admin_headers = {"Authorization": f"Bearer {admin}"}
    jobs_before = len(requests.get(f"{url}/v1/jobs", headers=admin_headers, timeout=30).json())
    report = fuzz(url, Tokens(client=token, admin=admin), max_examples, seed)
    metrics = requests.get(f"{url}/metrics", timeout=30).text
    fivexx = re.findall(r'^fl_http_requests_total\{[^}]*status="5\d\d"\} (\S+)$', metrics, flags=re.MULTILINE)
    report.server_5xx = sum(int(float(n)) for n in fivexx)
    report.jobs_created = len(requests.get(f"{url}/v1/jobs", headers=admin_headers, timeout=30).json()) - jobs_before
    return report
