"""int8 dynamic quantization of frozen forward paths (onnxruntime.quantization).

Our forward graphs take the weights as inputs (``psi.<name>``) so that a device can run them with personalised
weights. A frozen path (the received model used as is, a feature extractor, a head) is first *frozen*: the weight
inputs become initializers; then ``quantize_dynamic`` stores MatMul/Gemm (and Conv) weights as int8 with
per-tensor scales and quantizes activations on the fly.
"""
from __future__ import annotations

import logging

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper


def freeze_weights(src: str | os.PathLike, weights: dict[str, np.ndarray], dest: str | os.PathLike,
                   prefix: str = "psi.") -> Path:
    """Turn the graph inputs ``prefix + name`` into initializers holding ``weights[name]``."""
    model = onnx.load(str(src))
    graph = model.graph
    frozen = [i for i in graph.input if i.name.startswith(prefix)]
    missing = [i.name for i in frozen if i.name[len(prefix):] not in weights]
    if missing:
        raise KeyError(f"no weights for graph inputs {missing}")
    for inp in frozen:
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weights[inp.name[len(prefix):]]), inp.name))
        graph.input.remove(inp)
    onnx.checker.check_model(model)
    onnx.save(model, str(dest))
    return Path(dest)


def quantize_int8(src: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Dynamic int8 quantization of a frozen graph (weights int8, activations quantized at run time)."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # fold the exporter's Transpose(weight) etc. into constants so that MatMul/Gemm/Conv see initializers
    folded = Path(dest).with_name(Path(dest).stem + ".folded.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(folded)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # its "Please consider to run pre-processing" hint is not for our users
    try:
        quantize_dynamic(str(folded), str(dest), weight_type=QuantType.QInt8,
                         op_types_to_quantize=["MatMul", "Gemm", "Conv"])
    finally:
        root.setLevel(level)
        folded.unlink(missing_ok=True)
    return Path(dest)
