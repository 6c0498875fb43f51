"""The Flower ServerApp: the coordinator's side of a run whose clients train on their own machines.

It waits for the SuperNodes, asks each for its partition id and sizes (``query``; nodes that hold their own
data are numbered as clients 0 .. N-1 by node id, and each message tells a node its number) and for the facts of
its data the method declares (``Algorithm.client_facts``: MAP / FedRS / FedPHP's class sets), builds the method
from the recipe and those facts (no data on this side), then per round selects clients like the engine
(``select_clients``) among those still taking part, sends each its row of the method's ``client_start`` with the server state (``train``),
and folds the replies that came in with the method's ``aggregate`` (ODPFL-HN: :meth:`FederatedRun.train_round`'s
embedding / generated model / encoder-gradient exchange). A node that fails or misses a reply is dropped for the
rest of the run; a round with fewer than ``min-train-nodes`` replies is skipped; one progress line per round goes
to the log (``flwr run --stream``). Validation (``evaluate``) is the mean over the replying training clients of
their own accuracy, as the engine's. At the end, the finalize step (:func:`finalize`) asks the clients for what a bundle needs from their
data. The run directory it writes (``run.json``, ``best.npz``, ``metrics.jsonl``, ``device.npz``) is what
``fl-server export`` and the coordinator take from an in-process run.

Example (after a SuperLink and SuperNodes are up; the app folder is ``examples/flower``)::

    flwr run examples/flower local-deployment --run-config "method='FedTTA' rounds=3 run-dir='/srv/runs/a'"
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fl_server import rundir
from fl_server.algorithms.base import ALGORITHMS, CLIENT_FACTS, Algorithm
from fl_server.algorithms.btfl import BTFL
from fl_server.algorithms.odpfl_hn import ODPFLHN
from fl_server.diagnostics import collapse_warning
from fl_server.engine.simulation import select_clients
from fl_server.flower.task import FlowerRecipe, check_supported, statistics_from_uploads
from fl_server.flower.wire import record_to_state, state_to_record
from fl_server.functional import State, index, stack, tree_map, unstack
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


Ask = Callable[[str, Mapping[int, RecordDict]], dict[int, Any]]  # kind, client -> message => client -> reply


PULL_INTERVAL = 0.1  # seconds between the server's pulls for replies (Flower's own send_and_receive sleeps 3 s)


def send_and_receive(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """Flower's ``Grid.send_and_receive`` with a :data:`PULL_INTERVAL` poll: push the messages, pull replies
    until every message has one or ``timeout`` seconds have passed. A reply that came is taken within 0.1 s
    instead of up to 3 s later (each round's exchange waited 1.5 s on average for Flower's poll)."""
    pending = set(grid.push_messages(messages))
    deadline, replies = time.monotonic() + timeout, []
    while pending:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(PULL_INTERVAL)
    return replies


def _exchange(grid: Grid, kind: str, payloads: Mapping[int, RecordDict], timeout: float,
              round_: int) -> tuple[dict[int, Any], dict[int, str]]:
    """Send one message per node and wait up to ``timeout`` seconds: (node -> reply content for the replies that
    came, node -> why there is none: "gone" (the SuperLink's "node unavailable"), "failed" (the ClientApp's error
    reply) or no reply)."""
    msgs = {node: Message(content, dst_node_id=node, message_type=kind, group_id=str(round_))
            for node, content in payloads.items()}
    # the SuperLink answers for a node it knows is gone, so a reply is matched by the message it answers
    replies = {m.metadata.reply_to_message_id: m for m in send_and_receive(grid, list(msgs.values()), timeout)}
    got, lost = {}, {}
    for node, msg in msgs.items():
        reply = replies.get(msg.metadata.message_id)
        if reply is None:
            lost[node] = f"no reply within {timeout:.0f} s"
        elif reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE:
            lost[node] = f"gone: {reply.error.reason}"  # the SuperLink answers for a node whose heartbeats stopped
        elif reply.has_error():
            lost[node] = f"failed: {error_reason(reply.error.reason)}"
        else:
            got[node] = reply.content
    return got, lost


_FLOWER_REASON = re.compile(r"^<class '(?:[\w.]*\.)?(\w+)'>:<(['\"])(.*)\2>$", re.S)


def error_reason(reason: str) -> str:
    """A ClientApp's error as one line: Flower reports an exception as ``<class 'pkg.Name'>:<'message'>``, which
    reads ``Name: message``; any other reason as it is."""
    match = _FLOWER_REASON.match(reason.strip())
    text = f"{match.group(1)}: {match.group(3)}" if match else reason
    return " ".join(text.split())


class Participants:
    """The run's clients (client number -> node id, fixed when the run starts) and which of them still take part:
    a client whose node fails or misses a reply is dropped for the rest of the run (logged); a node that connects
    later is not one of the run's clients."""

    def __init__(self, grid: Grid, node_of: dict[int, int], timeout: float) -> None:
        self.grid, self.node_of, self.timeout = grid, node_of, timeout
        self.dropped: dict[int, str] = {}  # client -> why

    def available(self) -> np.ndarray:
        """The clients not dropped whose SuperNode the SuperLink still lists, sorted."""
        connected = set(self.grid.get_node_ids())
        return np.array(sorted(c for c, n in self.node_of.items() if c not in self.dropped and n in connected),
                        dtype=np.int64)

    def ask(self, round_: int) -> Ask:
        """Round ``round_``'s exchange: the replies that came, by client; the clients without one are dropped."""
        def exchange(kind: str, payloads: Mapping[int, RecordDict]) -> dict[int, Any]:
            got, lost = _exchange(self.grid, kind, {self.node_of[c]: m for c, m in payloads.items()}, self.timeout,
                                  round_)
            client_of = {n: c for c, n in self.node_of.items()}
            for node, why in lost.items():
                self.dropped[client_of[node]] = f"{kind}: {why}"
                log(WARNING, "round %d: %s: node %d (client %d) dropped, %s", round_, kind, node, client_of[node], why)
            return {client_of[n]: content for n, content in got.items()}
        return exchange


@dataclass
class RoundResult:
    """What a round did: the clients that asked to train, those whose update was aggregated, and their train loss
    (the mean over them, weighted by training samples, of the trained models' loss on their own training data)."""

    asked: int
    replied: list[int]
    loss: float | None
    aggregated: bool


class FederatedRun:
    """Server state and bookkeeping of one run (the engine's ``Simulation`` without data)."""

    def __init__(self, recipe: FlowerRecipe, infos: list[dict[str, Any] | None],
                 nodes: list[int] | None = None) -> None:
        """``infos``: the clients' query replies in client order (None: a partition no SuperNode holds), from
        SuperNodes ``nodes`` (named in errors)."""
        self.recipe = recipe
        self.k = len(infos)
        known = [i for i in infos if i is not None]
        self.input_shape = tuple(int(v) for v in known[0]["input-shape"])
        self.algorithm: Algorithm = recipe.build_algorithm(self.k)
        check_supported(self.algorithm)
        dtype = recipe.torch_dtype
        # methods that size their state by the number of training clients read it here (no data on this side)
        self.algorithm.attach(torch.empty(0, *self.input_shape, dtype=dtype), torch.empty(0, dtype=torch.long),
                              [np.empty(0, np.int64)] * self.k)
        if self.algorithm.client_facts:  # e.g. MAP's class sets: the only thing of the clients' data it holds
            self.algorithm.receive_client_facts(received_facts(self.algorithm, infos, nodes))
        self.server_state: State = self.algorithm.init_state(dtype, torch.device("cpu"))
        self.sizes = torch.tensor([int(i["num-train"]) if i is not None else 0 for i in infos], dtype=dtype)

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

    def own_rows(self, client: int) -> dict[str, ArrayRecord]:
        """``{"own": ...}``: client ``client``'s own rows of the per-client server state (one row each; MAP's HPM,
        selection count and class set) that its validation reads, or nothing (none, or a client's own entries,
        ``Algorithm.client_private``, which the server's copy never trains)."""
        private = set(self.algorithm.client_private.values())
        keys = [k for k in self.algorithm.per_client_keys if k not in private]
        if not keys:
            return {}
        return {"own": state_to_record({k: index(self.server_state[k], np.array([client])) for k in keys})}

    def aggregate(self, ids: np.ndarray, states: list[State]) -> None:
        """The method's ``aggregate``; a client's own entries, which never arrive, keep the server's initial rows
        (so the server-side copy of BTFL's local heads holds no client's training)."""
        for key, rows in self.algorithm.client_private.items():
            states = [{**s, key: self.server_state[rows][int(i)]} for s, i in zip(states, ids)]
        self.server_state = self.algorithm.aggregate(self.server_state, ids, stack(states), self.sizes[ids])

    def train_round(self, ask: Ask, ids: np.ndarray, round_: int, min_replies: int = 1) -> RoundResult:
        """Round ``round_`` with clients ``ids``: their updates aggregated over the replies that came (weighted by
        those clients' sizes only); fewer than ``min_replies`` leave the server state as it was."""
        if isinstance(self.algorithm, ODPFLHN):
            return self._hypernetwork_round(ask, ids, round_, min_replies)
        replies = ask("train", dict(zip(ids.tolist(), self.train_payloads(ids, round_))))
        got = sorted(replies)
        if len(got) >= min_replies:
            self.aggregate(np.array(got), [record_to_state(replies[i]["state"]) for i in got])
        return RoundResult(len(ids), got, _train_loss(replies), len(got) >= min_replies)

    def embeddings(self, ask: Ask, ids: np.ndarray, round_: int) -> tuple[np.ndarray, torch.Tensor]:
        """ODPFL-HN: each client encodes its own training data with the current encoder and sends only its
        embedding e = g_gamma(D) (``query.embed``): (the clients that replied, their embeddings [K, E])."""
        enc = state_to_record({"enc": self.server_state["enc"]})
        replies = ask("query.embed", {int(i): RecordDict({"server": enc, "config": self.config(round_, int(i))})
                                      for i in ids})
        got = np.array(sorted(replies), dtype=np.int64)
        emb = [torch.from_numpy(replies[int(i)]["embedding"]["e"].numpy()) for i in got]
        return got, (torch.stack(emb).to(self.recipe.torch_dtype) if emb else torch.empty(0))

    def _hypernetwork_round(self, ask: Ask, ids: np.ndarray, round_: int, min_replies: int) -> RoundResult:
        """ODPFL-HN's round (Algorithm 1) over messages, as its in-process ``client_start`` + ``aggregate``: the
        clients' embeddings in; each client's generated model w_i = f_theta(e_i) out and its trained model back;
        the hypernetwork's chain rule on the server; each client's encoder gradient for its dL/de_i back
        (``query.encoder_grad``, the client's data never leaves it); theta and gamma stepped. A client that drops
        out after sending its model only misses from gamma's gradient (logged by the exchange)."""
        alg, state = self.algorithm, self.server_state
        assert isinstance(alg, ODPFLHN)
        asked = len(ids)
        ids, clean = self.embeddings(ask, ids, round_)
        if len(ids) < min_replies:
            return RoundResult(asked, [], None, False)
        emb = alg.with_noise(state, ids, clean)
        starts = unstack(alg.start_states(alg.generate(state["hn"], emb)))
        replies = ask("train", {int(i): RecordDict({"state": state_to_record(s), "server": ArrayRecord(),
                                                    "config": self.config(round_, int(i))})
                                for i, s in zip(ids, starts)})
        got = [int(i) for i in ids if int(i) in replies]
        if len(got) < min_replies:
            return RoundResult(asked, got, _train_loss(replies), False)
        rows = torch.tensor([ids.tolist().index(i) for i in got])
        trained = stack([record_to_state(replies[i]["state"]) for i in got])
        weights = self.sizes[got]
        grad_theta, grad_e = alg.hypernet_backprop(state["hn"], emb[rows], alg.client_delta(trained),
                                                   weights / weights.sum())
        enc = state_to_record({"enc": state["enc"]})
        back = ask("query.encoder_grad", {i: RecordDict({"server": enc, "config": self.config(round_, i),
                                                         "grad": ArrayRecord({"e": Array(grad_e[k].numpy())})})
                                          for k, i in enumerate(got)})
        grad_gamma = tree_map(torch.zeros_like, state["enc"])
        for i in got:  # summed in client order, as the engine sums them
            if i in back:
                grad_gamma = tree_map(torch.add, grad_gamma, record_to_state(back[i]["grad"])["enc"])
        self.server_state = alg.end_round(state, grad_theta, grad_gamma)
        return RoundResult(asked, got, _train_loss(replies), True)

    def validate(self, ask: Ask, clients: np.ndarray, round_: int) -> tuple[float | None, TopCounts | None]:
        """(the mean over ``clients`` that reply of their validation accuracy, how many of their validation samples
        were predicted as each class and hold each label as far as the replies tell: :func:`top_class_counts`);
        (None, None) without a reply. ODPFL-HN's clients are sent the model the hypernetwork generates from their
        embedding (its own validation path)."""
        if isinstance(self.algorithm, ODPFLHN):
            clients, emb = self.embeddings(ask, clients, round_)
            models = unstack(self.algorithm.generate(self.server_state["hn"], emb)) if len(clients) else []
            payloads = {int(c): RecordDict({"params": state_to_record(w), "config": self.config(round_, int(c))})
                        for c, w in zip(clients, models)}
        else:
            stats, clients = self.validation_statistics(ask, clients, round_)
            if not len(clients):
                return None, None
            server = self.shared_record()
            payloads = {int(c): RecordDict({"server": server, "config": self.config(round_, int(c)),
                                            **self.own_rows(int(c)), **stats}) for c in clients}
        evals = ask("evaluate", payloads)
        if not evals:
            return None, None
        metrics = [evals[c]["metrics"] for c in sorted(evals)]
        accuracy = float(np.mean([m["accuracy"] for m in metrics]))
        return accuracy, top_class_counts(metrics, self.recipe.recipe.num_classes)

    def validation_statistics(self, ask: Ask, clients: np.ndarray,
                              round_: int) -> tuple[dict[str, ArrayRecord], np.ndarray]:
        """(what the validation message carries so that the clients validate the shared model as its bundle's
        device runs it, the clients to validate). For a batch-normalised model whose validation scores the shared
        model or a personalisation of it (the engine's ``Simulation.device_semantics``): the population statistics
        of the current weights over ``clients``' training data (``stats``, from their sums, as the finalize step
        computes them), and the clients that sent theirs. Otherwise (a method that validates each client's own
        model normalises by its batches, as in the engine) ``{}`` and ``clients``."""
        alg = self.algorithm
        shared = alg.adapts_at_test_time or type(alg).val_params is Algorithm.val_params
        if not (stat_norms(alg.model) and shared):
            return {}, clients
        params = state_to_record({"params": self.server_state["params"]})
        sums = ask("query.bn_sums", {int(c): RecordDict({"server": params, "config": self.config(round_, int(c))})
                                     for c in clients})
        if not sums:
            return {}, np.empty(0, np.int64)
        stats = statistics_from_uploads(alg, [_arrays(sums[c]["sums"]) for c in sorted(sums)])
        return {"stats": ArrayRecord({k: Array(v) for k, v in stats.items()})}, np.array(sorted(sums), np.int64)


@dataclass
class TopCounts:
    """Pooled over the clients' validation replies: how many samples were predicted as each class (``predicted``)
    and hold each label (``labels``), as far as what each client reports tells (:func:`top_class_counts`)."""

    predicted: np.ndarray
    labels: np.ndarray


def top_class_counts(metrics: list[Any], num_classes: int) -> TopCounts | None:
    """Pooled counts over the clients' validation replies, from what each reports: the class it predicts most
    (``top-class``), that class's share of its predictions (``top-share``) and of its labels
    (``top-label-share``), no more (its histograms would tell the server its label mix). Each client's other
    predictions and labels are spread evenly over the other classes, so the pool's top class and shares are exact
    where one class dominates every client (a collapse, or data where one class is most of every client's) and
    lower otherwise. None when a reply lacks them (a node of an older version)."""
    keys = ("top-class", "top-share", "top-label-share")
    if not metrics or any(k not in m for m in metrics for k in keys):
        return None
    out = TopCounts(np.zeros(num_classes), np.zeros(num_classes))
    rest = 1 / max(num_classes - 1, 1)
    for m in metrics:
        n, top = float(m["num-examples"]), int(m["top-class"])
        if not 0 <= top < num_classes:
            return None
        for pooled, share in ((out.predicted, float(m["top-share"])), (out.labels, float(m["top-label-share"]))):
            pooled += n * (1 - share) * rest
            pooled[top] += n * share - n * (1 - share) * rest
    return out


def validation_warning(run: FederatedRun, best_val: float | None, counts: TopCounts | None) -> str | None:
    """The run's one line when its best round's validation predictions collapsed to one class (more than the
    labels' share of it) or its accuracy sits at chance (:func:`fl_server.diagnostics.collapse_warning`; a Flower
    run holds no new clients, so its clients' validation splits are what it can judge by); None otherwise or
    without a validation reply. Replies without the counts (older nodes): the chance check alone."""
    if best_val is None:
        return None
    k = run.recipe.recipe.num_classes
    if counts is None:
        return collapse_warning(np.ones(k), k, best_val, subject="validation")
    return collapse_warning(counts.predicted, k, best_val, counts.labels, subject="validation")


def query_config(recipe: FlowerRecipe) -> ConfigRecord:
    """The run's first message to every node: the facts of its data the method declares it needs
    (``Algorithm.client_facts``, answered in the query reply), if any."""
    facts = ALGORITHMS[recipe.method].client_facts
    return ConfigRecord({"facts": list(facts)} if facts else {})


def received_facts(algorithm: Algorithm, infos: list[dict[str, Any] | None],
                   nodes: list[int] | None = None) -> dict[str, list[list[int]]]:
    """The method's declared facts from the clients' query replies in client order (``[]`` for a client no node
    holds), each checked (``CLIENT_FACTS[name].check``); a missing or malformed one is refused with one line
    naming the node."""
    out: dict[str, list[list[int]]] = {}
    for name in algorithm.client_facts:
        out[name] = []
        for k, info in enumerate(infos):
            if info is None:
                out[name].append([])
                continue
            who = f"node {nodes[k]} (client {k})" if nodes is not None else f"client {k}"
            if name not in info:
                raise FlowerError(f"query: {who} sent no {name}, which {algorithm.name} needs; run the same "
                                  "fl-edge version on every SuperNode")
            try:
                out[name].append(CLIENT_FACTS[name].check(info[name], algorithm.model.num_classes))
            except ValueError as exc:
                raise FlowerError(f"query: {who} sent a malformed {name}: {exc}") from None
    return out


def _train_loss(replies: Mapping[int, Any]) -> float | None:
    """The clients' train losses weighted by their training samples (None without replies)."""
    if not replies:
        return None
    metrics = [replies[c]["metrics"] for c in sorted(replies)]
    return float(np.average([m["train-loss"] for m in metrics], weights=[m["num-examples"] for m in metrics]))


def finalize(ask: Ask, run: FederatedRun, state: State, clients: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
    """The run's finalize step on the clients' data, as the engine's ``Simulation.finalize`` for ``state`` (the best
    state), over the ``clients`` that reply: a batch-normalised model's population statistics from their sums
    (``stats``), then BTFL's global DLE and mean feature from their uploads, normalised by those statistics
    (``btfl``)."""
    params = state_to_record({"params": state["params"]})

    def upload(kind: str, extra: dict[str, ArrayRecord]) -> list[Any]:
        replies = ask(kind, {int(c): RecordDict({"server": params, "config": run.config(-1, int(c)), **extra})
                             for c in clients})
        if not replies:
            raise FlowerError(f"{kind}: no client replied; the run's device weights need at least one upload")
        return [replies[c] for c in sorted(replies)]

    device: dict[str, dict[str, np.ndarray]] = {}
    extra: dict[str, ArrayRecord] = {}
    if stat_norms(run.algorithm.model):
        sums = upload("query.bn_sums", {})
        device["stats"] = statistics_from_uploads(run.algorithm, [_arrays(r["sums"]) for r in sums])
        extra["stats"] = ArrayRecord({k: Array(v) for k, v in device["stats"].items()})
    if isinstance(run.algorithm, BTFL):
        device.update(run.algorithm.finalize_from_uploads([_arrays(r["dle"]) for r in upload("query.dle", extra)]))
    return device


def _arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in record.items()}


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train the run config's recipe on the connected SuperNodes; write the run directory ``run-dir``. A run that
    cannot go on logs why in one ``error:`` line before Flower's own report of the exception."""
    try:
        train_on_grid(grid, context.run_config)
    except FlowerError as exc:
        log(ERROR, "error: %s", exc)
        raise


def make_server_app(run_config: Mapping[str, Any]) -> ServerApp:
    """A ServerApp with a fixed run config (for ``flwr.simulation.run_simulation``, which passes none)."""
    fixed = ServerApp()
    fixed.main()(lambda grid, context: train_on_grid(grid, {**context.run_config, **run_config}))
    return fixed


_PARTITIONING = ("num-clients", "new-fraction", "partition", "max-samples")  # how a shared data set is split


def clients_of(cfg: Mapping[str, Any],
               infos: dict[int, dict[str, Any]]) -> tuple[dict[int, int], list[dict[str, Any] | None]]:
    """(client number -> node id, the clients' query replies in client order). Nodes holding their own data
    (partition-id -1) are the clients, numbered by node id; nodes holding partitions of the recipe's data set
    are numbered by partition id, one node per partition (any of them: a partition no node holds is a client that
    never takes part, None). A mix, or partitioning keys beside node-local data, is refused with one line."""
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
    k = int(next(iter(infos.values()))["num-partitions"])
    by_pid: dict[int, int] = {}
    for n in sorted(infos):
        pid = int(infos[n]["partition-id"])
        if not 0 <= pid < k or pid in by_pid:
            raise FlowerError(f"the recipe has {k} training clients; node {n} holds partition {pid}, "
                              + ("held by another node" if pid in by_pid else f"outside 0 .. {k - 1}")
                              + " (one SuperNode per partition id)")
        by_pid[pid] = n
    return by_pid, [infos[by_pid[p]] if p in by_pid else None for p in range(k)]


def train_on_grid(grid: Grid, cfg: Mapping[str, Any]) -> None:
    """The run: query the nodes, train ``rounds`` rounds over the clients that take part, validate, log one
    progress line per round, write ``cfg["run-dir"]``."""
    recipe = FlowerRecipe.from_config(cfg)
    run_dir = Path(str(cfg.get("run-dir", "runs/flower")))
    run_dir.mkdir(parents=True, exist_ok=True)
    timeout = float(cfg.get("round-timeout", 600))
    min_replies = int(cfg.get("min-train-nodes", 1) or 1)
    nodes = wait_for_nodes(grid, int(cfg.get("min-nodes", 1)), timeout)
    query, lost = _exchange(grid, "query", {n: RecordDict({"config": query_config(recipe)}) for n in nodes}, timeout,
                            -1)
    failed = {n: why for n, why in lost.items() if why.startswith("failed")}
    if failed:  # a node's data or setup is wrong: say so rather than train without it (a node gone is no client)
        node, why = next(iter(failed.items()))
        raise FlowerError(f"query: node {node} {why}")
    for node, why in lost.items():
        log(WARNING, "query: node %d is not a client of this run, %s", node, why)
    if not query:
        raise FlowerError(f"query: none of the {len(nodes)} SuperNodes replied within {timeout:.0f} s")
    node_of, infos = clients_of(cfg, {n: dict(c["info"]) for n, c in query.items()})
    run = FederatedRun(recipe, infos, [node_of.get(k, -1) for k in range(len(infos))])
    clients = Participants(grid, node_of, timeout)
    (run_dir / rundir.METRICS).unlink(missing_ok=True)
    best_val, best, best_round, trained, t_start = float("-inf"), run.server_state, -1, 0, time.perf_counter()
    best_counts: TopCounts | None = None
    for r in range(recipe.rounds):
        ask = clients.ask(r)
        available = clients.available()
        ids = available[select_clients(len(available), recipe.client_fraction, recipe.seed, r)] \
            if len(available) >= min_replies else available
        result = run.train_round(ask, ids, r, min_replies) if len(ids) >= min_replies else \
            RoundResult(len(ids), [], None, False)
        trained += result.aggregated
        row: dict[str, Any] = {"round": r, "train_loss": result.loss, "clients": len(result.replied),
                               "asked": result.asked}
        if not result.aggregated:
            row["skipped"] = True
        if (recipe.eval_every and (r + 1) % recipe.eval_every == 0) or r == recipe.rounds - 1:
            (row["val"], counts), row["test"] = run.validate(ask, clients.available(), r), None
            if row["val"] is not None and row["val"] > best_val:
                best_val, best, best_round, best_counts = row["val"], run.server_state, r, counts
                rundir.save_state(run_dir / rundir.BEST, run.server_state, {"round": r, "val": row["val"]})
        row["wall_s"] = round(time.perf_counter() - t_start, 3)
        with open(run_dir / rundir.METRICS, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        log(INFO, "%s", progress_line(row, recipe.rounds, min_replies))
    if not trained:
        raise FlowerError(f"no round had {min_replies} client(s) replying; dropped: "
                          + "; ".join(f"client {c} ({why})" for c, why in clients.dropped.items()))
    rundir.save_state(run_dir / rundir.FINAL, run.server_state, {"round": recipe.rounds - 1})
    if best_round < 0:  # no validation reply: the final state is the run's model
        best, best_round = run.server_state, recipe.rounds - 1
        rundir.save_state(run_dir / rundir.BEST, best, {"round": best_round, "val": None})
    rundir.write_device(run_dir, finalize(clients.ask(recipe.rounds), run, best, clients.available()), best_round)
    # what `fl-server export` rebuilds the model from (fl_server.recipes.run.rebuild), as for an engine run
    description = describe_run(recipe.recipe, run.algorithm, None, recipe.seed)
    description["engine"] = "flower"
    description["clients"] = run.k
    if any(int(i["partition-id"]) < 0 for i in infos if i is not None):  # not the recipe's federation: the nodes'
        description["federation"] = None
        description["clients_data"] = "each SuperNode's own (node-local)"
    description["warning"] = validation_warning(run, best_val if best_round >= 0 else None, best_counts)
    if description["warning"]:
        log(WARNING, "%s", description["warning"])
    rundir.write_run(run_dir, description)


def progress_line(row: Mapping[str, Any], rounds: int, min_replies: int) -> str:
    """The round's line in the ServerApp's log (``flwr run --stream`` shows it):
    ``round 2/5: train loss 0.4123, val accuracy 0.8120, 3/3 nodes replied``."""
    head = f"round {row['round'] + 1}/{rounds}: "
    nodes = f"{row['clients']}/{row['asked']} nodes replied"
    val = f", val accuracy {row['val']:.4f}" if row.get("val") is not None else ""
    if row.get("skipped"):
        return head + f"skipped, {nodes} (fewer than min-train-nodes={min_replies})" + val
    loss = f"train loss {row['train_loss']:.4f}" if row["train_loss"] is not None else "train loss n/a"
    return head + f"{loss}{val}, {nodes}"
