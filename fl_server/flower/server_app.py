"""The Flower ServerApp: the coordinator's side of a run whose clients train on their own machines.

It waits for the SuperNodes, asks each for its partition id and sizes (``query``; nodes that hold their own
data are numbered as clients 0 .. N-1 by node id, and each message tells a node its number), builds the method
from the recipe (no data on this side), then per round selects clients like the engine (``select_clients``), sends each
its row of the method's ``client_start`` with the server state (``train``), and folds the replies in with the
method's ``aggregate``. Validation (``evaluate``) is the mean over training clients of their own accuracy, as
the engine's. At the end, the finalize step (:func:`finalize`) asks the clients for what a bundle needs from their
data. The run directory it writes (``run.json``, ``best.npz``, ``metrics.jsonl``, ``device.npz``) is what
``fl-server export`` and the coordinator take from an in-process run.

Example (after a SuperLink and SuperNodes are up; the app folder is ``examples/flower``)::

    flwr run examples/flower local-deployment --run-config "method='FedTTA' rounds=3 run-dir='/srv/runs/a'"
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fl_server import rundir
from fl_server.algorithms.base import Algorithm
from fl_server.algorithms.btfl import BTFL
from fl_server.engine.simulation import select_clients
from fl_server.flower.task import FlowerRecipe, check_supported, statistics_from_uploads
from fl_server.flower.wire import record_to_state, state_to_record
from fl_server.functional import State, stack, unstack
from fl_server.models.norm import stat_norms
from fl_server.recipes.run import describe_run

app = ServerApp()


class FlowerError(RuntimeError):
    """A run the server cannot go on with (missing SuperNodes, a client's error reply)."""


def wait_for_nodes(grid: Grid, count: int, timeout: float) -> list[int]:
    """The ids of at least ``count`` connected SuperNodes, waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= count:
            return nodes
        if time.monotonic() > deadline:
            raise FlowerError(f"only {len(nodes)} of {count} SuperNodes connected within {timeout:.0f} s")
        time.sleep(0.5)


def _exchange(grid: Grid, kind: str, payloads: dict[int, RecordDict], timeout: float, round_: int) -> dict[int, Any]:
    """Send one message per node, return each node's reply content; any error or missing reply fails the run."""
    msgs = {node: Message(content, dst_node_id=node, message_type=kind, group_id=str(round_))
            for node, content in payloads.items()}
    replies = {m.metadata.src_node_id: m for m in grid.send_and_receive(list(msgs.values()), timeout=timeout)}
    for node in payloads:
        reply = replies.get(node)
        if reply is None:
            raise FlowerError(f"{kind}: no reply from node {node} within {timeout:.0f} s (round {round_})")
        if reply.has_error():
            raise FlowerError(f"{kind}: node {node} failed: {reply.error.reason}")
    return {node: replies[node].content for node in payloads}


class FederatedRun:
    """Server state and bookkeeping of one run (the engine's ``Simulation`` without data)."""

    def __init__(self, recipe: FlowerRecipe, infos: list[dict[str, Any]]) -> None:
        """``infos``: the clients' query replies, ordered by partition id."""
        self.recipe = recipe
        self.k = len(infos)
        self.input_shape = tuple(int(v) for v in infos[0]["input-shape"])
        self.algorithm: Algorithm = recipe.build_algorithm(self.k)
        check_supported(self.algorithm)
        dtype = recipe.torch_dtype
        # methods that size their state by the number of training clients read it here (no data on this side)
        self.algorithm.attach(torch.empty(0, *self.input_shape, dtype=dtype), torch.empty(0, dtype=torch.long),
                              [np.empty(0, np.int64)] * self.k)
        self.server_state: State = self.algorithm.init_state(dtype, torch.device("cpu"))
        self.sizes = torch.tensor([int(i["num-train"]) for i in infos], dtype=dtype)

    def config(self, round_: int, client: int) -> ConfigRecord:
        """A message's config: the round, the number of training clients and the receiver's client number."""
        return ConfigRecord({"round": round_, "num-clients": self.k, "client-id": client})

    def train_payloads(self, ids: np.ndarray, round_: int) -> list[RecordDict]:
        """Client ``ids[i]``'s message: its row of ``client_start`` and the server state."""
        private = self.algorithm.client_private  # the client's own entries (BTFL's local head) stay with it
        starts = [{k: v for k, v in s.items() if k not in private}
                  for s in unstack(self.algorithm.client_start(self.server_state, ids))]
        server = self.shared_record()
        return [RecordDict({"state": state_to_record(s), "server": server, "config": self.config(round_, int(i))})
                for s, i in zip(starts, ids)]

    def shared_record(self) -> ArrayRecord:
        """The server state without its per-client rows (``Algorithm.per_client_keys``)."""
        keys = self.algorithm.per_client_keys
        return state_to_record({k: v for k, v in self.server_state.items() if k not in keys})

    def aggregate(self, ids: np.ndarray, states: list[State]) -> None:
        """The method's ``aggregate``; a client's own entries, which never arrive, keep the server's initial rows
        (so the server-side copy of BTFL's local heads holds no client's training)."""
        for key, rows in self.algorithm.client_private.items():
            states = [{**s, key: self.server_state[rows][int(i)]} for s, i in zip(states, ids)]
        self.server_state = self.algorithm.aggregate(self.server_state, ids, stack(states), self.sizes[ids])


def finalize(grid: Grid, run: FederatedRun, state: State, node_of: dict[int, int],
             timeout: float) -> dict[str, dict[str, np.ndarray]]:
    """The run's finalize step on the clients' data, as the engine's ``Simulation.finalize`` for ``state`` (the best
    state): a batch-normalised model's population statistics from every training client's sums (``stats``), then
    BTFL's global DLE and mean feature from every client's upload, normalised by those statistics (``btfl``)."""
    params = state_to_record({"params": state["params"]})

    def ask(kind: str, extra: dict[str, ArrayRecord]) -> list[Any]:
        payloads = {node_of[p]: RecordDict({"server": params, "config": run.config(-1, p), **extra})
                    for p in range(run.k)}
        replies = _exchange(grid, kind, payloads, timeout, run.recipe.rounds)
        return [replies[node_of[p]] for p in range(run.k)]

    device: dict[str, dict[str, np.ndarray]] = {}
    extra: dict[str, ArrayRecord] = {}
    if stat_norms(run.algorithm.model):
        sums = ask("query.bn_sums", {})
        device["stats"] = statistics_from_uploads(run.algorithm, [_arrays(r["sums"]) for r in sums])
        extra["stats"] = ArrayRecord({k: Array(v) for k, v in device["stats"].items()})
    if isinstance(run.algorithm, BTFL):
        device.update(run.algorithm.finalize_from_uploads([_arrays(r["dle"]) for r in ask("query.dle", extra)]))
    return device


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train the run config's recipe on the connected SuperNodes; write the run directory ``run-dir``."""
    train_on_grid(grid, context.run_config)


def make_server_app(run_config: Mapping[str, Any]) -> ServerApp:
    """A ServerApp with a fixed run config (for ``flwr.simulation.run_simulation``, which passes none)."""
    fixed = ServerApp()
    fixed.main()(lambda grid, context: train_on_grid(grid, {**context.run_config, **run_config}))
    return fixed


_PARTITIONING = ("num-clients", "new-fraction", "partition", "max-samples")  # how a shared data set is split


def clients_of(cfg: Mapping[str, Any], infos: dict[int, dict[str, Any]]) -> tuple[dict[int, int], list[dict]]:
    """(client number -> node id, the clients' query replies in client order). Nodes holding their own data
    (partition-id -1) are the clients, numbered by node id; nodes holding partitions of the recipe's data set
    are numbered by partition id, one per partition. A mix, or partitioning keys beside node-local data, is
    refused with one line."""
    local = sorted(n for n, i in infos.items() if int(i["partition-id"]) < 0)
    if local and len(local) < len(infos):
        raise FlowerError(f"{len(local)} SuperNodes hold their own data (data=...), {len(infos) - len(local)} a "
                          "partition (partition-id=...); give every SuperNode of a run the same kind")
    if local:
        set_ = [key for key in _PARTITIONING if cfg.get(key, "") != ""]
        if set_:
            raise FlowerError(f"run config {', '.join(set_)}: these split a shared data set; the SuperNodes hold "
                              f"their own data (each one client), so drop them")
        return dict(enumerate(local)), [infos[n] for n in local]
    by_pid = {int(i["partition-id"]): n for n, i in infos.items()}
    k = int(next(iter(infos.values()))["num-partitions"])
    if sorted(by_pid) != list(range(k)):
        raise FlowerError(f"the recipe has {k} training clients; connected SuperNodes hold partitions "
                          f"{sorted(by_pid)} (one SuperNode per partition id 0 .. {k - 1})")
    return by_pid, [infos[by_pid[p]] for p in range(k)]


def train_on_grid(grid: Grid, cfg: Mapping[str, Any]) -> None:
    """The run: query the nodes, train ``rounds`` rounds, validate, write ``cfg["run-dir"]``."""
    recipe = FlowerRecipe.from_config(cfg)
    run_dir = Path(str(cfg.get("run-dir", "runs/flower")))
    run_dir.mkdir(parents=True, exist_ok=True)
    timeout = float(cfg.get("round-timeout", 600))
    nodes = wait_for_nodes(grid, int(cfg.get("min-nodes", 1)), timeout)
    query = _exchange(grid, "query", {n: RecordDict({"config": ConfigRecord({})}) for n in nodes}, timeout, -1)
    node_of, infos = clients_of(cfg, {n: dict(c["info"]) for n, c in query.items()})
    k = len(node_of)
    run = FederatedRun(recipe, infos)
    (run_dir / rundir.METRICS).unlink(missing_ok=True)
    best_val, best, best_round, t_start = float("-inf"), run.server_state, 0, time.perf_counter()
    for r in range(recipe.rounds):
        ids = select_clients(k, recipe.client_fraction, recipe.seed, r)
        payloads = dict(zip((node_of[int(i)] for i in ids), run.train_payloads(ids, r)))
        replies = _exchange(grid, "train", payloads, timeout, r)
        run.aggregate(ids, [record_to_state(replies[node_of[int(i)]]["state"]) for i in ids])
        row: dict[str, Any] = {"round": r}
        if (recipe.eval_every and (r + 1) % recipe.eval_every == 0) or r == recipe.rounds - 1:
            server = run.shared_record()
            evals = _exchange(grid, "evaluate", {node_of[p]: RecordDict({"server": server, "config": run.config(r, p)})
                                                 for p in range(k)}, timeout, r)
            row["val"] = float(np.mean([evals[node_of[p]]["metrics"]["accuracy"] for p in range(k)]))
            row["test"] = None
            if row["val"] > best_val:
                best_val, best, best_round = row["val"], run.server_state, r
                rundir.save_state(run_dir / rundir.BEST, run.server_state, {"round": r, "val": row["val"]})
        row["wall_s"] = round(time.perf_counter() - t_start, 3)
        with open(run_dir / rundir.METRICS, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    rundir.save_state(run_dir / rundir.FINAL, run.server_state, {"round": recipe.rounds - 1})
    rundir.write_device(run_dir, finalize(grid, run, best, node_of, timeout), best_round)
    # what `fl-server export` rebuilds the model from (fl_server.recipes.run.rebuild), as for an engine run
    description = describe_run(recipe.recipe, run.algorithm, None, recipe.seed)
    description["engine"] = "flower"
    rundir.write_run(run_dir, description)
