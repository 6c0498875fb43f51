"""ONNX export of frozen forward paths and gradient-step graphs (see the export/SDK issue)."""
