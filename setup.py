"""The coordinator's dependencies (the rest of the metadata is in pyproject.toml).

They live here for one line: the device SDK is required as a direct reference to this checkout's
``edge_sdk/`` folder, an absolute ``file:`` URL that pyproject.toml cannot compute. pip then installs it from
that folder only and never asks a package index for the name (on PyPI, ``edge-sdk`` is an unrelated project,
and anyone could register ``fl-edge-sdk``): ``pip install .`` is enough on a fresh machine.
"""
from pathlib import Path

from setuptools import setup

SDK = Path(__file__).resolve().parent / "edge_sdk"

setup(install_requires=[
    # CPU wheel on CI; a GPU user installs the same version from a CUDA index
    # (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128).
    "torch==2.13.0",
    "numpy>=1.26",
    "scipy>=1.11",
    "tqdm>=4.66",
    "onnx>=1.16",
    "onnxruntime>=1.18",
    "onnxscript>=0.5",  # the dynamo ONNX exporter
    "fastapi>=0.110",
    "uvicorn>=0.29",
    "uvloop>=0.19; sys_platform != 'win32'",  # uvicorn's fast event loop and HTTP parser (coordinator load)
    "httptools>=0.6",
    "httpx>=0.27",
    "prometheus-client>=0.20",  # GET /metrics (request, process and Python metrics)
    "cryptography>=42",  # Ed25519 signing of bundle manifests (devices verify with edge_sdk._ed25519, no deps)
    f"fl-edge-sdk @ {SDK.as_uri()}",  # the device SDK from this checkout, never from an index
])
