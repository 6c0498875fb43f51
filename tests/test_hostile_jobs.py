"""The job queue and the training workers under hostile use (issue 36, defects 13 and 14), against a real
coordinator: a bounded queue, an admin cancel that kills the worker process, no secret in a worker's
environment, and an owner-only store."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import httpx
import pytest

from coordinator_proc import ADMIN, auth, start

pytestmark = pytest.mark.timeout(300)


def _post_job(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/jobs", json={"method": "FedAvg", "rounds": 1000}, headers=auth(ADMIN), timeout=30)


def _worker_pid(job_dir: Path, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (job_dir / "worker.pid").is_file() and (text := (job_dir / "worker.pid").read_text().strip()):
            return int(text)
        time.sleep(0.1)
    raise TimeoutError("the training worker did not start")


def _gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_bounded_queue_cancel_kills_worker_and_no_secret_in_its_environment(tmp_path: Path) -> None:
    store = tmp_path / "store"
    coord = start(store, methods="", workers=1, env={"FL_SERVE_MAX_QUEUED_JOBS": "2", "FL_SIGNING_KEY": "11" * 32})
    try:
        running = _post_job(coord.url).json()["id"]
        pid = _worker_pid(store / "jobs" / running)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=", 1)[0] for e in environ if e}
        assert b"FL_COORDINATOR_PID" in names  # it is the worker's environment
        assert not names & {b"FL_ADMIN_TOKEN", b"FL_SIGNING_KEY"}  # defect 14: the admin token was there
        assert all(ADMIN.encode() not in e for e in environ)

        queued = [_post_job(coord.url) for _ in range(2)]
        assert [r.status_code for r in queued] == [201, 201]
        full = _post_job(coord.url)  # defect 13: the queue had no bound
        assert (full.status_code, full.headers["retry-after"]) == (503, "5")
        assert full.json()["detail"] == ("2 jobs are queued already (FL_SERVE_MAX_QUEUED_JOBS); retry when one has "
                                         "started, or cancel one (DELETE /v1/jobs/{id})")

        r = httpx.delete(f"{coord.url}/v1/jobs/{queued[0].json()['id']}", headers=auth(ADMIN), timeout=30)
        assert (r.status_code, r.json()["status"]) == (200, "cancelled")
        r = httpx.delete(f"{coord.url}/v1/jobs/{queued[0].json()['id']}", headers=auth(ADMIN), timeout=30)
        assert (r.status_code, r.json()["detail"]) == (
            409, f"job {queued[0].json()['id']} is cancelled; only a queued or running job can be cancelled")
        assert httpx.delete(f"{coord.url}/v1/jobs/{running}", timeout=30).status_code == 401

        r = httpx.delete(f"{coord.url}/v1/jobs/{running}", headers=auth(ADMIN), timeout=30)
        assert (r.status_code, r.json()["status"]) == (200, "cancelled")
        assert _gone(pid), "the cancelled job's worker process is still running"
        nxt = _worker_pid(store / "jobs" / queued[1].json()["id"])  # the runner goes on with the next job
        time.sleep(1.0)
        assert httpx.get(f"{coord.url}/v1/jobs/{running}", headers=auth(ADMIN), timeout=30).json()["status"] == \
            "cancelled"  # the killed worker's exit does not make it 'failed'
        assert httpx.delete(f"{coord.url}/v1/jobs/{queued[1].json()['id']}", headers=auth(ADMIN),
                            timeout=30).status_code == 200
        assert _gone(nxt)
        health = httpx.get(f"{coord.url}/healthz", timeout=30).json()
        assert health["jobs"]["cancelled"] == 3
    finally:
        coord.stop()
    # defect 14: the store (every client's DLE, token hashes) was world-readable
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    for name in ("coordinator.sqlite3", "coordinator.sqlite3-wal", "signing_key.pem"):
        if (store / name).exists():
            assert stat.S_IMODE(os.stat(store / name).st_mode) == 0o600, name


RECIPES = '''
from pathlib import Path

from fl_server.recipes import DataSpec, Recipe, recipe_factory


def wipe():  # any zero-argument function of the file: a job must not be able to call it
    Path(__file__).with_name("called").write_text("wipe ran")
    return Recipe(model="mlp", data=DataSpec.builtin("digits"), method="FedAvg", rounds=1)


@recipe_factory
def small():
    return Recipe(model="mlp", data=DataSpec.builtin("digits"), method="FedAvg", rounds=1)
'''


def test_recipe_links_out_of_the_directory_and_unregistered_functions_are_refused(tmp_path: Path) -> None:
    """Issue 50, N13: a symlink in the recipe directory to a file outside it was followed and imported, and a job
    could name any zero-argument function of a recipe file, which the worker called. Now the link is refused
    (404, one line) and a job naming an unregistered function fails without calling it; a function registered
    with @recipe_factory and a Recipe object are what a job may name."""
    from fl_server.recipes import RecipeError, load_recipe
    from fl_server.recipes.loader import resolve_in_dir

    recipes, outside = tmp_path / "recipes", tmp_path / "outside"
    recipes.mkdir(), outside.mkdir()
    (outside / "evil.py").write_text("raise SystemExit('imported')\n")
    (recipes / "evil.py").symlink_to(outside / "evil.py")
    (recipes / "mine.py").write_text(RECIPES)
    with pytest.raises(RecipeError, match="^recipe file evil.py links out of the coordinator's recipe directory"):
        resolve_in_dir(recipes, "evil")
    with pytest.raises(RecipeError, match=r"^mine.py:wipe is a function, not a Recipe nor a function registered "):
        load_recipe(resolve_in_dir(recipes, "mine:wipe"), registered_only=True)
    assert load_recipe(resolve_in_dir(recipes, "mine:small"), registered_only=True).rounds == 1
    assert not (recipes / "called").exists()

    coord = start(tmp_path / "store", methods="", env={"FL_SERVE_RECIPES_DIR": str(recipes)})
    try:
        url = f"{coord.url}/v1/jobs"
        r = httpx.post(url, json={"recipe": "evil", "rounds": 1}, headers=auth(ADMIN), timeout=30)
        assert r.status_code == 404 and "links out of the coordinator's recipe directory" in r.text, r.text
        job = httpx.post(url, json={"recipe": "mine:wipe", "rounds": 1}, headers=auth(ADMIN), timeout=30).json()
        deadline = time.monotonic() + 120
        while (state := httpx.get(f"{url}/{job['id']}", headers=auth(ADMIN), timeout=30).json())["status"] in (
                "queued", "running") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert state["status"] == "failed" and "not a Recipe nor a function registered" in state["error"], state
        assert not (recipes / "called").exists()
    finally:
        coord.stop()
