"""Torch device selection (the accelerator that trains, not an edge device): CUDA when available, else CPU (every
benchmark records which)."""
from __future__ import annotations

import torch


def pick_device(requested: str | None = None) -> torch.device:
    if requested in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} requested but CUDA is not available on this machine")
    try:
        return torch.device(requested)
    except RuntimeError:
        raise ValueError(f"unknown device {requested!r}; use auto, cpu, cuda or cuda:N") from None


def describe(device: torch.device) -> str:
    """Human-readable device name for results files, e.g. 'cuda:NVIDIA H100 80GB HBM3' or 'cpu:2 threads'."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{torch.get_num_threads()} threads"
