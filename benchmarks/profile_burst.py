"""Where one 200-device burst spends its time, on both sides (the profile behind docs/coordinator.md, "Load test").

Starts ``fl-server serve`` from ``--repo`` (default: this checkout; pass an older checkout to profile its
server) inside a small wrapper that records, in the server process, every generate batch (start, duration,
size) and every garbage collection (generation, pause), then releases one burst of raw-HTTP devices
(``coordinator_load.py``'s device, connect included) that records every request's start and end. Prints:
per endpoint, when requests started / ended relative to the first join and their latency; the generate
batches relative to the first generate submitted; GC pauses per generation. Diagnostic only: numbers vary
from run to run, and the load average should be low.

    python benchmarks/profile_burst.py [--repo PATH] [--store runs/load-store] [--devices 200] [--bursts 1]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "edge_sdk"), str(HERE.parent / "tests"), str(HERE)]
import coordinator_load as load  # noqa: E402
from coordinator_proc import free_port  # noqa: E402
from raw_http import RawConnection  # noqa: E402

# Runs inside the server process (argv: port, store, dump file): wraps the batch function and the generate
# entry point, counts GC pauses, dumps everything as JSON on SIGUSR1.
SERVER_WRAPPER = r"""
import gc, json, signal, sys, time
port, store, dump = sys.argv[1:4]
from fl_server.service import hypernet
batches, submits, pauses, t = [], [], [], [0.0]
run, generate = hypernet.GenerateBatcher._run, hypernet.GenerateBatcher.generate
def _run(self, key, items):
    t0 = time.perf_counter(); out = run(self, key, items)
    batches.append((t0, time.perf_counter() - t0, len(items))); return out
async def _generate(self, bundle, emb, binary=False):
    t0 = time.perf_counter(); out = await generate(self, bundle, emb, binary); submits.append(t0); return out
hypernet.GenerateBatcher._run, hypernet.GenerateBatcher.generate = _run, _generate
def _gc(phase, info):
    if phase == "start": t[0] = time.perf_counter()
    else: pauses.append((info["generation"], t[0], time.perf_counter() - t[0]))
gc.callbacks.append(_gc)
def _dump(*_):
    with open(dump, "w") as fh: json.dump({"batches": batches, "submits": submits, "gc": pauses}, fh)
signal.signal(signal.SIGUSR1, _dump)
sys.argv = ["fl-server", "serve", "--port", port, "--store", store, "--log-level", "warning"]
from fl_server.cli import main
main()
"""


async def burst(url: str, embs: list[dict]) -> list[tuple[str, float, float]]:
    """One burst: every device joins (connect included), fetches its manifest and artifacts, generates;
    -> (endpoint, start, end) per request, perf_counter seconds."""
    events: list[tuple[str, float, float]] = []
    request = RawConnection.request

    async def timed(self, method, path, body=b"", headers=None):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = await request(self, method, path, body, headers)
        parts = path.split("?")[0].split("/")  # /v1/<endpoint>/...; /healthz is left out
        if len(parts) > 2:
            events.append((parts[2], t0, time.perf_counter()))
        return out

    RawConnection.request = timed  # type: ignore[method-assign]
    try:
        await load.load(url, embs, "raw")
    finally:
        RawConnection.request = request  # type: ignore[method-assign]
    return events


def report(events: list[tuple[str, float, float]], server: dict) -> None:
    t0 = min(s for name, s, _ in events if name == "clients")
    print("client side, ms from the first join (start p0/50/100 | end p0/50/100 | latency p50/p99):")
    for name, label in (("clients", "join"), ("manifest", "manifest"), ("artifacts", "artifact"),
                        ("hypernetwork", "generate")):
        ev = 1e3 * np.array([(s - t0, e - t0) for n, s, e in events if n == name])
        pct = lambda v, q: np.percentile(v, q).round(0).astype(int).tolist()  # noqa: E731
        print(f"  {label:>9}: {pct(ev[:, 0], [0, 50, 100])} | {pct(ev[:, 1], [0, 50, 100])} | "
              f"{pct(ev[:, 1] - ev[:, 0], [50, 99])}")
    first = min((s for s in server["submits"] if s >= t0), default=t0)
    print("server side, generate batches (ms from the first generate submitted: start, duration, size):")
    for start, dur, k in server["batches"]:
        if start >= first - 0.01:
            print(f"  start {1e3 * (start - first):7.1f}  duration {1e3 * dur:6.1f}  K={k}")
    print("server side, garbage collections during the burst (both clocks are CLOCK_MONOTONIC):")
    for gen in (0, 1, 2):
        p = [d for g, start, d in server["gc"] if g == gen and start >= t0]
        if p:
            print(f"  gc generation {gen}: {len(p)} passes, total {1e3 * sum(p):.1f} ms, longest {1e3 * max(p):.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=str(HERE.parent), help="checkout whose server is profiled")
    ap.add_argument("--store", default="runs/load-store", help="a trained store (coordinator_load.py makes one)")
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--bursts", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for the server's bundles")
    args = ap.parse_args()
    repo, store = Path(args.repo).resolve(), Path(args.store).resolve()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "server.json"
        env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{repo / 'edge_sdk'}", "OMP_NUM_THREADS": "1",
               "FL_SERVE_DEFAULT_METHODS": "TENT,ODPFL-HN", "FL_SERVE_WORKERS": "2", "FL_SERVE_ENROLLMENT": "open",
               "FL_ADMIN_TOKEN": "profile-burst-admin-token"}  # 16+ characters, as the server requires
        log = open(Path(tmp) / "server.log", "w+")
        proc = subprocess.Popen([sys.executable, "-c", SERVER_WRAPPER, str(port), str(store), str(dump)],
                                cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + args.start_timeout
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).json()["bundles"] >= 2:
                        break
                except (httpx.TransportError, ValueError, KeyError):
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"no trained coordinator at {url} (store {store}); server output:\n"
                                     + log.read()[-3000:])
                time.sleep(0.5)
            embs = load.embeddings(url, args.devices)
            for b in range(args.bursts):
                events = asyncio.run(burst(url, embs))
                proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                print(f"== burst {b + 1}, server from {repo}")
                report(events, json.loads(dump.read_text()))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
