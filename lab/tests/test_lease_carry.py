"""lab/research/lease_carry.sh: the committed results step aside for a GPU-lease call and come back; a call over the
64 MiB a lease carries is refused with the results restored."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "lab" / "research" / "lease_carry.sh"


def _repo(tmp_path: Path, data_bytes: int) -> tuple[Path, dict[str, str]]:
    repo, data = tmp_path / "repo", tmp_path / "data"
    (repo / "docs" / "results").mkdir(parents=True)
    (repo / "docs" / "results" / "table.json").write_text("[]")
    (repo / ".gitignore").write_text(".gpu_data/\n")
    for name in ("fashion-mnist", "mnist"):
        (data / name).mkdir(parents=True)
        (data / name / "images.gz").write_bytes(b"\0" * data_bytes)
    subprocess.run("git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm init", shell=True,
                   cwd=repo, check=True)
    return repo, {**os.environ, "FL_DATA_DIR": str(data), "ASIDE": str(tmp_path / "aside")}


def _run(repo: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, env=env, capture_output=True, text=True)


def test_results_step_aside_for_the_call_and_come_back(tmp_path: Path) -> None:
    repo, env = _repo(tmp_path, 1 << 20)
    done = _run(repo, env, "prepare", "--tests")
    assert done.returncode == 0, done.stderr
    assert "the call carries 2 MiB of 64" in done.stdout
    assert not (repo / "docs" / "results").exists() and (repo / ".gpu_data" / "mnist" / "images.gz").exists()
    assert _run(repo, env, "restore").returncode == 0
    assert (repo / "docs" / "results" / "table.json").read_text() == "[]"


def test_a_call_over_the_limit_is_refused_and_the_results_restored(tmp_path: Path) -> None:
    repo, env = _repo(tmp_path, 40 << 20)  # 2 x 40 MiB of data with --tests
    done = _run(repo, env, "prepare", "--tests")
    assert done.returncode == 1 and "over the limit: drop mnist" in done.stderr
    assert (repo / "docs" / "results" / "table.json").exists()
