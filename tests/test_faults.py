"""Fault injection against real processes: SIGKILL the coordinator in the middle of a training job and
restart it; SIGKILL a bundle writer (and an artifact-store writer) at every file-system step it takes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest

from coordinator_proc import ADMIN, start
from edge_sdk._bundle import BundleError, load_bundle
from reliability_log import record

pytestmark = pytest.mark.timeout(900)
ROUNDS = 8


# ------------------------------------------------------------------ coordinator killed during training
def _alive(pid: int) -> bool:
    """Running (a zombie whose parent died and that nobody reaped yet counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _rounds(path: Path) -> list[int]:
    from fl_server.rundir import read_metrics

    return [r["round"] for r in read_metrics(path.parent)]


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as a:
        return {k: a[k] for k in a.files if not k.startswith("__")}


def test_sigkill_coordinator_mid_training_resumes_exactly(tmp_path: Path) -> None:
    """The coordinator is SIGKILLed after round 2 of 8; its training worker dies with it; the restarted
    coordinator resumes the job at the last checkpointed round; every round is trained once, and the final
    state equals an uninterrupted run of the same job (bit for bit)."""
    store = tmp_path / "store"
    coord = start(store, methods="FedAvg", rounds=ROUNDS, workers=1)
    try:
        job = httpx.get(f"{coord.url}/v1/jobs", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).json()[0]
        job_dir = store / "jobs" / job["id"]
        metrics = job_dir / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while len(_rounds(metrics)) < 2:
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        assert len(_rounds(metrics)) < ROUNDS
        worker = int((job_dir / "worker.pid").read_text())
        coord.proc.send_signal(signal.SIGKILL)
        coord.proc.wait(10)
    finally:
        coord.stop()
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker), "the training worker outlived its coordinator"
    checkpointed = json.loads((job_dir / "run" / "checkpoint.json").read_text())["rounds_done"]
    seen_at_kill = _rounds(metrics)
    assert 1 <= checkpointed < ROUNDS

    again = start(store, methods="FedAvg", rounds=ROUNDS, workers=1)
    try:
        again.wait_bundles(1, timeout=600)
        done = httpx.get(f"{again.url}/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {ADMIN}"},
                         timeout=10).json()
        manifest = httpx.get(f"{again.url}/v1/manifest", timeout=10).json()
        params = httpx.get(again.url + next(a["url"] for a in manifest["artifacts"] if a["name"] == "params"),
                           timeout=30).content
    finally:
        again.stop()
    starts = [ln for ln in (job_dir / "log.txt").read_text().splitlines() if "training from round" in ln]
    assert [int(ln.split("from round ")[1].split()[0]) for ln in starts] == [0, checkpointed]
    assert _rounds(metrics) == list(range(ROUNDS))  # each round once, none lost
    assert done["status"] == "done" and [r["round"] for r in done["rounds"]] == list(range(ROUNDS))

    # the same job, uninterrupted, in a worker process of its own
    ref = tmp_path / "reference"
    ref.mkdir()
    shutil.copy(job_dir / "spec.json", ref / "spec.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FL_COORDINATOR_PID", None)
    import subprocess

    subprocess.run([sys.executable, "-m", "fl_server.service.worker", str(ref)], check=True, env=env, timeout=600,
                   capture_output=True)
    for name in ("checkpoint.npz", "best.npz"):
        a, b = _arrays(job_dir / "run" / name), _arrays(ref / "run" / name)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), name
    (tmp_path / "served.npz").write_bytes(params)
    served, best = _arrays(tmp_path / "served.npz"), _arrays(ref / "run" / "best.npz")
    assert all(np.array_equal(v, best[f"params/{k}"]) for k, v in served.items())
    record("coordinator", f"SIGKILL of the coordinator during training (after round {len(seen_at_kill)} of "
           f"{ROUNDS}), then restart", f"worker died with it; resumed at round {checkpointed}; rounds 0..{ROUNDS - 1} "
           "trained once each; final model bit-identical to an uninterrupted run", rounds=ROUNDS,
           resumed_at=checkpointed)


# ------------------------------------------------------------------ writers killed at every step
WATCHED_PY = {"copyfile", "_savez", "sha256_file", "write_text", "write_signature", "sign_bundle", "_fsync_tree",
              "rmtree", "fdopen", "copyfileobj", "mkstemp"}
WATCHED_C = {os.replace, os.fsync, os.mkdir, os.unlink, os.rename}


def _run_killed(fn: Callable[[], None], kill_at: int | None, tmp: Path) -> tuple[bool, int]:
    """Run ``fn`` in a forked child that SIGKILLs itself at its ``kill_at``-th watched file-system step
    (None: runs to the end). Returns (killed, steps taken)."""
    count_file = tmp / f"steps-{kill_at}"
    pid = os.fork()
    if pid == 0:  # child
        steps = 0

        def hook(frame, event, arg):  # type: ignore[no-untyped-def]
            nonlocal steps
            if (event == "call" and frame.f_code.co_name in WATCHED_PY) or (event == "c_call" and arg in WATCHED_C):
                steps += 1
                if steps == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

        try:
            sys.setprofile(hook)
            fn()
            sys.setprofile(None)
            count_file.write_text(str(steps))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return killed, (0 if killed else int(count_file.read_text()))


def _tiny_graph(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Identity", ["x"], ["logits"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


def _version(dest: Path, key: bytes) -> str:
    """'none', or the version of the complete, signature- and hash-verified bundle at ``dest``."""
    if not dest.exists():
        return "none"
    try:
        return str(load_bundle(dest, public_key=key).hyperparameters["version"])
    except BundleError as exc:
        raise AssertionError(f"a half-written bundle is visible at {dest}: {exc}") from None


def test_bundle_writer_killed_at_every_step(tmp_path: Path) -> None:
    """A bundle write (over an existing bundle) is SIGKILLed at each of its file-system steps in turn: the
    loader sees the old bundle, the new one, or (only between the two renames) none, never a partial one;
    recover_bundle (run by the next write) always leaves a complete, verified bundle and no debris."""
    from fl_server.export.bundle import recover_bundle, write_bundle
    from fl_server.signing import ManifestSigner

    signer = ManifestSigner.generate()
    graph = _tiny_graph(tmp_path / "g.onnx")
    weights = {"params": {"w": np.ones((300, 300), np.float32)}, "phi": {"v": np.arange(1000, dtype=np.float32)}}

    def write(dest: Path, version: str) -> None:
        write_bundle(dest, {"forward": graph}, weights, "FedAvg", {"version": version}, signer=signer)

    template = tmp_path / "old"
    write(template, "old")
    probe = tmp_path / "probe" / "b"
    shutil.copytree(template, probe)
    killed, steps = _run_killed(lambda: write(probe, "new"), None, tmp_path)
    assert not killed and steps >= 15, steps
    seen, after_recovery = [], []
    for k in range(1, steps + 1):
        dest = tmp_path / f"k{k}" / "b"
        shutil.copytree(template, dest)
        killed, _ = _run_killed(lambda: write(dest, "new"), k, tmp_path)  # noqa: B023
        assert killed, k
        seen.append(_version(dest, signer.public_key))
        recover_bundle(dest)
        after_recovery.append(_version(dest, signer.public_key))
        assert sorted(p.name for p in dest.parent.iterdir()) == ["b"], k  # no staging or old copies left
    assert set(seen) <= {"old", "new", "none"} and set(after_recovery) <= {"old", "new"}
    flips = [i for i in range(1, steps) if after_recovery[i] != after_recovery[i - 1]]
    assert after_recovery[0] == "old" and len(flips) <= 1  # old ... old, then new ... new: never back
    record("bundle-write", f"SIGKILL of a bundle writer at each of its {steps} file-system steps (over an existing "
           "bundle)", f"loader saw old {seen.count('old')}x, new {seen.count('new')}x, nothing "
           f"{seen.count('none')}x, partial 0x; after recovery always a complete verified bundle",
           injected=steps)


def test_artifact_store_writer_killed_at_every_step(tmp_path: Path) -> None:
    """The coordinator's content-addressed store: a put killed at any step leaves either no object or the
    complete one under its address (never a wrong or short file)."""
    from edge_sdk._bundle import sha256_file
    from fl_server.service.artifacts import ArtifactStore

    src = tmp_path / "blob"
    src.write_bytes(np.random.default_rng(0).bytes(256 << 10))
    digest = sha256_file(src)
    killed, steps = _run_killed(lambda: ArtifactStore(tmp_path / "probe").put_file(src), None, tmp_path)
    assert not killed and steps >= 3
    complete = 0
    for k in range(1, steps + 1):
        root = tmp_path / f"k{k}"
        killed, _ = _run_killed(lambda: ArtifactStore(root).put_file(src), k, tmp_path)  # noqa: B023
        assert killed, k
        store = ArtifactStore(root)
        if store.has(digest):
            assert sha256_file(store.path(digest)) == digest, k
            complete += 1
        assert store.put_file(src) == digest and sha256_file(store.path(digest)) == digest  # a retry completes
    record("artifact-store", f"SIGKILL of an artifact-store write at each of its {steps} steps",
           f"object absent {steps - complete}x, complete {complete}x, wrong 0x; a retry always completes",
           injected=steps)
