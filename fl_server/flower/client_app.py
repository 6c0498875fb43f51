"""The Flower ClientApp: one training client, on the SuperNode that holds its data.

The SuperNode's ``--node-config`` names the data it trains on: ``data``, the node's own arrays file or image
folder (:func:`~fl_server.flower.task.load_node_data`; relative to the SuperNode's working directory), or, for
tests and simulations, ``partition-id``, one partition of the recipe's data set (optional ``data-dir``, where
the data set's files are). Message kinds (:data:`HANDLERS`): ``query`` (the client's sizes and input shape, so the
server can build the method without data, and the facts of its data the method declares, MAP's class set),
``train`` (the engine's local steps from the state the server sent, and the trained model's loss) and
``evaluate`` (validation accuracy of the sent state, or of the model the server generated for this client, on the
client's own validation split); ODPFL-HN's ``query.embed`` (the client's
embedding of its own data) and ``query.encoder_grad`` (its encoder's gradient for the server's dL/de); and the
finalize step's uploads at the end of a run: ``query.bn_sums`` (a batch-normalised model's sums for the
population statistics) and ``query.dle`` (BTFL's local DLE and mean feature).

Example (a SuperNode on the same machine as the SuperLink, insecure, for a try-out)::

    flower-supernode --insecure --superlink 127.0.0.1:9092 --port 9094 --node-config "data='node-data/train.npz'"
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Mapping

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_server.algorithms.base import Algorithm
from fl_server.algorithms.btfl import BTFL
from fl_server.algorithms.odpfl_hn import ODPFLHN
from fl_server.flower.task import (ClientData, FlowerRecipe, cached_node_data, client_bn_sums, client_btfl_upload,
                                    client_embedding, client_encoder_grad, client_facts, client_predictions,
                                    client_round, client_train_loss, client_validation, validation_metrics)
from fl_server.flower.wire import record_to_state, state_to_record
from fl_server.functional import State

_PRIVATE = "fl-edge-private"  # the client's own entries between rounds (BTFL's local head), never sent


def _setup(context: Context, overrides: Mapping[str, Any]) -> tuple[FlowerRecipe, ClientData]:
    """The recipe and this node's data (its own, ``data``, or its partition, ``partition-id``): prepared on the
    node's first message and read back from the node's disk cache after (:func:`~fl_server.flower.task.
    cached_node_data`; Flower starts a fresh ClientApp process per message)."""
    recipe = FlowerRecipe.from_config({**context.run_config, **overrides})
    node = context.node_config
    if ("data" in node) == ("partition-id" in node):
        raise ValueError("the SuperNode's --node-config names " + ("both data and partition-id; keep one" if
                         "data" in node else "no data; add data='PATH' (its arrays file or image folder)"))
    if "data" in node:
        return recipe, cached_node_data(recipe, str(node["data"]), None)
    data_dir = node.get("data-dir") or context.run_config.get("data-dir") or None
    return recipe, cached_node_data(recipe, None, int(node["partition-id"]), str(data_dir) if data_dir else None)


def _algorithm(content: RecordDict, recipe: FlowerRecipe) -> Algorithm:
    return recipe.build_algorithm(int(content["config"]["num-clients"]))


def on_query(content: RecordDict, recipe: FlowerRecipe, data: ClientData, state: RecordDict) -> RecordDict:
    """The client's partition id (-1: the node's own data), sample counts, input shape and class count, and the
    facts the method asks for (the config's ``facts``, e.g. ``class_set``: which classes it holds); no samples."""
    facts = client_facts(list(content["config"].get("facts", [])) if "config" in content else [], data)
    return RecordDict({"info": ConfigRecord({"partition-id": data.partition_id, "num-partitions": data.num_partitions,
                                             "num-train": len(data.y_train), "num-val": len(data.y_val),
                                             "input-shape": list(data.input_shape),
                                             "num-classes": data.num_classes, **facts})})


def on_train(content: RecordDict, recipe: FlowerRecipe, data: ClientData, state: RecordDict) -> RecordDict:
    """One round of local training: ``state`` (this client's start state) and ``server`` (the server state the
    method's step reads) in; the trained state and its train loss out (the client's own entries kept in
    ``state``, the run's context state)."""
    cfg, algorithm = content["config"], _algorithm(content, recipe)
    private = record_to_state(state[_PRIVATE]) if _PRIVATE in state else None
    trained, kept = client_round(algorithm, record_to_state(content["state"]), record_to_state(content["server"]),
                                 data, recipe, int(cfg["round"]), private)
    if kept:
        state[_PRIVATE] = state_to_record(kept)
    loss = client_train_loss(algorithm, trained, data, recipe)
    return RecordDict({"state": state_to_record(trained),
                       "metrics": MetricRecord({"num-examples": len(data.y_train), "train-loss": loss})})


def on_evaluate(content: RecordDict, recipe: FlowerRecipe, data: ClientData, state: RecordDict) -> RecordDict:
    """Validation accuracy on this client's validation split of the sent server state (``server``, with the
    client's own rows of its per-client entries, ``own``, e.g. MAP's HPM, and a batch-normalised model's
    population statistics, ``stats``), or of the model the server generated for this client (``params``,
    ODPFL-HN)."""
    algorithm = _algorithm(content, recipe)
    if "params" in content:
        pred = client_predictions(algorithm, record_to_state(content["params"]), data, recipe)
    else:
        own = record_to_state(content["own"]) if "own" in content else None
        stats = {k: v.numpy() for k, v in content["stats"].items()} if "stats" in content else None
        pred = client_validation(algorithm, record_to_state(content["server"]), data, recipe,
                                 int(content["config"]["round"]), own, stats)
    return RecordDict({"metrics": MetricRecord(validation_metrics(pred, data))})


def _hypernetwork(content: RecordDict, recipe: FlowerRecipe, kind: str) -> tuple[ODPFLHN, State]:
    algorithm = _algorithm(content, recipe)
    if not isinstance(algorithm, ODPFLHN):
        raise ValueError(f"query.{kind} is ODPFL-HN's message; this run trains {algorithm.name}")
    return algorithm, record_to_state(content["server"])["enc"]


def on_embed(content: RecordDict, recipe: FlowerRecipe, data: ClientData, state: RecordDict) -> RecordDict:
    """ODPFL-HN: this client's embedding e = g_gamma(D) of its training data with the sent encoder (the only
    thing about its data the server receives)."""
    algorithm, enc = _hypernetwork(content, recipe, "embed")
    return RecordDict({"embedding": ArrayRecord({"e": Array(client_embedding(algorithm, enc, data, recipe))})})


def on_encoder_grad(content: RecordDict, recipe: FlowerRecipe, data: ClientData, state: RecordDict) -> RecordDict:
    """ODPFL-HN: gamma's gradient for the sent dL/de of this client's embedding (its ClientBackprop)."""
    algorithm, enc = _hypernetwork(content, recipe, "encoder_grad")
    grad = client_encoder_grad(algorithm, enc, content["grad"]["e"].numpy(), data, recipe)
    return RecordDict({"grad": state_to_record({"enc": grad})})


def on_bn_sums(content: RecordDict, recipe: FlowerRecipe, data: ClientData, state: RecordDict) -> RecordDict:
    """The finalize step, a batch-normalised model: this client's sums of every layer's input with the sent
    weights (its upload for the population statistics)."""
    sums = client_bn_sums(_algorithm(content, recipe), record_to_state(content["server"]), data, recipe)
    return RecordDict({"sums": ArrayRecord({k: Array(v) for k, v in sums.items()})})


def on_dle(content: RecordDict, recipe: FlowerRecipe, data: ClientData, state: RecordDict) -> RecordDict:
    """The finalize step, BTFL: this client's local DLE and mean feature with the sent global features (and
    population statistics, ``stats``, for a batch-normalised model): its upload for the global DLE."""
    algorithm = _algorithm(content, recipe)
    if not isinstance(algorithm, BTFL):
        raise ValueError(f"query.dle is BTFL's message; this run trains {algorithm.name}")
    stats = {k: v.numpy() for k, v in content["stats"].items()} if "stats" in content else None
    upload = client_btfl_upload(algorithm, record_to_state(content["server"]), data, recipe, stats)
    return RecordDict({"dle": ArrayRecord({k: Array(v) for k, v in upload.items()})})


Handler = Callable[[RecordDict, FlowerRecipe, ClientData, RecordDict], RecordDict]
# message type -> the client's answer: what the ClientApp runs, and what a test runs without the transport
HANDLERS: dict[str, Handler] = {"query": on_query, "train": on_train, "evaluate": on_evaluate,
                                "query.embed": on_embed, "query.encoder_grad": on_encoder_grad,
                                "query.bn_sums": on_bn_sums, "query.dle": on_dle}


def answer(kind: str, content: RecordDict, recipe: FlowerRecipe, data: ClientData, state: RecordDict) -> RecordDict:
    """The reply content to a message of type ``kind`` (``state``: the run's context state on this node); node-local
    data is placed as the client the message's config numbers it."""
    cfg = content["config"] if "config" in content else {}
    return HANDLERS[kind](content, recipe, data.placed(cfg) if "client-id" in cfg else data, state)


def _process_start() -> float | None:
    """This process's start (epoch seconds, to 10 ms: Linux's /proc, whose start time counts from boot; None
    elsewhere). A ClientApp process forked by :mod:`fl_server.flower.superexec` started at its fork."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_start
    except (OSError, ValueError, AttributeError):
        return None


# modules whose import a message should not pay: loaded while handling it (not already when this module was imported,
# e.g. by the SuperExec the ClientApp process was forked from) is recorded in its phases
_WATCHED = {"dynamo": "torch._dynamo", "scipy": "scipy"}
_LOADED_BEFORE = frozenset(m for m in _WATCHED.values() if m in sys.modules)


def _log_phases(path: str, node: int, kind: str, t0: float, t1: float, t2: float) -> None:
    """Append one message's phases to ``path`` (``FL_FLOWER_PHASES``, set by benchmarks/flower.py): seconds from
    the ClientApp process's start to the handler (Flower's start-up and the imports), preparing the node's data,
    answering, and whether handling it imported ``torch._dynamo`` or scipy."""
    start = _process_start()
    row = {"node": node, "kind": kind, "start_to_handler_s": round(t0 - start, 3) if start else None,
           "data_s": round(t1 - t0, 3), "answer_s": round(t2 - t1, 3), "end": round(t2, 3),
           **{key: module in sys.modules and module not in _LOADED_BEFORE for key, module in _WATCHED.items()}}
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def make_client_app(overrides: Mapping[str, Any] | None = None) -> ClientApp:
    """The ClientApp; ``overrides`` win over the run config (``flwr.simulation.run_simulation`` passes none)."""
    overrides = dict(overrides or {})
    capp = ClientApp()

    def handle(msg: Message, context: Context) -> Message:
        t0 = time.time()
        recipe, data = _setup(context, overrides)
        t1 = time.time()
        reply = Message(answer(msg.metadata.message_type, msg.content, recipe, data, context.state), reply_to=msg)
        if os.environ.get("FL_FLOWER_PHASES"):
            _log_phases(os.environ["FL_FLOWER_PHASES"], context.node_id, msg.metadata.message_type, t0, t1, time.time())
        return reply

    for kind in HANDLERS:
        category, _, action = kind.partition(".")
        getattr(capp, category)(*([action] if action else []))(handle)
    return capp


app = make_client_app()
