"""A Flower deployment on this machine: one SuperLink and N SuperNodes as separate processes on loopback
(insecure), each SuperNode holding one training client's data (its ``--node-config``). What the tests, the
benchmark and ``examples/flower_devices.py`` run; on real devices the same commands run on separate machines with
TLS (docs/flower.md). Each SuperNode runs with ``--isolation process`` beside its own SuperExec,
``python -m fl_server.flower.superexec`` (each message's ClientApp process a fork of it, Flower and torch imported
once; it ends with its SuperNode, and :meth:`LocalDeployment.kill` kills both); the processes get a 0.1 s
SuperExec poll (:data:`FAST_POLLS`), a per-deployment data cache (``FL_FLOWER_CACHE``) and no telemetry.

Example:
    >>> with LocalDeployment(num_nodes=3, workdir=Path("runs/flower-local")) as dep:  # doctest: +SKIP
    ...     dep.run({"method": "FedAvg", "rounds": 3, "run-dir": "runs/flower-local/run"}, app_dir)
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import tomli_w

# Flower's poll intervals it lets a deployment set (flwr 1.42): the SuperExec's poll for a message to start a
# ClientApp for (Flower's default 1 s; fl_server.flower.superexec's 0.1 s). The SuperNode's own 3 s poll of the
# SuperLink when idle, and its 0.5 s poll for the ClientApp's reply, are fixed in flwr.
FAST_POLLS = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}:\n"
                               f"{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def processes_with(flwr_home: Path) -> list[int]:
    """The live processes whose environment sets ``FLWR_HOME=flwr_home``: everything a deployment started, those
    Flower detaches into sessions of their own too (Linux's /proc; [] elsewhere)."""
    tag, found = f"FLWR_HOME={flwr_home}".encode(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if tag in (entry / "environ").read_bytes().split(bytes(1)):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _wait_gone(flwr_home: Path, seconds: float) -> list[int]:
    """Wait up to ``seconds`` for :func:`processes_with` ``flwr_home`` to be none; returns those left."""
    deadline = time.monotonic() + seconds
    while (left := processes_with(flwr_home)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


class LocalDeployment:
    """SuperLink + ``num_nodes`` SuperNodes under ``workdir``; stopped on exit. Node i's ``--node-config`` is
    ``node_configs[i]`` (default ``partition-id=i``). ``link_args`` / ``node_args`` replace ``--insecure`` (TLS
    and SuperNode authentication flags), ``connection`` the ``flwr`` connection's ``insecure = true``."""

    def __init__(self, num_nodes: int, workdir: Path, startup_timeout: float = 120.0,
                 env: dict[str, str] | None = None, node_configs: list[str] | None = None,
                 link_args: list[str] | None = None, node_args: list[list[str]] | None = None,
                 connection: dict[str, Any] | None = None) -> None:
        self.num_nodes, self.workdir, self.startup_timeout = num_nodes, Path(workdir), startup_timeout
        self.node_configs = node_configs or [f"partition-id={i}" for i in range(num_nodes)]
        self.link_args, self.connection = link_args or ["--insecure"], connection or {"insecure": True}
        self.node_args = node_args or [["--insecure"]] * num_nodes
        self.procs: list[subprocess.Popen] = []
        self.nodes: list[subprocess.Popen] = []
        self.superexecs: dict[int, subprocess.Popen] = {}  # a SuperNode's pid -> its SuperExec
        self.outputs: dict[int, Path] = {}  # a launched run's pid -> its output file
        bin_dir = str(Path(sys.executable).parent)  # the SuperLink's flower-superexec and flwr-serverapp: on PATH
        self.env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
                    "FLWR_HOME": str(self.workdir / "flwr-home"), "OMP_NUM_THREADS": "1",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_TELEMETRY_ENABLED": "0",  # no call home from tests
                    **(env or {})}
        for key, value in {**FAST_POLLS, "FL_FLOWER_CACHE": str(self.workdir / "node-cache")}.items():
            self.env.setdefault(key, value)  # the nodes' prepared data stays with the deployment
        self.port = 0

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as fh:  # each in its own process group: stop() ends it with its workers
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self) -> LocalDeployment:
        self.start_link()
        for i in range(self.num_nodes):
            self.start_node(self.node_args[i], self.node_configs[i], f"supernode-{i}")
        return self

    def start_link(self) -> None:
        """The SuperLink, and the ``local-deployment`` connection to it in ``$FLWR_HOME/config.toml``."""
        home = self.workdir / "flwr-home"
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        (home / "config.toml").write_text(tomli_w.dumps({"superlink": {
            "default": "local-deployment",
            "local-deployment": {"address": f"127.0.0.1:{self.port}", **self.connection}}}))
        link_log = self.workdir / "superlink.log"
        link = self._spawn([str(Path(sys.executable).parent / "flower-superlink"), *self.link_args, "--host",
                            "127.0.0.1", "--port", str(self.port), "--disable-runtime-dependency-installation"],
                           link_log)
        _wait_port(self.port, link, self.startup_timeout, log=link_log)

    def spawn_node(self, args: list[str], node_config: str, name: str) -> tuple[subprocess.Popen, int]:
        """(the SuperNode process, its port): a SuperNode with ``args`` and ``--node-config node_config`` (log:
        ``workdir/name.log``), just started -- one the SuperLink refuses may exit before it ever listens."""
        node_port, log = free_port(), self.workdir / f"{name}.log"
        node = self._spawn([str(Path(sys.executable).parent / "flower-supernode"), *args, "--isolation", "process",
                            "--superlink", f"127.0.0.1:{self.port}", "--port", str(node_port),
                            "--node-config", node_config], log)
        return node, node_port

    def start_node(self, args: list[str], node_config: str, name: str) -> subprocess.Popen:
        """A SuperNode with ``args`` and ``--node-config node_config`` (log: ``workdir/name.log``), once it listens,
        and its SuperExec (:mod:`fl_server.flower.superexec`; same log)."""
        node, node_port = self.spawn_node(args, node_config, name)
        log = self.workdir / f"{name}.log"
        _wait_port(node_port, node, self.startup_timeout, log)
        self.superexecs[node.pid] = self._spawn(
            [sys.executable, "-m", "fl_server.flower.superexec", "--runtime-api-address", f"127.0.0.1:{node_port}",
             "--insecure", "--parent-pid", str(node.pid)], log)
        self.nodes.append(node)
        return node

    def run(self, run_config: dict[str, Any], app_dir: Path, timeout: float = 600.0) -> str:
        """``flwr run`` the app with ``run_config`` overrides and wait for it; returns its output. Fails when the
        run fails (the ServerApp's traceback is in the output)."""
        return self.finish(self.launch(run_config, app_dir), timeout)

    def launch(self, run_config: dict[str, Any], app_dir: Path, name: str = "run") -> subprocess.Popen:
        """``flwr run --stream`` the app with ``run_config`` overrides in the background (output in
        ``workdir/name.out``); :meth:`finish` waits for it."""
        overrides = self.workdir / f"{name}-config.toml"
        overrides.write_text(tomli_w.dumps({"min-nodes": self.num_nodes, **run_config}))
        flwr = str(Path(sys.executable).parent / "flwr")
        output = self.workdir / f"{name}.out"
        with open(output, "w") as out:
            proc = subprocess.Popen([flwr, "run", str(app_dir), "local-deployment", "--run-config", str(overrides),
                                     "--stream"], env=self.env, cwd=self.workdir, stdout=out,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append(proc)
        self.outputs[proc.pid] = output
        return proc

    def finish(self, proc: subprocess.Popen, timeout: float = 600.0) -> str:
        """Wait for a run :meth:`launch` started; returns its output, fails when the run fails."""
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        text = self.outputs[proc.pid].read_text()
        if proc.returncode != 0 or "ServerApp raised an exception" in text:
            raise RuntimeError(f"flwr run failed ({proc.returncode}):\n{text[-5000:]}")
        return text

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL a process this deployment started and everything in its process group; a SuperNode with its
        SuperExec and ClientApp processes (as a device that loses power)."""
        for p in (proc, self.superexecs.pop(proc.pid, None)):
            if p is not None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)

    def stop(self) -> None:
        """End every process this deployment started (its process groups: the SuperExec workers too)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            try:  # the group's other members too (a SuperExec or ClientApp outliving its SuperNode), even where
                os.killpg(proc.pid, signal.SIGKILL)  # the leader itself exited on SIGTERM
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)
        # Flower detaches the SuperLink's SuperExec (and its ServerApps) into a session of its own: they end when
        # the SuperLink has (their --parent-pid watch), a moment later; any still running after 15 s is SIGKILLed
        home = Path(self.env["FLWR_HOME"])
        for pid in _wait_gone(home, 15):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_gone(home, 5)
        self.procs.clear()
        self.nodes.clear()
        self.superexecs.clear()

    def __enter__(self) -> LocalDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
