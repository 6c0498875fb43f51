"""The SuperNode's warm SuperExec (fl_server.flower.superexec): it ends with the SuperNode it serves, and refuses a
poll interval Flower would refuse with one line. (Deployments that train through it: tests/test_flower.py,
tests/test_flower_elastic.py.)"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install 'fl-edge[flower]')")

from flower_local import free_port  # noqa: E402  (beside this file)

COMMAND = [sys.executable, "-m", "fl_server.flower.superexec", "--insecure", "--runtime-api-address"]
RETRY = re.compile(r"retrying in ([0-9.]+) seconds")  # Flower's line before each backoff wait


@pytest.mark.timeout(240)
def test_the_superexec_ends_when_its_supernode_does(tmp_path: Path) -> None:
    """It ends within a few seconds of its SuperNode, also in the middle of a long retry wait (Flower backs off up
    to 20 s against a Runtime API gone with its SuperNode): before, it ended only when that wait was over."""
    supernode = subprocess.Popen(["sleep", "300"])  # stands in for the SuperNode: only its pid matters here
    log = tmp_path / "superexec.log"  # a file, not a pipe nobody reads while it runs: its writes never block
    with open(log, "wb") as out:
        superexec = subprocess.Popen([*COMMAND, f"127.0.0.1:{free_port()}", "--parent-pid", str(supernode.pid)],
                                     stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    try:  # nothing listens on its Runtime API address: without the parent's watch it would retry for ever
        deadline = time.monotonic() + 150  # up, polling, and into a wait of 8 s or more (imports: seconds, loaded)
        while not (waits := [float(w) for w in RETRY.findall(log.read_text())]) or waits[-1] < 8:
            assert superexec.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        supernode.kill()
        supernode.wait()
        killed = time.monotonic()
        assert superexec.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert time.monotonic() - killed < waits[-1] - 1, (time.monotonic() - killed, waits[-1])  # not the wait's end
    finally:
        for proc in (supernode, superexec):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_poll_interval_flower_refuses_is_refused_with_one_line() -> None:
    done = subprocess.run([*COMMAND, "127.0.0.1:9"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0"})
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "error: FLWR_SUPEREXEC_TASK_POLL_INTERVAL='0': give seconds between 0.01 and 60"]


CHILD = '''
import os, sys, time
from fl_server.flower.superexec import _clientapp

if os.fork() == 0:  # a ClientApp child in a long wait (Flower backs off up to 20 s against a Runtime API that is gone)
    _clientapp(lambda: time.sleep(120), os.getppid())
print(os.getpid(), flush=True)
time.sleep(120)
'''


def _ended(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (its parent was killed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the child's state")
def test_a_clientapp_child_ends_within_a_second_of_its_superexec() -> None:
    """The SuperExec's forked ClientApp child watches it as the SuperExec watches its SuperNode: killed in the
    middle of a long wait, the child ends within a second, where Flower's own monitor waited the wait out."""
    parent = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and int(parent.stdout.readline()) == parent.pid
        children = [int(p) for p in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()]
        assert len(children) == 1 and not _ended(children[0])
        time.sleep(0.5)  # the child's watch is up
        parent.kill()
        parent.wait()
        killed = time.monotonic()
        while not _ended(children[0]):
            assert time.monotonic() - killed < 1.5, "the ClientApp child outlived its SuperExec"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
