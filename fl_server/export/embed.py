"""Frozen graphs: turn weight inputs of an exported ONNX graph into initializers.

A graph a device only runs forward with the weights it received (BTFL's ``features``: the frozen body and the
global head) gains nothing from taking them as inputs: every call then feeds and copies each weight, and
onnxruntime cannot fold or pre-pack them. Embedded, the weights are constants that onnxruntime pre-packs
once at session creation. Graphs whose weights the device updates (the step graphs, ``forward`` after
personalisation) keep them as inputs.

A step graph's frozen weights (``StepSpec.referenced``) are the bundle's own weights: ``embed_inputs(...,
reference=True)`` makes them initializers that hold no bytes, only a reference -- external data at the location
:data:`edge_sdk.shared.FROZEN_LOCATION`, by their graph names (``psi.<p>``, ``phi.<p>``) -- which the device fills
with the bundle's verified arrays (``edge_sdk._bundle``), so a bundle stores each weight once.

Example::

    export_spec(spec, path)
    embed_inputs(path, {"psi.fc.weight": w, "psi.fc.bias": b})  # the graph now takes only x
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edge_sdk.shared import FROZEN_LOCATION

from fl_server.atomic import atomic_path
from fl_server.export.rewrites import constant_transposed_convolutions

_NP_DTYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
              onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32}


def embed_inputs(path: str | os.PathLike, values: Mapping[str, np.ndarray], reference: bool = False) -> Path:
    """Replace the graph inputs named in ``values`` by initializers holding those arrays (cast to the input's
    dtype; the shape must match where the graph fixes it). Rewritten atomically in place. ``reference``: the
    initializers hold no bytes but refer to the bundle's weights of their names (:func:`weight_reference`)."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    missing = sorted(set(values) - set(inputs))
    if missing:
        raise ValueError(f"{path.name} has no inputs {missing} to embed (inputs: {sorted(inputs)})")
    kept = [i for i in model.graph.input if i.name not in values]
    for name, value in values.items():
        t = inputs[name].type.tensor_type
        want = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        arr = np.array(value, dtype=_NP_DTYPES.get(t.elem_type, np.float32), order="C")  # (a 0-d array stays 0-d)
        if len(want) != arr.ndim or any(w is not None and w != s for w, s in zip(want, arr.shape)):
            raise ValueError(f"{name}: array of shape {list(arr.shape)} does not fit the graph's input {want}")
        model.graph.initializer.append(weight_reference(arr, name) if reference else numpy_helper.from_array(arr, name))
    del model.graph.input[:]
    model.graph.input.extend(kept)
    constant_transposed_convolutions(model)  # input gradients through constant weights: packed convolutions
    with atomic_path(path) as tmp:
        onnx.save(model, str(tmp))
    return path


def weight_reference(arr: np.ndarray, name: str) -> onnx.TensorProto:
    """An initializer of ``arr``'s dtype and shape whose data is the bundle's weight ``name`` (external data at
    :data:`FROZEN_LOCATION`, no offset or length: the whole array)."""
    t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype), dims=list(arr.shape))
    t.data_location = onnx.TensorProto.EXTERNAL
    t.external_data.add(key="location", value=FROZEN_LOCATION)
    return t
