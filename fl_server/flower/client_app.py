"""The Flower ClientApp: one training client, on the SuperNode that holds its data.

The SuperNode's ``--node-config`` names the data it trains on: ``data``, the node's own arrays file or image
folder (:func:`~fl_server.flower.task.load_node_data`; relative to the SuperNode's working directory), or, for
tests and simulations, ``partition-id``, one partition of the recipe's data set (optional ``data-dir``, where
the data set's files are). Three message kinds: ``query`` (the client's sizes and input shape, so the server can build
the method without data), ``train`` (the engine's local steps from the state the server sent) and ``evaluate``
(validation accuracy of the sent state on the client's own validation split); and the finalize step's uploads
at the end of a run: ``query.bn_sums`` (a batch-normalised model's sums for the population statistics) and
``query.dle`` (BTFL's local DLE and mean feature).

Example (a SuperNode on the same machine as the SuperLink, insecure, for a try-out)::

    flower-supernode --insecure --superlink 127.0.0.1:9092 --port 9094 --node-config "data='node-data/train.npz'"
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_server.algorithms.btfl import BTFL
from fl_server.flower.task import (ClientData, FlowerRecipe, client_bn_sums, client_btfl_upload, client_round,
                                    client_validation, load_node_data, load_partition)
from fl_server.flower.wire import record_to_state, state_to_record

_PRIVATE = "fl-edge-private"  # the client's own entries between rounds (BTFL's local head), never sent
_STATE_LIMIT = 8 << 20  # bytes of partition kept in the context state (tens of MB there miss Flower's heartbeat)
_PARTITION = "fl-edge-partition"  # the node's partition, kept in the run's context state between messages


def _setup(context: Context, overrides: Mapping[str, Any]) -> tuple[FlowerRecipe, ClientData]:
    """The recipe and this node's data (its own, ``data``, or its partition, ``partition-id``): loaded on the
    run's first message, then read back from the context state (Flower starts a fresh ClientApp process per
    message)."""
    recipe = FlowerRecipe.from_config({**context.run_config, **overrides})
    node = context.node_config
    if ("data" in node) == ("partition-id" in node):
        raise ValueError("the SuperNode's --node-config names " + ("both data and partition-id; keep one" if
                         "data" in node else "no data; add data='PATH' (its arrays file or image folder)"))
    if _PARTITION in context.state:
        meta, kept = context.state[_PARTITION + "-meta"], context.state[_PARTITION]
        arrays = {k: kept[k].numpy() for k in ("x_train", "y_train", "x_val", "y_val")}
        return recipe, ClientData(int(meta["partition-id"]), int(meta["num-partitions"]), int(meta["num-classes"]),
                                  **arrays, local=bool(meta["local"]))
    if "data" in node:
        data = load_node_data(recipe, str(node["data"]))
    else:
        data_dir = node.get("data-dir") or context.run_config.get("data-dir") or None
        data = load_partition(recipe, int(node["partition-id"]), str(data_dir) if data_dir else None)
    if sum(getattr(data, k).nbytes for k in ("x_train", "y_train", "x_val", "y_val")) > _STATE_LIMIT:
        return recipe, data  # a large partition is rebuilt per message (the context state crosses processes)
    context.state[_PARTITION + "-meta"] = ConfigRecord({"partition-id": data.partition_id,
                                                        "num-partitions": data.num_partitions,
                                                        "num-classes": data.num_classes, "local": data.local})
    context.state[_PARTITION] = ArrayRecord({k: Array(np.array(getattr(data, k), order="C"))
                                             for k in ("x_train", "y_train", "x_val", "y_val")})
    return recipe, data


def make_client_app(overrides: Mapping[str, Any] | None = None) -> ClientApp:
    """The ClientApp; ``overrides`` win over the run config (``flwr.simulation.run_simulation`` passes none)."""
    overrides = dict(overrides or {})
    capp = ClientApp()

    @capp.query()
    def query(msg: Message, context: Context) -> Message:
        """The client's partition id (-1: the node's own data), sample counts, input shape and class count (no
        samples)."""
        _, data = _setup(context, overrides)
        info = ConfigRecord({"partition-id": data.partition_id, "num-partitions": data.num_partitions,
                             "num-train": len(data.y_train), "num-val": len(data.y_val),
                             "input-shape": list(data.input_shape), "num-classes": data.num_classes})
        return Message(RecordDict({"info": info}), reply_to=msg)

    @capp.train()
    def train(msg: Message, context: Context) -> Message:
        """One round of local training: ``state`` (this client's start state) and ``server`` (the server state
        the method's step reads) in, the trained state out."""
        recipe, data = _setup(context, overrides)
        cfg = msg.content["config"]
        data = data.placed(cfg)
        algorithm = recipe.build_algorithm(int(cfg["num-clients"]))
        start = record_to_state(msg.content["state"])
        server = record_to_state(msg.content["server"])
        private = record_to_state(context.state[_PRIVATE]) if _PRIVATE in context.state else None
        trained, kept = client_round(algorithm, start, server, data, recipe, int(cfg["round"]), private)
        if kept:
            context.state[_PRIVATE] = state_to_record(kept)
        return Message(RecordDict({"state": state_to_record(trained),
                                   "metrics": MetricRecord({"num-examples": len(data.y_train)})}), reply_to=msg)

    @capp.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        """Validation accuracy of the sent server state on this client's validation split."""
        recipe, data = _setup(context, overrides)
        cfg = msg.content["config"]
        data = data.placed(cfg)
        algorithm = recipe.build_algorithm(int(cfg["num-clients"]))
        acc = client_validation(algorithm, record_to_state(msg.content["server"]), data, recipe,
                                int(cfg["round"]))
        return Message(RecordDict({"metrics": MetricRecord({"accuracy": acc, "num-examples": len(data.y_val)})}),
                       reply_to=msg)

    @capp.query("bn_sums")
    def bn_sums(msg: Message, context: Context) -> Message:
        """The finalize step, a batch-normalised model: this client's sums of every layer's input with the sent
        weights (its upload for the population statistics)."""
        recipe, data = _setup(context, overrides)
        data = data.placed(msg.content["config"])
        algorithm = recipe.build_algorithm(int(msg.content["config"]["num-clients"]))
        sums = client_bn_sums(algorithm, record_to_state(msg.content["server"]), data, recipe)
        return Message(RecordDict({"sums": ArrayRecord({k: Array(v) for k, v in sums.items()})}), reply_to=msg)

    @capp.query("dle")
    def dle(msg: Message, context: Context) -> Message:
        """The finalize step, BTFL: this client's local DLE and mean feature with the sent global features (and
        population statistics, ``stats``, for a batch-normalised model): its upload for the global DLE."""
        recipe, data = _setup(context, overrides)
        cfg = msg.content["config"]
        data = data.placed(cfg)
        algorithm = recipe.build_algorithm(int(cfg["num-clients"]))
        if not isinstance(algorithm, BTFL):
            raise ValueError(f"query.dle is BTFL's message; this run trains {algorithm.name}")
        stats = {k: v.numpy() for k, v in msg.content["stats"].items()} if "stats" in msg.content else None
        upload = client_btfl_upload(algorithm, record_to_state(msg.content["server"]), data, recipe, stats)
        return Message(RecordDict({"dle": ArrayRecord({k: Array(v) for k, v in upload.items()})}), reply_to=msg)

    return capp


app = make_client_app()
