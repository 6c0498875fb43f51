"""Load test of one coordinator process: N concurrent simulated devices (asyncio + httpx), each doing
join -> manifest -> download every artifact of its bundle -> ODPFL-HN generate, all released at once.

    python benchmarks/coordinator_load.py [--devices 200] [--server URL | --store DIR] [--out docs/benchmarks/coordinator-load.json]

Without --server it starts `fl-server serve` on --store (training TENT and ODPFL-HN on the embedded digits
first if that store is empty; only serving is timed). Each device's embedding is computed beforehand on
real digits with the bundle's encoder graph (onnxruntime), as a device would; the timed part is HTTP only.
Writes rows in the DESIGN.md benchmark schema: p50/p99 latency per endpoint, throughput, errors.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "edge_sdk"), str(REPO / "tests")]
ENDPOINTS = ("join", "manifest", "artifact", "generate")


def embeddings(url: str, n: int) -> tuple[str, list[list[float]]]:
    """n real embeddings (disjoint digits subsets through the ODPFL-HN bundle's encoder graph)."""
    from edge_sdk import EdgeClient
    from fl_server.data import load_dataset

    with EdgeClient(url, cache_dir=REPO / "runs" / "load-cache") as c:
        bundle = c.download(c.manifest("ODPFL-HN"))
    enc = bundle.session("encoder", threads=1)
    gamma = {f"gamma.{k}": v for k, v in bundle.weights("enc").items()}
    x = load_dataset("digits", split="all").x.astype(np.float32)
    sets = np.array_split(np.random.default_rng(0).permutation(len(x)), n)
    return bundle.manifest["method"], [enc.run(["embedding"], {"x": x[s], **gamma})[0].tolist() for s in sets]


async def device(client: httpx.AsyncClient, embedding: list[float], lat: dict[str, list[float]],
                 errors: list[str]) -> None:
    async def timed(name: str, method: str, path: str, **kw: object) -> httpx.Response | None:
        t0 = time.perf_counter()
        try:
            r = await client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            errors.append(f"{name}: {type(exc).__name__}")
            return None
        lat[name].append(1e3 * (time.perf_counter() - t0))
        if r.status_code >= 400:
            errors.append(f"{name}: HTTP {r.status_code}")
            return None
        return r

    r = await timed("join", "POST", "/v1/clients", json={"method": "ODPFL-HN"})
    if r is None:
        return
    token = r.json()["token"]
    r = await timed("manifest", "GET", "/v1/manifest", params={"method": "ODPFL-HN"})
    if r is None:
        return
    for a in r.json()["artifacts"]:
        got = await timed("artifact", "GET", a["url"])
        if got is not None and len(got.content) != a["size"]:
            errors.append("artifact: wrong size")
    await timed("generate", "POST", "/v1/hypernetwork/generate", json={"embedding": embedding},
                headers={"Authorization": f"Bearer {token}"})


async def load(url: str, embs: list[list[float]]) -> tuple[dict[str, list[float]], list[str], float]:
    """All devices at once; each has its own connection (one httpx client per device, as on real devices;
    a single shared pool of hundreds of connections costs the load generator O(n) per request)."""
    lat: dict[str, list[float]] = {k: [] for k in ENDPOINTS}
    errors: list[str] = []
    tls = ssl.create_default_context()  # built once, not per client
    clients = [httpx.AsyncClient(base_url=url, timeout=60, verify=tls, limits=httpx.Limits(max_connections=1))
               for _ in embs]
    try:
        await clients[0].get("/healthz")
        t0 = time.perf_counter()
        await asyncio.gather(*(device(c, e, lat, errors) for c, e in zip(clients, embs)))
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    return lat, errors, wall


def _server_means(metrics: str) -> dict[str, float]:
    """Mean server-side latency (ms) per route from the Prometheus histogram sums and counts."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in metrics.splitlines():
        for suffix, into in (("_sum{", sums), ("_count{", counts)):
            if line.startswith("fl_http_request_duration_seconds" + suffix):
                route = line.split('route="', 1)[1].split('"', 1)[0]
                into[route] = into.get(route, 0.0) + float(line.rsplit(" ", 1)[1])
    return {r: 1e3 * sums[r] / counts[r] for r in sums if counts.get(r)}


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    ap.add_argument("--server", default=None, help="an already running coordinator")
    ap.add_argument("--store", default="runs/load-store", help="store of the coordinator started here")
    ap.add_argument("--out", default="docs/benchmarks/coordinator-load.json")
    args = ap.parse_args()
    from coordinator_proc import start

    coord = None
    if args.server is None:
        coord = start(Path(args.store).resolve(), methods="TENT,ODPFL-HN", rounds=5, workers=2)
        coord.wait_bundles(2, timeout=900)
    url = args.server or coord.url
    try:
        _, embs = embeddings(url, args.devices)
        load_before = os.getloadavg()
        server_cpu0 = _cpu_seconds(coord.proc.pid) if coord else None
        client_cpu0 = time.process_time()
        lat, errors, wall = _run(load(url, embs))
        client_cpu = time.process_time() - client_cpu0
        server_cpu = _cpu_seconds(coord.proc.pid) - server_cpu0 if coord else None
        load_after = os.getloadavg()
        server_side = _server_means(httpx.get(f"{url}/metrics", timeout=30).text)
    finally:
        if coord is not None:
            coord.stop()
    requests = sum(len(v) for v in lat.values())
    command = "python benchmarks/coordinator_load.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    common = {"experiment": "coordinator-load", "devices": args.devices, "device": "cpu", "machine": machine(),
              "server": "one uvicorn process (fl-server serve), load generator on the same machine",
              "cpu_s_server": None if server_cpu is None else round(server_cpu, 2), "cpu_s_client": round(client_cpu, 2),
              "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
              "command": command}
    rows = []
    for name in ENDPOINTS:
        v = np.asarray(lat[name])
        for metric, value in (("latency_p50_ms", np.percentile(v, 50)), ("latency_p99_ms", np.percentile(v, 99))):
            rows.append({**common, "endpoint": name, "metric": metric, "value": round(float(value), 2),
                         "requests": len(v), "target": 200.0 if name in ("join", "generate") and "p99" in metric
                         else None})
    for name, route in (("join", "/v1/clients"), ("manifest", "/v1/manifest"), ("artifact", "/v1/artifacts/{sha256}"),
                        ("generate", "/v1/hypernetwork/generate")):
        if route in server_side:
            rows.append({**common, "endpoint": name, "metric": "server_side_mean_ms",
                         "value": round(server_side[route], 2), "note": "inside the server process (/metrics), "
                         "from request arrival to response; includes waiting for the event loop"})
    rows.append({**common, "endpoint": "all", "metric": "throughput_rps", "value": round(requests / wall, 1),
                 "requests": requests, "wall_s": round(wall, 3)})
    rows.append({**common, "endpoint": "all", "metric": "devices_per_s", "value": round(args.devices / wall, 1)})
    rows.append({**common, "endpoint": "all", "metric": "errors", "value": len(errors),
                 "examples": sorted(set(errors))[:5]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(f"{r['endpoint']:>9} {r['metric']:>15}: {r['value']}")
    print(f"wrote {out}")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
