"""Shared timing helper of the benchmark scripts (run as ``python benchmarks/<name>.py``)."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def interleaved_median_ms(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median wall time in milliseconds of each ``fns[name]()``, the calls alternating (A B A B ...) so that
    load changes on a shared machine hit every variant alike; ``warmup`` calls of each first."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def sync(device: object) -> None:
    """Wait for the GPU's queued work (a no-op elsewhere), so that a timing covers it."""
    import torch

    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)  # type: ignore[arg-type]


def command_line() -> str:
    """The command that reproduces this benchmark run, as its rows record it."""
    from lab.rows import invocation

    return invocation()


def run_fields(device_description: str, repeats: int) -> dict[str, object]:
    """The fields every benchmark row records about its run (the machine's load at the time included)."""
    import os

    import torch

    return {"repeats": repeats, "device": device_description, "load_average_1min": round(os.getloadavg()[0], 2),
            "torch": torch.__version__, "command": command_line()}
