"""The Flower ClientApp: one training client, on the SuperNode that holds its data.

The SuperNode's ``--node-config`` names its partition (``partition-id``; optional ``data-dir``, where the data
set's files are). Three message kinds: ``query`` (the client's sizes and input shape, so the server can build
the method without data), ``train`` (the engine's local steps from the state the server sent) and ``evaluate``
(validation accuracy of the sent state on the client's own validation split).

Example (a SuperNode on the same machine as the SuperLink, insecure, for a try-out)::

    flower-supernode --insecure --superlink 127.0.0.1:9092 --port 9094 --node-config "partition-id=0"
"""
from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_server.flower.task import (ClientData, FlowerRecipe, client_train, client_validation, load_partition)
from fl_server.flower.wire import record_to_state, state_to_record

app = ClientApp()

_CACHE: dict[tuple, tuple[FlowerRecipe, ClientData]] = {}  # per process: the partition is loaded once per run


def _setup(context: Context) -> tuple[FlowerRecipe, ClientData]:
    recipe = FlowerRecipe.from_config(context.run_config)
    pid = int(context.node_config["partition-id"])
    data_dir = context.node_config.get("data-dir") or context.run_config.get("data-dir") or None
    key = (repr(recipe), pid, data_dir)
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = (recipe, load_partition(recipe, pid, str(data_dir) if data_dir else None))
    return _CACHE[key]


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The client's partition id, sample counts, input shape and class count (no samples)."""
    _, data = _setup(context)
    info = ConfigRecord({"partition-id": data.partition_id, "num-partitions": data.num_partitions,
                         "num-train": len(data.y_train), "num-val": len(data.y_val),
                         "input-shape": list(data.input_shape), "num-classes": data.num_classes})
    return Message(RecordDict({"info": info}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round of local training: ``state`` (this client's start state) and ``server`` (the server state the
    method's step reads) in, the trained state out."""
    recipe, data = _setup(context)
    cfg = msg.content["config"]
    algorithm = recipe.build_algorithm(data.input_shape, int(cfg["num-classes"]), int(cfg["num-clients"]))
    start = record_to_state(msg.content["state"])
    server = record_to_state(msg.content["server"])
    trained = client_train(algorithm, start, server, data, recipe, int(cfg["round"]))
    return Message(RecordDict({"state": state_to_record(trained),
                               "metrics": MetricRecord({"num-examples": len(data.y_train)})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Validation accuracy of the sent server state on this client's validation split."""
    recipe, data = _setup(context)
    cfg = msg.content["config"]
    algorithm = recipe.build_algorithm(data.input_shape, int(cfg["num-classes"]), int(cfg["num-clients"]))
    acc = client_validation(algorithm, record_to_state(msg.content["server"]), data, recipe)
    return Message(RecordDict({"metrics": MetricRecord({"accuracy": acc, "num-examples": len(data.y_val)})}),
                   reply_to=msg)
