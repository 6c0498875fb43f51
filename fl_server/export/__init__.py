"""ONNX export of frozen forward paths and gradient-step graphs (dynamic batch axis, pinned opset)."""
from fl_server.export import fedicon  # noqa: F401  (registers FedICON's step graph builder)
from fl_server.export.embed import embed_inputs
from fl_server.export.graphs import OPSET, export_function
from fl_server.export.steps import (StepSpec, encoder_spec, fedtta_step_spec, forward_spec, referenced_values,
                                    tent_step_spec)


def export_spec(spec: StepSpec, path):  # type: ignore[no-untyped-def]
    """Export a :class:`StepSpec` to ``path`` (atomic); inputs in ``spec.embedded`` become initializers, those in
    ``spec.referenced`` initializers that refer to the bundle's weights (no bytes: a bundle supplies them)."""
    out = export_function(spec.fn, spec.example, spec.input_names, spec.output_names, spec.batch_inputs, path)
    if spec.embedded:
        values = dict(zip(spec.input_names, spec.example))
        embed_inputs(out, {n: values[n].detach().cpu().numpy() for n in spec.embedded})
    if spec.referenced:
        embed_inputs(out, referenced_values(spec), reference=True)
    return out


__all__ = ["OPSET", "StepSpec", "encoder_spec", "export_function", "export_spec", "fedtta_step_spec", "forward_spec", "tent_step_spec"]
