"""Request counters and latency histograms for ``GET /metrics``, through ``prometheus_client``.

Metric names are unchanged from the hand-written exporter this replaces (``fl_http_requests_total``,
``fl_http_request_duration_seconds``, the ``fl_*`` gauges; values are now printed as floats, ``3.0``), and the
standard process and Python metrics are added (``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
``process_open_fds``, ``python_gc_*``, ``python_info``). Each :class:`Metrics` has its own registry, so several
apps in one process never share counters.

    m = Metrics()
    m.observe("GET", "/healthz", 200, 0.0012)
    text = m.render({"fl_clients": ("Joined clients.", {(): 3.0})})
"""
from __future__ import annotations

import re
from collections.abc import Iterator

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector,
                               ProcessCollector, disable_created_metrics, generate_latest)
from prometheus_client.core import GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# fine below 250 ms: the coordinator's latency target is p99 < 200 ms (docs/benchmarks/coordinator-load.json)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))
_ROUTE_IDS = [(re.compile(r"^/v1/artifacts/[^/]+$"), "/v1/artifacts/{sha256}"),
              (re.compile(r"^/v1/jobs/[^/]+$"), "/v1/jobs/{id}"),
              (re.compile(r"^/docs/static/.+$"), "/docs/static/{path}")]
KNOWN = {"/", "/healthz", "/metrics", "/v1/signing-key", "/v1/clients", "/v1/manifest", "/v1/hypernetwork/generate",
         "/v1/btfl/dle", "/v1/jobs", "/v1/enrollments", "/v1/bundles", "/v1/artifacts/{sha256}", "/v1/jobs/{id}",
         "/docs", "/redoc", "/openapi.json"}
Gauges = dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]]  # name -> (help, {labels: value})

disable_created_metrics()  # no *_created series: the exposition stays what it was before prometheus_client


def route_label(path: str) -> str:
    for pattern, label in _ROUTE_IDS:
        if pattern.match(path):
            return label
    return path if path in KNOWN else "other"  # bounded label set whatever clients send


class Metrics:
    """The coordinator's registry: request metrics fed by the middleware, process metrics, and per-scrape
    gauges passed to :meth:`render`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("fl_http_requests", "HTTP requests by method, route and status.",
                                ("method", "route", "status"), registry=self.registry)
        self.latency = Histogram("fl_http_request_duration_seconds", "Request latency.", ("method", "route"),
                                 buckets=BUCKETS, registry=self.registry)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def observe(self, method: str, path: str, status: int, seconds: float) -> None:
        route = route_label(path)
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def render(self, gauges: Gauges) -> str:
        """Prometheus text format 0.0.4: this registry's metrics, then ``gauges`` (read at scrape time)."""
        scrape = CollectorRegistry(auto_describe=False)
        scrape.register(_GaugeSnapshot(gauges))
        return (generate_latest(self.registry) + generate_latest(scrape)).decode()


class _GaugeSnapshot:
    """A collector over one scrape's gauge values."""

    def __init__(self, gauges: Gauges) -> None:
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        for name, (help_, samples) in self.gauges.items():
            names = [k for k, _ in next(iter(samples), ())]
            family = GaugeMetricFamily(name, help_, labels=names)
            for labels, value in samples.items():
                family.add_metric([v for _, v in labels], value)
            yield family
