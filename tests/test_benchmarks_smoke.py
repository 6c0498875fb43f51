"""Every benchmark script runs end to end at a smoke size, so none can rot: each writes its rows to a temporary
file (never docs/benchmarks/) and must exit 0. A new script under benchmarks/ must be listed here (or in
LIBRARIES, for modules other scripts import); the last test fails otherwise."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
LIBRARIES = {"raw_http.py", "run_dirs.py", "timing.py"}  # imported by the scripts below, not run on their own

# script -> arguments of its smoke run ({out}: a temporary file; {run}: a small finished digits run)
SMOKE: dict[str, list[str]] = {
    "btfl_speed.py": ["--samples", "128", "--ref-samples", "8", "--repeats", "1"],
    "btfl_sdk_e2e.py": ["--latency-only", "--samples", "16", "--repeats", "1"],
    "dle_view.py": ["--clients", "10", "--repeats", "1"],
    "edge_sdk_footprint.py": ["--repeats", "1"],
    "edge_step_speed.py": ["--batch", "4", "--repeats", "1", "--models", "mlp,resnet8_bn"],
    "fedtta_step.py": ["--models", "mlp", "--repeats", "1", "--device", "cpu"],
    "gpu_engine.py": ["--smoke", "--repeats", "1", "--device", "cpu", "--methods", "FedTTA"],
    "int8_frozen.py": ["{run}"],
    "odpfl_round.py": ["--dataset", "digits", "--repeats", "1"],
    "phase_steps.py": ["--repeats", "1", "--device", "cpu", "--smoke"],
    "sdk_table1_parity.py": ["{run}"],
    "update_kernels.py": ["--repeats", "1"],
    "vmap_engine.py": ["--cases", "0", "--repeats", "1", "--device", "cpu"],
}
# run against a coordinator (test_coordinator_benchmarks)
SERVED = {"coordinator_load.py", "profile_burst.py", "summarize_load.py"}
# smoke-run by another test module (it needs that module's fixtures)
ELSEWHERE = {"flower.py": "tests/test_flower.py::test_flower_benchmark_runs_at_smoke_size",
             "peer_fedavg.py": "tests/test_peer_fedavg.py::test_peer_benchmark_smoke"}


def _env(data_root: Path) -> dict[str, str]:
    return {**os.environ, "FL_DATA_DIR": str(data_root), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "edge_sdk"), os.environ.get("PYTHONPATH", "")])}


def _run(args: list[str], env: dict[str, str], cwd: Path, timeout: int = 600) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Path:
    """A finished two-round FedAvg run on the embedded digits (run.json + best.npz)."""
    out = tmp_path_factory.mktemp("bench-run") / "run"
    _run(["-m", "fl_server.cli", "train", "--dataset", "digits", "--method", "FedAvg", "--rounds", "2",
          "--out", str(out), "--no-progress"], _env(data_root), REPO)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_runs_at_smoke_size(script: str, tmp_path: Path, data_root: Path, request) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "rows.json"
    args = SMOKE[script]
    if "{run}" in args:
        run = request.getfixturevalue("digits_run")
        args = [str(run) if a == "{run}" else a for a in args]
    _run([str(BENCH / script), *args, "--out", str(out)], _env(data_root), tmp_path)
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and rows and all("what" in r for r in rows)


@pytest.mark.slow
def test_step_memory_rows_at_smoke_size(tmp_path: Path, data_root: Path) -> None:
    """edge_step_speed.py --memory-only (the path the timing smoke run skips): the step bundles' peak memory and
    FedTTA++'s personalisation's, with the steps its early stopping took."""
    out = tmp_path / "rows.json"
    _run([str(BENCH / "edge_step_speed.py"), "--memory-only", "--batch", "4", "--models", "mlp", "--out", str(out)],
         _env(data_root), tmp_path)
    rows = {r["what"]: r for r in json.loads(out.read_text())}
    fedttapp = rows["FedTTA++ personalisation, mlp, batch 4"]
    assert fedttapp["metric"] == "peak_rss_mb" and fedttapp["value"] == fedttapp["peak_rss_mb"] > 0, fedttapp
    assert fedttapp["device_steps"] >= 1, fedttapp
    assert rows["TENT step, mlp, batch 4"]["peak_rss_mb"] > 0 and "device_steps" not in rows["TENT step, mlp, batch 4"]


@pytest.mark.slow
def test_coordinator_benchmarks(trained_store: Path, tmp_path: Path, data_root: Path) -> None:
    """coordinator_load.py against a running coordinator, profile_burst.py on a copy of the same store, and
    summarize_load.py over coordinator_load's output."""
    sys.path.insert(0, str(REPO / "tests"))
    from coordinator_proc import start_copy

    env = _env(data_root)
    coord = start_copy(trained_store, tmp_path / "store")
    try:
        coord.wait_bundles(2)
        load = tmp_path / "load.json"
        _run([str(BENCH / "coordinator_load.py"), "--server", coord.url, "--server-pid", str(coord.proc.pid),
              "--devices", "4", "--out", str(load)], env, tmp_path)
    finally:
        coord.stop()
    assert json.loads(load.read_text())
    summary = tmp_path / "summary.json"
    _run([str(BENCH / "summarize_load.py"), f"smoke={load}", "--out", str(summary)], env, tmp_path)
    assert json.loads(summary.read_text())["variants"][0]["variant"] == "smoke"
    store = tmp_path / "profile-store"
    shutil.copytree(trained_store, store, ignore=lambda d, names: ["jobs"] if Path(d) == trained_store else [])
    out = _run([str(BENCH / "profile_burst.py"), "--store", str(store), "--devices", "4",
                "--start-timeout", "600"], env, tmp_path)
    assert "join" in out


def test_every_benchmark_script_has_a_smoke_run() -> None:
    scripts = {p.name for p in BENCH.glob("*.py")}
    missing = scripts - set(SMOKE) - SERVED - LIBRARIES - set(ELSEWHERE)
    assert not missing, f"benchmarks without a smoke run in {Path(__file__).name}: {sorted(missing)}"
