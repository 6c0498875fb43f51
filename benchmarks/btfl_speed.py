"""Speed of BTFL's test-time interpolation on one CPU core (edge_sdk._btfl, numpy only on the device path).

Microseconds per sample, all measured in one run on the same seeded stream (D = 64 features, C = 10 classes):

* ``BTFLStream.predict`` (exact e, the paper's options) at batch 1 and batch 256 -- the whole per-sample
  pipeline: validation, fsq + both DLE likelihoods, both heads' softmax / entropy, events, tau_hat, the Beta
  recursion, e and the mixture (Eq. 21);
* the e step alone as predict runs it (memoised grid at batch 1, as a one-at-a-time stream hits it), cold
  (memo off) at batch 1, and at batch 256;
* ``BTFLStream.predict_one``: the batch-1 fast path (scalar Python math, one [2, D] product for both DLEs, a
  memoised grid for e), and the e step alone as it runs there (``_weight_one``);
* ``BTFLStream.predict`` with ``integral="trapezoid100"`` (our vectorised authors' variant);
* the public ``expected_global_weight`` called with one sample: its scalar path (floats) against the vectorised
  path (one-element lists), per call;
* references for e on the same (alpha, beta, tau_hat) triples: (a) scipy.integrate.quad per sample, (b) a
  re-statement of the authors' per-sample Python loop: 100-point trapezoid of Eq. 19 on [0.01, 0.99]
  (np.trapz is gone in NumPy 2.4, so the trapezoid is written out; the Beta pdf via betaln, which is cheaper
  than the scipy.stats call a straightforward port would make).

Rows are merged by (what, device) into docs/benchmarks/btfl-speed.json. ``value`` is wall time, ``cpu_us_per_sample``
the process CPU time (what the work costs on a core of its own); each row records the machine's load average at
the start and end of the run: on a shared machine compare rows of one run (ratios), not runs.

    python benchmarks/btfl_speed.py [--out docs/benchmarks/btfl-speed.json] [--repeats 5]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.rows import merge_rows  # noqa: E402

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"  # one core: set before numpy is imported

import argparse
import json
import math
import time
from collections.abc import Callable

from typing import Any

import numpy as np


from edge_sdk import _btfl as btfl, entropy

ROOT = Path(__file__).resolve().parents[1]

D, C = 64, 10
DEVICE = "cpu:1 thread"
COMMAND = "python benchmarks/btfl_speed.py"


def pin_one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[-1]})


def make_stream_data(n: int, seed: int = 0) -> dict[str, np.ndarray | float]:
    """Seeded synthetic client: own / other feature distributions, a mixed test stream, two heads' logits."""
    rng = np.random.default_rng(seed)
    keep = rng.uniform(0.2, 0.8, D)
    own = rng.exponential(0.6, (2000, D)) * (rng.random((2000, D)) < keep)
    other = rng.exponential(0.9, (2000, D))
    src = rng.random(n) < 0.5
    feats = np.where(
        src[:, None], rng.exponential(0.6, (n, D)) * (rng.random((n, D)) < keep), rng.exponential(0.9, (n, D))
    )
    local = rng.normal(0, 1, (n, C)) * rng.uniform(0.3, 4, (n, 1))
    glob = rng.normal(0, 1, (n, C)) * rng.uniform(0.3, 4, (n, 1))
    return {
        "local_dle": btfl.fit_dle(own),
        "global_dle": btfl.fit_dle(other),
        "features": feats,
        "local": local,
        "global": glob,
        "h_local_bar": float(np.median(entropy(local))),
        "h_global_bar": float(np.median(entropy(glob))),
    }


def new_stream(data: dict, **options: Any) -> btfl.BTFLStream:
    """A fresh stream; ``options``: :class:`edge_sdk._btfl.BTFLVariant` fields."""
    return btfl.BTFLStream(data["local_dle"], data["global_dle"], data["h_local_bar"], data["h_global_bar"],
                           btfl.BTFLVariant(**options))


def _now() -> np.ndarray:
    """(wall, CPU) seconds: CPU time of this single-threaded process is what a sample costs on an idle core;
    wall time also counts the waits for the CPU on a shared machine."""
    return np.array([time.perf_counter(), time.process_time()])


def _median_us(times: list[np.ndarray]) -> tuple[float, float]:
    """Median over repeats (first pass = warm-up dropped) of (wall, CPU) microseconds per sample."""
    arr = np.array(times[1:])
    return float(np.median(arr[:, 0])), float(np.median(arr[:, 1]))


def time_predict(data: dict, batch: int, repeats: int, **options: object) -> tuple[float, float]:
    """Median over repeats of (wall time of streaming all samples in chunks of ``batch``) / samples, in us."""
    n = len(data["features"])
    times = []
    for _ in range(repeats + 1):
        stream = new_stream(data, **options)
        t0 = _now()
        for s in range(0, n, batch):
            stream.predict(data["local"][s : s + batch], data["global"][s : s + batch], data["features"][s : s + batch])
        times.append((_now() - t0) / n * 1e6)
    return _median_us(times)


def time_predict_one(data: dict, repeats: int) -> tuple[float, float]:
    """Median over repeats of the per-sample wall time of ``predict_one`` over the whole stream, in us."""
    n = len(data["features"])
    rows = [(data["local"][i], data["global"][i], data["features"][i]) for i in range(n)]
    times = []
    for _ in range(repeats + 1):
        stream = new_stream(data)
        t0 = _now()
        for lo, gl, ft in rows:
            stream.predict_one(lo, gl, ft)
        times.append((_now() - t0) / n * 1e6)
    return _median_us(times)


def _time_calls(fn: Callable[..., object], calls: list[tuple], repeats: int) -> tuple[float, float]:
    """Median over repeats of (wall, CPU) microseconds per ``fn(*args)`` call."""
    times = []
    for _ in range(repeats + 1):
        t0 = _now()
        for args in calls:
            fn(*args)
        times.append((_now() - t0) / len(calls) * 1e6)
    return _median_us(times)


def time_weight_one(ab: np.ndarray, lt: np.ndarray, repeats: int) -> tuple[float, float]:
    return _time_calls(btfl.WeightIntegral().one, list(zip(ab[0].tolist(), ab[1].tolist(), lt.tolist())), repeats)


def time_public_weight(ab: np.ndarray, tau: np.ndarray, repeats: int, scalar: bool) -> tuple[float, float]:
    """Per call of the public ``expected_global_weight`` with one sample: Python floats (the scalar path) or
    one-element lists (the vectorised path, what every call cost before the scalar path)."""
    triples = list(zip(ab[0].tolist(), ab[1].tolist(), tau.tolist()))
    if not scalar:
        triples = [([a], [b], [t]) for a, b, t in triples]
    return _time_calls(btfl.expected_global_weight, triples, repeats)


def stream_triples(data: dict) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta) stacked [2, N] and tau_hat [N] exactly as predict feeds them to the weight."""
    stream = new_stream(data)
    stream.predict(data["local"], data["global"], data["features"])
    ab = np.stack([stream.last_alphas, stream.last_betas])
    return ab, np.exp(np.minimum(stream.last_log_tau_hat, 709.0))


def time_weight(ab: np.ndarray, tau: np.ndarray, batch: int, repeats: int, memo: bool = True) -> tuple[float, float]:
    n = tau.shape[0]
    chunks = [(np.ascontiguousarray(ab[:, s : s + batch]), tau[s : s + batch]) for s in range(0, n, batch)]
    integral = btfl.WeightIntegral()
    if not memo:  # every batch's prior terms computed again
        integral._prior_terms = btfl.weight._prior_terms  # type: ignore[method-assign]
    times = []
    for _ in range(repeats + 1):
        t0 = _now()
        for a_b, t in chunks:
            integral.batch(a_b, t)
        times.append((_now() - t0) / n * 1e6)
    return _median_us(times)


def quad_weight(a: float, b: float, t: float) -> float:
    """Reference: scipy.integrate.quad of Beta(m; a, b) * m / (m + (1 - m) t) on [0, 1]."""
    from scipy import integrate
    from scipy.special import betaln

    log_norm = betaln(a, b)

    def integrand(m: float) -> float:
        if m <= 0.0 or m >= 1.0:
            return 0.0
        return math.exp((a - 1) * math.log(m) + (b - 1) * math.log1p(-m) - log_norm) * m / (m + (1 - m) * t)

    return integrate.quad(integrand, 0.0, 1.0, points=[t / (1 + t)], epsabs=1e-13, epsrel=1e-11, limit=400)[0]


def authors_trapezoid_weight(a: float, b: float, t: float) -> float:
    """Re-statement of the authors' per-sample integral: 100-point trapezoid of m_hat pdf(m_hat | z) (Eq. 19)."""
    from scipy.special import betaln

    mh = np.linspace(0.01, 0.99, 100)
    den = 1 + mh * t - mh
    m = mh * t / den
    pdf = np.exp((a - 1) * np.log(m) + (b - 1) * np.log1p(-m) - betaln(a, b)) * t / den**2
    y = mh * pdf
    return float(np.sum((y[1:] + y[:-1]) * 0.5 * np.diff(mh)))


def time_per_sample_loop(
    fn: Callable[[float, float, float], float], ab: np.ndarray, tau: np.ndarray
) -> tuple[tuple[float, float], np.ndarray]:
    triples = list(zip(ab[0].tolist(), ab[1].tolist(), tau.tolist()))
    t0 = _now()
    out = np.array([fn(a, b, t) for a, b, t in triples])
    wall, cpu = (_now() - t0) / len(triples) * 1e6
    return (float(wall), float(cpu)), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "docs/benchmarks/btfl-speed.json"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=2048, help="stream length for the predict / e timings")
    ap.add_argument("--ref-samples", type=int, default=400, help="samples for the per-sample reference loops")
    args = ap.parse_args()
    pin_one_core()
    data = make_stream_data(args.samples)
    ab, tau = stream_triples(data)

    load_start = os.getloadavg()[0]
    results: list[tuple[str, tuple[float, float], dict]] = []
    results.append(("BTFLStream.predict_one (batch-1 fast path, exact e)", time_predict_one(data, args.repeats),
                    {"batch": 1}))
    for batch in (1, 256):
        results.append(
            (f"BTFLStream.predict (exact e), batch {batch}", time_predict(data, batch, args.repeats), {"batch": batch})
        )
    for batch in (1, 256):
        results.append(
            (
                f"BTFLStream.predict (integral=trapezoid100), batch {batch}",
                time_predict(data, batch, args.repeats, integral="trapezoid100"),
                {"batch": batch},
            )
        )
    results.append(
        ("e only (exact, as in predict: memoised grid), batch 1", time_weight(ab, tau, 1, args.repeats), {"batch": 1})
    )
    results.append(("e only (exact, scalar path of predict_one)", time_weight_one(ab, np.log(np.maximum(tau, 1e-300)), args.repeats),
                    {"batch": 1}))
    results.append(("expected_global_weight, one sample per call (floats: scalar path)",
                    time_public_weight(ab, tau, args.repeats, scalar=True), {"batch": 1}))
    results.append(("expected_global_weight, one sample per call (1-element lists: vectorised path)",
                    time_public_weight(ab, tau, args.repeats, scalar=False), {"batch": 1}))
    results.append(
        ("e only (exact, memo off), batch 1", time_weight(ab, tau, 1, args.repeats, memo=False), {"batch": 1})
    )
    results.append(("e only (exact), batch 256", time_weight(ab, tau, 256, args.repeats), {"batch": 256}))

    k = min(args.ref_samples, tau.shape[0])
    exact = btfl.expected_global_weight(ab[0, :k], ab[1, :k], tau[:k])
    us_quad, e_quad = time_per_sample_loop(quad_weight, ab[:, :k], tau[:k])
    us_trap, e_trap = time_per_sample_loop(authors_trapezoid_weight, ab[:, :k], tau[:k])
    results.append(
        (
            "e reference: scipy.integrate.quad per sample",
            us_quad,
            {"batch": 1, "max_abs_diff_exact_vs_quad": float(np.abs(exact - e_quad).max())},
        )
    )
    results.append(
        (
            "e authors' per-sample 100-point trapezoid loop",
            us_trap,
            {"batch": 1, "max_abs_diff_trapezoid_vs_exact": float(np.abs(exact - e_trap).max())},
        )
    )

    load = f"{load_start:.2f} -> {os.getloadavg()[0]:.2f}"
    rows = []
    for what, (value, cpu), extra in results:
        row = {
            "benchmark": "btfl-speed",
            "what": what,
            "metric": "us_per_sample",
            "value": round(value, 2),
            "cpu_us_per_sample": round(cpu, 2),
            "device": DEVICE,
            "command": COMMAND,
            **extra,
            "D": D,
            "C": C,
            "numpy": np.__version__,
            "load_avg_1min": load,
        }
        rows.append(row)
        print(f"{what:<62s} {value:10.2f} us/sample (CPU {cpu:8.2f})  {json.dumps(extra)}")
    merge_rows(Path(args.out), rows)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
