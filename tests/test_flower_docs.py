"""docs/flower.md's commands, run as written, on loopback: the page's bash block is read and each of its commands
runs as a user would type it, with only what a single test machine must change (SUPERLINK_HOST = 127.0.0.1 and
0.0.0.0 = 127.0.0.1, free ports for 9093 and each SuperNode's 9094, one directory per "machine", the SuperNode
line once per node with that node's own image folder, and a smoke-sized run: 2 rounds of 10 local iterations). The
``flwr`` connection is the one the page's comments spell out. The exported bundle then personalises on the
torch-free SDK, and no process of the deployment outlives the test. A command added to the page that this test
does not know fails it, so the page cannot drift from what runs."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install 'fl-edge[flower]')")

from flower_local import LocalDeployment, free_port, processes_of, wait_port, write_node_data  # noqa: E402  (beside this file)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "flower.md"
BIN = Path(sys.executable).parent
SMOKE = {"rounds=50": "rounds=2 local-iterations=10"}  # the page's full run, at a test's size


def doc_block(text: str) -> tuple[list[str], str]:
    """(the commands of the page's first bash block, continuation lines joined; the ``flwr`` connection TOML
    spelled out in its comments)."""
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, f"{DOC} has no ```bash block"
    commands, toml, line = [], [], ""
    for raw in block.group(1).splitlines():
        if raw.lstrip().startswith("#"):
            snippet = re.match(r"#\s{4,}(\[superlink\.[\w.-]+\]|[\w-]+ = .+)$", raw.strip())
            if snippet:
                toml.append(snippet.group(1))
            continue
        line += raw.rstrip()
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        if line.strip():
            commands.append(line.strip())
        line = ""
    return commands, "\n".join(toml) + "\n"


@pytest.mark.timeout(600)
def test_the_flower_page_runs_as_written(tmp_path: Path, fashion_all) -> None:  # type: ignore[no-untyped-def]
    commands, connection = doc_block(DOC.read_text())
    link_port = free_port()

    def on_this_machine(cmd: str) -> str:
        cmd = cmd.replace("SUPERLINK_HOST:9093", f"127.0.0.1:{link_port}").replace("0.0.0.0", "127.0.0.1")
        return cmd.replace("--port 9093", f"--port {link_port}")

    link_dir, run_from = tmp_path / "superlink", REPO  # `flwr run examples/flower`: from the clone
    link_dir.mkdir()
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(on_this_machine(connection))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "FLWR_HOME": str(home),
           "OMP_NUM_THREADS": "1", "FLWR_DISABLE_UPDATE_CHECK": "1", "FL_FLOWER_CACHE": str(tmp_path / "cache"),
           "FL_DATA_DIR": str(tmp_path / "no-shared-data")}  # the nodes hold their data; no data set anywhere
    sources, idx = write_node_data(fashion_all, tmp_path / "images", nodes=4, per_node=100, folders=4)
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str], cwd: Path, log: Path) -> subprocess.Popen:
        with open(log, "wb") as fh:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        procs.append(proc)
        return proc

    def is_node_command(argv: list[str]) -> bool:  # what runs on a SuperNode's machine
        return argv[0] == "flower-supernode" or argv[:3] == ["python", "-m", "fl_server.flower.superexec"]

    def start_nodes(group: list[str]) -> None:
        """The page's SuperNode lines, once per node, each node its own directory ("machine") and port."""
        for k, source in enumerate(sources[:3]):  # three training clients
            node_dir, node_port, last_pid = tmp_path / f"node-{k}", free_port(), ""
            node_dir.mkdir()
            log = tmp_path / f"supernode-{k}.log"
            for cmd in group:
                cmd = cmd.replace("127.0.0.1:9094", f"127.0.0.1:{node_port}").replace("--port 9094",
                                                                                       f"--port {node_port}")
                argv = shlex.split(cmd.replace("$!", last_pid), comments=True)
                argv = argv[:-1] if argv[-1] == "&" else argv  # every node process runs in the background here
                if argv[0] == "flower-supernode":
                    folder = re.search(r"data='([^']+)'", cmd)
                    assert folder, cmd
                    (node_dir / folder.group(1)).parent.mkdir(parents=True)
                    (tmp_path / "images" / source).rename(node_dir / folder.group(1))
                    proc = spawn([str(BIN / argv[0]), *argv[1:]], node_dir, log)
                    wait_port(node_port, proc, 120.0, log)
                else:
                    proc = spawn([sys.executable, *argv[1:]], node_dir, log)
                last_pid = str(proc.pid)

    seen, run_out, nodes_started = set(), "", False
    try:
        for cmd in commands:
            argv = shlex.split(on_this_machine(cmd), comments=True)
            program = argv[0]
            seen.add(program)
            if is_node_command(argv):
                if not nodes_started:  # the page's consecutive SuperNode lines, run as one group per node
                    group = [on_this_machine(c) for c in commands
                             if is_node_command(shlex.split(on_this_machine(c), comments=True))]
                    start_nodes(group)
                    nodes_started = True
            elif program == "pip":  # installed already (the test runs in it); the page names the extra
                assert argv[1:] == ["install", "-e", ".[flower]"], argv
            elif program == "export":
                key, _, value = argv[1].partition("=")
                env[key] = value
            elif program == "flower-superlink":
                assert "--insecure" in argv  # loopback only; TLS: tests/test_flower.py
                log = tmp_path / "superlink.log"
                wait_port(link_port, spawn([str(BIN / program), *argv[1:]], link_dir, log), 120.0, log)
            elif program == "flwr":
                config = argv[argv.index("--run-config") + 1]
                for full, smoke in SMOKE.items():
                    assert full in config, (full, config)
                    config = config.replace(full, smoke)
                argv[argv.index("--run-config") + 1] = config
                done = subprocess.run([str(BIN / program), *argv[1:]], cwd=run_from, env=env, capture_output=True,
                                      text=True, timeout=420)
                run_out = done.stdout + done.stderr
                assert done.returncode == 0 and "ServerApp raised" not in run_out, run_out[-4000:]
                assert "round 2/2: train loss" in run_out and "3/3 nodes replied" in run_out, run_out[-3000:]
            elif program == "fl-server":
                done = subprocess.run([str(BIN / program), *argv[1:]], cwd=link_dir, env=env, capture_output=True,
                                      text=True, timeout=300)
                assert done.returncode == 0, done.stdout + done.stderr
                bundle = link_dir / argv[argv.index("--out") + 1]
            else:
                pytest.fail(f"docs/flower.md runs {program!r}, which this test does not know: teach it here")
    finally:
        stopper = LocalDeployment(num_nodes=0, workdir=tmp_path)  # its stop(): SIGTERM, then the groups' SIGKILL
        stopper.procs = procs
        stopper.stop()
    assert processes_of(home) == []  # nothing of the deployment outlives it
    assert seen >= {"flower-superlink", "flower-supernode", "python", "flwr", "fl-server"}, seen
    assert not (tmp_path / "no-shared-data").exists()

    # a fourth clinic's images: a new client the run never saw, personalising on the torch-free SDK
    from edge_sdk import open_bundle

    x = fashion_all.x[idx[3]].astype(np.float32)
    device = open_bundle(bundle)
    before = float((device.predict(x).argmax(1) == fashion_all.y[idx[3]]).mean())
    adaptation = device.personalize(x)
    after = float((device.predict(x).argmax(1) == fashion_all.y[idx[3]]).mean())
    assert adaptation.method == "FedTTA" and before > 0.2 and after > 0.2, (before, after)  # chance: 0.1
