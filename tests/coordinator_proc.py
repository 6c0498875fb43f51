"""Start a real coordinator (``python -m fl_server.cli serve``) in a subprocess on a free port, for the
integration tests of the service and the SDK client."""
from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
ADMIN = "test-admin-token-0123456789"
# the BTFL bundle a DLE names on a store that serves none (a clients-only DLE exchange takes any)
UNSERVED_BTFL = "b" * 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Coordinator:
    url: str
    store: Path
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def wait_bundles(self, n: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = httpx.get(f"{self.url}/healthz", timeout=10).json()
            if health["bundles"] >= n:
                return
            if health["jobs"]["failed"]:
                raise RuntimeError(f"a training job failed; see {self.store}/jobs/*/log.txt")
            time.sleep(1)
        raise TimeoutError(f"{n} bundles not ready after {timeout}s; log {self.log.read_text()[-2000:]}")


def start(store: Path, methods: str = "TENT,ODPFL-HN", rounds: int = 1, workers: int = 2,
          env: dict[str, str] | None = None, tls: tuple[Path, Path, Path] | None = None,
          wrap: list[str] | None = None, port: int | None = None, open_enrollment: bool = True) -> Coordinator:
    """``env`` adds to the server's environment (e.g. ``FL_SERVE_TOKEN_RATE``); ``tls`` = (certificate, key,
    CA that signed it): serve HTTPS (``--tls-cert/--tls-key``), polled with that CA pinned; ``wrap`` is a
    command the server's command line is appended to (it must ``exec`` it, so that ``proc.pid`` is the server's); ``port``: a
    restart on the port an earlier server had (devices keep their URL), else a free one.
    ``open_enrollment``: anyone may join (FL_SERVE_ENROLLMENT=open, what most tests join with); False leaves
    the coordinator's default (an enrollment token needed)."""
    port = port or free_port()
    base = {k: v for k, v in os.environ.items() if k != "FL_SERVE_ENROLLMENT"}
    env = {**base, **({"FL_SERVE_ENROLLMENT": "open"} if open_enrollment else {}),
           "FL_SERVE_DEFAULT_METHODS": methods, "FL_SERVE_ROUNDS": str(rounds),
           "FL_SERVE_WORKERS": str(workers), "FL_ADMIN_TOKEN": ADMIN, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "edge_sdk"), os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    log = store.with_name(store.name + f"-{port}.log")
    store.mkdir(parents=True, exist_ok=True)
    https = ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])] if tls else []
    proc = subprocess.Popen([*(wrap or []), sys.executable, "-m", "fl_server.cli", "serve", "--port", str(port),
                             "--store", str(store), "--log-level", "warning", *https], env=env, cwd=REPO,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(tls[2])) if tls else True
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2, verify=verify).status_code == 200:
                return Coordinator(url, store, proc, log)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"coordinator did not answer /healthz; log {log.read_text()[-2000:]}")


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def join(url: str, method: str | None = None) -> dict:
    """Join the coordinator at ``url`` as a new client: client_id, token, methods, manifest."""
    r = httpx.post(f"{url}/v1/clients", json={"method": method}, timeout=30)
    assert r.status_code == 201, r.text
    return r.json()


def train_store(store: Path) -> Path:
    """A store whose default TENT and ODPFL-HN bundles (1 round on digits) are trained; the server stops."""
    coord = start(store)
    try:
        coord.wait_bundles(2)
    finally:
        coord.stop()
    return store


def start_copy(trained: Path, store: Path, env: dict[str, str] | None = None,
               tls: tuple[Path, Path, Path] | None = None, open_enrollment: bool = True) -> Coordinator:
    """A server on a copy of a trained store: its bundles are served at once, nothing is trained (the
    finished jobs' run directories are not needed to serve and are left out)."""
    shutil.copytree(trained, store, ignore=lambda d, names: ["jobs"] if Path(d) == trained else [])
    return start(store, env=env, tls=tls, open_enrollment=open_enrollment)
