"""The SuperNode's warm SuperExec (fl_server.flower.superexec): it ends with the SuperNode it serves, and refuses a
poll interval Flower would refuse with one line. (Deployments that train through it: tests/test_flower.py,
tests/test_flower_elastic.py.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install 'fl-edge[flower]')")

from flower_local import free_port  # noqa: E402  (beside this file)

COMMAND = [sys.executable, "-m", "fl_server.flower.superexec", "--insecure", "--runtime-api-address"]


@pytest.mark.timeout(120)
def test_the_superexec_ends_when_its_supernode_does() -> None:
    supernode = subprocess.Popen(["sleep", "300"])  # stands in for the SuperNode: only its pid matters here
    superexec = subprocess.Popen([*COMMAND, f"127.0.0.1:{free_port()}", "--parent-pid", str(supernode.pid)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    try:  # nothing listens on its Runtime API address: without the parent's watch it would retry for ever
        with pytest.raises(subprocess.TimeoutExpired):
            superexec.wait(timeout=3)
        supernode.kill()
        supernode.wait()
        assert superexec.wait(timeout=90) == 0, superexec.stdout.read() if superexec.stdout else ""
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
