"""Load test of one coordinator process: N concurrent simulated devices, each on its own connection, doing
join -> manifest -> download every artifact of its bundle -> ODPFL-HN generate, all released at once.

    python benchmarks/coordinator_load.py [--devices 200] [--server URL --server-pid PID | --store DIR]
        [--pin none|split] [--client raw|httpx] [--preconnect] [--out docs/benchmarks/coordinator-load.json]

Without --server it starts `fl-server serve` on --store (training TENT and ODPFL-HN on the embedded digits
first if that store is empty; only serving is timed). Each device's embedding is computed beforehand on
real digits with the bundle's encoder graph (onnxruntime), as a device would; the timed part is HTTP only.
The generator is its own process; by default both share the cores (``--pin split``: server on CPU 0,
generator on CPU 1). The devices speak HTTP/1.1 through ``raw_http.py`` by default, a minimal keep-alive
client (like wrk or vegeta) that costs ~0.25 ms of CPU per request: real devices bring their own CPUs, but on
the 2-core measurement box the load generator shares the server's cores. ``--client httpx`` uses the device
SDK's HTTP stack instead (~1 ms per request: the generator then needs 3x the server's CPU, and the server waits
for a core); ``--preconnect`` opens every connection before the clock starts (diagnostic). See
docs/coordinator.md, "Load test". Writes rows in the DESIGN.md benchmark schema: client-observed
p50/p99 latency per endpoint, the server's own latency histograms (/metrics), throughput, errors, CPU seconds
of each side and the 1-minute load average before and after.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import ssl
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "edge_sdk"), str(REPO / "tests"), str(REPO / "benchmarks")]
from edge_sdk import _tensors as tensors  # noqa: E402  (after the path set-up: runs from a checkout)
from raw_http import RawConnection  # noqa: E402

ENDPOINTS = ("join", "manifest", "artifact", "generate")
ROUTES = {"join": "/v1/clients", "manifest": "/v1/manifest", "artifact": "/v1/artifacts/{sha256}",
          "generate": "/v1/hypernetwork/generate"}
TARGET_MS = 200.0  # the coordinator's target: p99 under 200 ms for join and generate
JSON = {"Content-Type": "application/json"}
JOIN_BODY = b'{"method": "ODPFL-HN"}'
# no per-read/write timeouts: each one costs an anyio cancel scope with a timer (17% of this generator's CPU);
# the whole run of a device has one deadline instead (DEVICE_DEADLINE_S)
TIMEOUT = {"timeout": httpx.Timeout(None).as_dict()}
DEVICE_DEADLINE_S = 120.0


def embeddings(url: str, n: int) -> list[dict]:
    """n generate requests of real embeddings (disjoint digits subsets through the ODPFL-HN bundle's encoder
    graph), each naming that bundle."""
    from edge_sdk import EdgeClient
    from fl_server.data import load_dataset

    with EdgeClient(url, cache_dir=REPO / "runs" / "load-cache") as c:
        bundle = c.download(c.manifest("ODPFL-HN"))
    enc = bundle.session("encoder", threads=1)
    gamma = {f"gamma.{k}": v for k, v in bundle.weights("enc").items()}
    x = load_dataset("digits", split="all").x.astype(np.float32)
    sets = np.array_split(np.random.default_rng(0).permutation(len(x)), n)
    return [{"embedding": enc.run(["embedding"], {"x": x[s], **gamma})[0].tolist(), "bundle_id": bundle.id}
            for s in sets]


def _no_failing_sniffio_import() -> None:
    """httpcore 1.0 runs ``import sniffio`` on every async request and connection release; when sniffio is
    not installed (it is no longer a dependency of anyio / httpx) each call is a failed import that scans
    sys.path: 26% of this generator's CPU in a py-spy profile. A None entry makes that import fail at once,
    which httpcore already handles (it assumes asyncio)."""
    try:
        import sniffio  # noqa: F401
    except ImportError:
        sys.modules["sniffio"] = None  # type: ignore[assignment]


class HttpxConnection:
    """One device's connection through an httpx transport (no client-level auth / redirect / cookie machinery:
    the generator shares two cores with the server, so it does as little per request as it can)."""

    def __init__(self, url: str, tls: ssl.SSLContext) -> None:
        self.url = url
        self.transport = httpx.AsyncHTTPTransport(verify=tls, limits=httpx.Limits(max_connections=1))

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        req = httpx.Request(method, self.url + path, content=body or None, headers=headers, extensions=TIMEOUT)
        r = await self.transport.handle_async_request(req)
        data = await r.aread()
        await r.aclose()
        return r.status_code, {k.lower(): v for k, v in r.headers.items()}, data

    async def aclose(self) -> None:
        await self.transport.aclose()


Connection = HttpxConnection | RawConnection


async def device(conn: Connection, body: bytes, lat: dict[str, list[float]], errors: list[str]) -> None:
    """One device: join -> manifest -> every artifact -> generate (binary reply, as edge_sdk asks for it).
    Request bodies are encoded beforehand (a real device has its own CPU); replies are parsed as needed."""
    async def timed(name: str, method: str, path: str, content: bytes = b"",
                    headers: dict[str, str] | None = None) -> bytes | None:
        t0 = time.perf_counter()
        try:
            status, _, data = await conn.request(method, path, content, headers)
        except (httpx.HTTPError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors.append(f"{name}: {type(exc).__name__}")
            return None
        lat[name].append(1e3 * (time.perf_counter() - t0))
        if status >= 400:
            errors.append(f"{name}: HTTP {status}")
            return None
        return data

    got = await timed("join", "POST", "/v1/clients", JOIN_BODY, JSON)
    if got is None:
        return
    token = json.loads(got)["token"]
    got = await timed("manifest", "GET", "/v1/manifest?method=ODPFL-HN")
    if got is None:
        return
    for a in json.loads(got)["artifacts"]:
        art = await timed("artifact", "GET", a["url"])
        if art is not None and len(art) != a["size"]:
            errors.append("artifact: wrong size")
    got = await timed("generate", "POST", "/v1/hypernetwork/generate", body,
                      {**JSON, "Authorization": f"Bearer {token}", "Accept": tensors.MEDIA_TYPE})
    if got is not None:
        try:  # outside the timed part: the reply must be a valid weights body
            tensors.decode(got)
        except ValueError as exc:
            errors.append(f"generate: {exc}")


async def _deadline(run: Coroutine[Any, Any, None], errors: list[str]) -> None:
    try:
        await asyncio.wait_for(run, DEVICE_DEADLINE_S)
    except asyncio.TimeoutError:
        errors.append(f"device: not done after {DEVICE_DEADLINE_S:.0f} s")


async def load(url: str, embs: list[dict], client: str,
               preconnect: bool = False) -> tuple[dict[str, list[float]], list[str], float]:
    """All devices at once; each has its own connection (as on real devices; a single shared pool of hundreds
    of connections costs the load generator O(n) per request). The TCP connect is part of each device's join
    unless ``preconnect`` (diagnostic: every connection opened, with a /healthz, before the clock starts)."""
    lat: dict[str, list[float]] = {k: [] for k in ENDPOINTS}
    errors: list[str] = []
    tls = ssl.create_default_context()  # built once, not per connection
    conns: list[Connection] = [HttpxConnection(url, tls) if client == "httpx" else RawConnection(url) for _ in embs]
    bodies = [json.dumps(e).encode() for e in embs]
    try:
        await asyncio.gather(*(c.request("GET", "/healthz") for c in (conns if preconnect else conns[:1])))
        t0 = time.perf_counter()
        await asyncio.gather(*(_deadline(device(c, b, lat, errors), errors) for c, b in zip(conns, bodies)))
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.aclose() for c in conns), return_exceptions=True)
    return lat, errors, wall


def server_histograms(metrics: str) -> dict[str, dict[str, float]]:
    """Per route, from /metrics: cumulative request counts per latency bucket (le, in ms), the sum and count."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics.splitlines():
        if not line.startswith("fl_http_request_duration_seconds"):
            continue
        route = line.split('route="', 1)[1].split('"', 1)[0]
        h = out.setdefault(route, {})
        value = float(line.rsplit(" ", 1)[1])
        if "_bucket{" in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            h["+Inf" if le == "+Inf" else f"{1e3 * float(le):g}"] = value
        elif "_sum{" in line:
            h["sum_s"] = value
        elif "_count{" in line:
            h["count"] = value
    return out


def bucket_quantile(hist: dict[str, float], q: float) -> float | None:
    """Upper bound (ms) of the histogram bucket holding quantile q (the Prometheus-style estimate's ceiling)."""
    bounds = sorted((float(k), v) for k, v in hist.items() if k not in ("+Inf", "sum_s", "count"))
    need = q * hist.get("count", 0)
    return next((le for le, cum in bounds if cum >= need), None)


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int]) -> None:
    """CPU affinity of every thread of ``pid`` (sched_setaffinity on a pid sets one thread only); threads
    started later inherit their creator's."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def _run(coro):  # type: ignore[no-untyped-def]
    """asyncio.run on uvloop when it is installed (the load generator must not be the bottleneck)."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--server", default=None, help="an already running coordinator (--server-pid: its pid, "
                                                   "for its CPU time and pinning)")
    ap.add_argument("--server-pid", type=int, default=None)
    ap.add_argument("--store", default="runs/load-store", help="store of the coordinator started here")
    ap.add_argument("--pin", choices=("none", "split"), default="none",
                    help="none (default): server and generator share both cores; split: server on CPU 0, this "
                         "generator on CPU 1 (worse on a machine shared with other jobs: neither can use the "
                         "core the other leaves idle)")
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw",
                    help="raw (default): benchmarks/raw_http.py, a minimal HTTP/1.1 client, ~4x cheaper per request "
                         "than httpx, so the generator sharing the 2 cores takes less from the server; httpx: the "
                         "device SDK's HTTP stack (its CPU then dominates a 2-core run)")
    ap.add_argument("--preconnect", action="store_true",
                    help="open every device's connection before the clock starts (diagnostic: the join's latency "
                         "without a storm of 200 simultaneous TCP connects)")
    ap.add_argument("--out", default="docs/benchmarks/coordinator-load.json")
    args = ap.parse_args()
    from coordinator_proc import start

    _no_failing_sniffio_import()
    coord = None
    if args.server is None:
        coord = start(Path(args.store).resolve(), methods="TENT,ODPFL-HN", rounds=5, workers=2)
        coord.wait_bundles(2, timeout=900)
    url = args.server or coord.url
    server_pid = coord.proc.pid if coord else args.server_pid
    try:
        embs = embeddings(url, args.devices)
        if args.pin == "split":
            if server_pid is None or (os.cpu_count() or 1) < 2:
                raise SystemExit("error: --pin split needs 2 cores and the server's pid")
            pin(server_pid, {0})
            pin(os.getpid(), {1})
        load_before = os.getloadavg()
        server_cpu0 = _cpu_seconds(server_pid) if server_pid else None
        client_cpu0 = time.process_time()
        lat, errors, wall = _run(load(url, embs, args.client, args.preconnect))
        client_cpu = time.process_time() - client_cpu0
        server_cpu = _cpu_seconds(server_pid) - server_cpu0 if server_pid else None
        load_after = os.getloadavg()
        hists = server_histograms(httpx.get(f"{url}/metrics", timeout=30).text)
    finally:
        if coord is not None:
            coord.stop()
    requests = sum(len(v) for v in lat.values())
    command = "python benchmarks/coordinator_load.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    cores = ("server pinned to CPU 0, load generator pinned to CPU 1 (one core each)" if args.pin == "split"
             else "server and load generator share both cores (no pinning)")
    common = {"experiment": "coordinator-load", "devices": args.devices, "device": "cpu", "machine": machine(),
              "server": "one uvicorn process (fl-server serve: uvloop, batched accepts, httptools, no access log); "
                        "load generator "
                        f"in a separate process (asyncio + {'httpx transports' if args.client == 'httpx' else 'raw_http.py'}"
                        ", one connection per device)",
              "cores": cores, "pin": args.pin, "client": args.client, "preconnect": args.preconnect,
              "cpu_s_server": None if server_cpu is None else round(server_cpu, 2),
              "cpu_s_client": round(client_cpu, 2),
              "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
              "command": command}
    rows = []
    for name in ENDPOINTS:
        v = np.asarray(lat[name])
        for metric, value in (("latency_p50_ms", np.percentile(v, 50)), ("latency_p99_ms", np.percentile(v, 99))):
            rows.append({**common, "endpoint": name, "metric": metric, "value": round(float(value), 2),
                         "requests": len(v), "target": TARGET_MS if name in ("join", "generate") and "p99" in metric
                         else None, "note": "client-observed: request sent -> whole response read"})
    for name, route in ROUTES.items():
        h = hists.get(route)
        if not h or not h.get("count"):
            continue
        rows.append({**common, "endpoint": name, "metric": "server_side_mean_ms",
                     "value": round(1e3 * h["sum_s"] / h["count"], 2),
                     "server_side_p99_bucket_ms": bucket_quantile(h, 0.99), "histogram_cumulative": h,
                     "note": "inside the server process (/metrics, every request since it started): from the "
                             "ASGI call (request parsed) to the last body byte handed to the transport; includes "
                             "waiting for the event loop and the batch worker, not the socket queues"})
    rows.append({**common, "endpoint": "all", "metric": "throughput_rps", "value": round(requests / wall, 1),
                 "requests": requests, "wall_s": round(wall, 3)})
    rows.append({**common, "endpoint": "all", "metric": "devices_per_s", "value": round(args.devices / wall, 1)})
    rows.append({**common, "endpoint": "all", "metric": "errors", "value": len(errors),
                 "examples": sorted(set(errors))[:5]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(f"{r['endpoint']:>9} {r['metric']:>19}: {r['value']}")
    print(f"cpu s: server {common['cpu_s_server']}, generator {common['cpu_s_client']}; load {common['loadavg_1m_before_after']}")
    print(f"wrote {out}")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
