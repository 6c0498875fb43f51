"""Request counters and latency histograms for ``GET /metrics`` (Prometheus text format 0.0.4)."""
from __future__ import annotations

import re
import threading
from collections import defaultdict

# fine below 250 ms: the coordinator's latency target is p99 < 200 ms (docs/benchmarks/coordinator-load.json)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))
_ROUTE_IDS = [(re.compile(r"^/v1/artifacts/[^/]+$"), "/v1/artifacts/{sha256}"),
              (re.compile(r"^/v1/jobs/[^/]+$"), "/v1/jobs/{id}")]
KNOWN = {"/", "/healthz", "/metrics", "/v1/signing-key", "/v1/clients", "/v1/manifest", "/v1/hypernetwork/generate",
         "/v1/btfl/dle", "/v1/jobs", "/v1/enrollments", "/v1/artifacts/{sha256}", "/v1/jobs/{id}", "/docs", "/openapi.json"}


def route_label(path: str) -> str:
    for pattern, label in _ROUTE_IDS:
        if pattern.match(path):
            return label
    return path if path in KNOWN else "other"  # bounded label set whatever clients send


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.hist: dict[tuple[str, str], list[float]] = {}  # bucket counts..., sum, count

    def observe(self, method: str, path: str, status: int, seconds: float) -> None:
        key = (method, route_label(path))
        with self._lock:
            self.requests[(*key, status)] += 1
            h = self.hist.setdefault(key, [0.0] * (len(BUCKETS) + 2))
            for i, b in enumerate(BUCKETS):
                if seconds <= b:
                    h[i] += 1
            h[-2] += seconds
            h[-1] += 1

    def render(self, gauges: dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]]) -> str:
        """Prometheus text: request counters, latency histograms, and ``gauges`` (name -> (help, samples))."""
        out = ["# HELP fl_http_requests_total HTTP requests by method, route and status.",
               "# TYPE fl_http_requests_total counter"]
        with self._lock:
            for (m, p, s), n in sorted(self.requests.items()):
                out.append(f'fl_http_requests_total{{method="{m}",route="{p}",status="{s}"}} {n}')
            out += ["# HELP fl_http_request_duration_seconds Request latency.",
                    "# TYPE fl_http_request_duration_seconds histogram"]
            for (m, p), h in sorted(self.hist.items()):
                labels = f'method="{m}",route="{p}"'
                for b, c in zip(BUCKETS, h):
                    le = "+Inf" if b == float("inf") else repr(b)
                    out.append(f'fl_http_request_duration_seconds_bucket{{{labels},le="{le}"}} {int(c)}')
                out.append(f"fl_http_request_duration_seconds_sum{{{labels}}} {h[-2]:.6f}")
                out.append(f"fl_http_request_duration_seconds_count{{{labels}}} {int(h[-1])}")
        for name, (help_, samples) in gauges.items():
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
            for labels, value in samples.items():
                lab = ",".join(f'{k}="{v}"' for k, v in labels)
                out.append(f"{name}{{{lab}}} {value:g}" if lab else f"{name} {value:g}")
        return "\n".join(out) + "\n"
