"""Trace pure functions of (inputs, weights) into ONNX graphs with a dynamic batch axis.

The gradient steps a device needs are traced with ``make_fx`` (symbolic shapes) over ``torch.func.grad``,
with :mod:`fl_server.export.decompositions` so ConvNets lower, then exported by the dynamo ONNX exporter (and rewritten
where :mod:`fl_server.export.rewrites` finds a cheaper equal form). Every weight is a graph input, so the device feeds
the weights it holds and receives the updated ones. The exporter's debug records (stack traces with the
exporting machine's paths, FX node dumps: most of a graph's bytes) are dropped (:func:`strip_debug`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence

import onnx
import torch
from google.protobuf.message import Message
from torch.fx.experimental.proxy_tensor import make_fx

from fl_server.atomic import atomic_path
from fl_server.export.decompositions import DECOMPOSITIONS
from fl_server.export.rewrites import cancel_transpose_pairs, pool_plane_offsets, pow_to_mul, recompute_late_reads

OPSET = 18
DEBUG_FIELDS = ("doc_string", "metadata_props")  # what a device never reads: free text and key-value notes
_KEEP_DEBUG = False  # tests set it to measure what strip_debug saves


def strip_debug(message: Message) -> bool:
    """Clear every ``doc_string`` and ``metadata_props`` in an ONNX proto and all it holds (model, graphs and
    subgraphs, nodes, attributes, functions, value infos, initializers): the dynamo exporter's stack traces,
    FX node dumps and name scopes, which name files of the exporting machine. Names, shapes and weights stay,
    so the graph computes the same. Returns whether anything was removed."""
    if _KEEP_DEBUG:
        return False
    removed = False
    for field, value in message.ListFields():
        if field.name in DEBUG_FIELDS:
            message.ClearField(field.name)
            removed = True
        elif isinstance(value, Message):
            removed |= strip_debug(value)
        elif field.type == field.TYPE_MESSAGE:  # a repeated message field
            for item in value:
                removed |= strip_debug(item)
    return removed


def _positional_module(graph: torch.nn.Module, arg_names: Sequence[str]) -> torch.nn.Module:
    """A module whose ``forward(self, a, b, ...)`` has one named argument per graph input (the exporter
    maps ``dynamic_shapes`` and ONNX input names by argument)."""
    args = ", ".join(arg_names)
    namespace: dict = {}
    exec(f"def forward(self, {args}):\n    return self.graph({args})\n", namespace)  # noqa: S102 - fixed template
    module = type("TracedStep", (torch.nn.Module,), {"forward": namespace["forward"]})()
    module.graph = graph
    return module.eval()


# example batch sizes to retry with when tracing fixed the batch axis (see export_function)
RETRY_BATCHES = (5, 11, 13)


def export_function(fn: Callable[..., tuple[torch.Tensor, ...]], example: Sequence[torch.Tensor],
                    input_names: Sequence[str], output_names: Sequence[str], batch_inputs: Sequence[str],
                    path: str | os.PathLike) -> Path:
    """Export ``fn(*example)`` to ONNX at ``path``; inputs named in ``batch_inputs`` get a dynamic axis 0.
    Written atomically (temp file + rename).

    Symbolic tracing gives equal sizes one symbol, so an example batch that equals some width of the graph
    (FedICON's two views of a batch of 4 against a width of 8) can turn into a constant, and the graph would take
    only that batch size. The export is then retraced with the batch inputs' rows repeated to another batch size
    (``RETRY_BATCHES``); a ``ValueError`` if every size is fixed.

    >>> export_function(lambda x, w: (x @ w,), [torch.rand(4, 3), torch.rand(3, 2)], ["x", "w"], ["y"], ["x"],
    ...                 "matmul.onnx")  # doctest: +SKIP
    PosixPath('matmul.onnx')
    """
    path = Path(path)
    batch = len(example[list(input_names).index(batch_inputs[0])]) if batch_inputs else None
    for size in (batch, *(b for b in RETRY_BATCHES if b != batch)):
        feeds = [_resize_batch(t, size) if n in batch_inputs else t for n, t in zip(input_names, example)]
        with _quiet():
            _export(fn, feeds, input_names, output_names, batch_inputs, path)
        if not batch_inputs or all(_dynamic_batch(path, n) for n in batch_inputs):
            return path
    path.unlink()
    raise ValueError(f"tracing fixed the batch axis of {', '.join(batch_inputs)} at every example batch size "
                     f"({batch}, {', '.join(map(str, RETRY_BATCHES))}); the graph would take only that batch")


def _resize_batch(t: torch.Tensor, size: int | None) -> torch.Tensor:
    """``t``'s rows repeated cyclically to ``size`` rows."""
    return t if size is None or size == len(t) else t[torch.arange(size) % len(t)]


def _dynamic_batch(path: Path, name: str) -> bool:
    """Whether the exported graph's input ``name`` has a symbolic axis 0 (or is not an input: the graph does not
    read it)."""
    model = onnx.load(str(path), load_external_data=False)
    info = next((i for i in model.graph.input if i.name == name), None)
    return info is None or bool(info.type.tensor_type.shape.dim[0].dim_param)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter prints progress lines and library warnings; keep the user's terminal clean."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        level = logging.getLogger("torch").level
        logging.getLogger("torch").setLevel(logging.ERROR)
        try:
            yield
        finally:
            logging.getLogger("torch").setLevel(level)


def _export(fn: Callable[..., tuple[torch.Tensor, ...]], example: Sequence[torch.Tensor],
            input_names: Sequence[str], output_names: Sequence[str], batch_inputs: Sequence[str],
            path: Path) -> Path:
    graph = make_fx(fn, tracing_mode="symbolic", decomposition_table=DECOMPOSITIONS)(*example)
    arg_names = [f"in{i}" for i in range(len(example))]
    batch = torch.export.Dim("batch", min=1)
    dynamic = {a: ({0: batch} if n in batch_inputs else None) for a, n in zip(arg_names, input_names)}
    onnx_program = torch.onnx.export(_positional_module(graph, arg_names), tuple(example), dynamo=True,
                                     input_names=list(input_names), output_names=list(output_names),
                                     dynamic_shapes=dynamic, opset_version=OPSET, verbose=False)
    with atomic_path(path) as tmp:
        onnx_program.save(str(tmp))
        model = onnx.load(str(tmp))
        if (strip_debug(model) | bool(pool_plane_offsets(model)) | bool(pow_to_mul(model))
                | bool(cancel_transpose_pairs(model)) | bool(recompute_late_reads(model))):
            onnx.save(model, str(tmp))
    return path
