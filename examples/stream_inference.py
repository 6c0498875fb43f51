"""A mobile-like client of the coordinator: join, download, personalise, then predict on a stream.
Device side only: imports edge_sdk and numpy (matplotlib if installed, for the plot), never fl_server or torch.

    fl-server device-data http://127.0.0.1:8000 --method TENT --out runs/device-stream.npz   # coordinator side
    python examples/stream_inference.py --server http://127.0.0.1:8000 --method tent --data runs/device-stream.npz

1. joins the coordinator (edge_sdk.EdgeClient; bundle downloaded with resume, signature and every sha256
   verified) and opens the bundle with ``edge_sdk.open_bundle``: the bundle's method decides what happens next,
2. personalises on a warm-up window of the device's data (``device.personalize``): TENT / FedTTA++ on the
   *unlabeled* window; ODPFL-HN sends only its embedding and receives weights; BTFL trains its local head on
   the *labeled* window over the frozen global features, fits its local DLE and uploads it (POST
   /v1/btfl/dle), then streams with the returned global DLE, interpolating the two heads with BTFL's weight e,
3. processes a stream one sample at a time with two shifts: in-distribution (the device's own held-out
   samples) -> corrupted (the same distribution under an image corruption) -> external classes (classes
   the device never had), printing rolling accuracy and per-sample latency; a final summary and a PNG.

The samples (``--data``) are a held-out new client of the bundle's own protocol, written on the coordinator's
side by ``fl-server device-data``; a real device has its own. Labels are used only to score (and by BTFL,
whose participant trains its local head). No torch is imported (checked at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import edge_sdk
from edge_sdk import EdgeClient, EdgeClientError
from edge_sdk.safeguard import SafeguardRule

METHODS = {"btfl": "BTFL", "fedtta++": "FedTTA++", "odpfl-hn": "ODPFL-HN", "tent": "TENT", "none": "none"}
PHASES = ("in-distribution", "corrupted", "external classes")


_last_progress: list[tuple] = []


def _print_progress(detail: dict) -> None:
    """While the coordinator trains: one line each time a job passes another tenth of its rounds."""
    jobs = [j for j in detail.get("jobs") or [] if isinstance(j, dict)]
    tenths = tuple((j.get("method"), 10 * int(j.get("rounds_done") or 0) // max(1, int(j.get("rounds") or 1)))
                   for j in jobs)
    if jobs and _last_progress[-1:] != [tenths]:
        _last_progress.append(tenths)
        print("training: " + ", ".join(f"{j.get('method')} {j.get('rounds_done')}/{j.get('rounds')} rounds"
                                       for j in jobs), flush=True)


def load_samples(path: str) -> dict[str, np.ndarray]:
    """The device's samples (``fl-server device-data --kind stream``): plain arrays, no pickle."""
    with np.load(path, allow_pickle=False) as arrays:
        return {k: arrays[k] for k in arrays.files}


def rolling(correct: np.ndarray, window: int) -> np.ndarray:
    """Rolling mean over the last ``window`` samples (fewer at the start), vectorised with a cumsum."""
    c = np.concatenate([[0.0], np.cumsum(correct)])
    t = np.arange(1, len(correct) + 1)
    lo = np.maximum(0, t - window)
    return (c[t] - c[lo]) / (t - lo)


def save_plot(path: Path, acc: np.ndarray, phase: np.ndarray, title: str, e: np.ndarray | None = None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return False
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot(np.arange(len(acc)), 100 * acc, color="#1f6feb", lw=1.6, label="rolling accuracy")
    for k, name in enumerate(PHASES):
        idx = np.flatnonzero(phase == k)
        ax.axvspan(idx[0] - 0.5, idx[-1] + 0.5, color=("#e8f5e9", "#fff8e1", "#fdecea")[k], zorder=0)
        ax.text(idx[0] + 1, 4, name, fontsize=8, color="#555")
    ax.set(xlabel="stream sample", ylabel="accuracy (%)", ylim=(0, 102), title=title)
    handles = ax.get_legend_handles_labels()
    if e is not None:  # BTFL: the weight of the global head per sample
        ax2 = ax.twinx()
        ax2.plot(np.arange(len(e)), e, color="#d1242f", lw=0.9, alpha=0.8, label="BTFL e (global-head weight)")
        ax2.set(ylabel="e", ylim=(0, 1.02))
        h2 = ax2.get_legend_handles_labels()
        handles = (handles[0] + h2[0], handles[1] + h2[1])
    ax.legend(*handles, loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _safeguard(spec: str) -> SafeguardRule | bool:
    """--safeguard: 'bundle' -> the bundle's declared rule, 'off' -> none, a number -> the disagreement rule."""
    if spec == "bundle":
        return True
    if spec == "off":
        return False
    try:
        return SafeguardRule("disagreement", threshold=float(spec))
    except ValueError:
        raise SystemExit(f"--safeguard must be 'bundle', 'off' or a share in [0, 1], got {spec!r}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True, help="coordinator URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--method", default="tent", choices=list(METHODS), type=str.lower,
                    help="any letter case (TENT, FedTTA++ ...)")
    ap.add_argument("--data", required=True, help="the device's samples: fl-server device-data ... --out FILE.npz")
    ap.add_argument("--window", type=int, default=20, help="rolling-accuracy window")
    ap.add_argument("--print-every", type=int, default=20)
    ap.add_argument("--epsilon", type=float, default=float("inf"),
                    help="odpfl-hn: the device's privacy budget for its embedding (needs a bundle of the DP encoder)")
    ap.add_argument("--safeguard", default="bundle",
                    help="after personalising, keep the received model when label-free evidence says adaptation "
                         "hurt (edge_sdk.safeguard): 'bundle' (the rule the method declared, in the manifest), "
                         "'off', or a number t (keep it when more than t of the warm-up predictions changed)")
    ap.add_argument("--wait", type=float, default=600, help="seconds to wait for the coordinator's bundle")
    ap.add_argument("--cache", default="runs/device-cache", help="the device's artifact cache")
    ap.add_argument("--png", default=None, help="plot path (default runs/stream-<method>.png)")
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--public-key", default=os.environ.get("FL_SIGNING_PUBLIC_KEY"),
                    help="the coordinator's manifest signing key to pin (hex, printed by fl-server serve; default "
                         "$FL_SIGNING_PUBLIC_KEY); without it the key is trusted on first use, with a warning")
    ap.add_argument("--enrollment-token", default=os.environ.get("FL_ENROLLMENT_TOKEN"),
                    help="the operator's enrollment token (POST /v1/enrollments; default $FL_ENROLLMENT_TOKEN): "
                         "needed to join unless the coordinator runs with FL_SERVE_ENROLLMENT=open")
    ap.add_argument("--ca-file", default=os.environ.get("FL_CA_FILE"),
                    help="https:// coordinator with a self-signed certificate: the CA (PEM) to pin "
                         "(default $FL_CA_FILE)")
    args = ap.parse_args()
    method = METHODS[args.method]
    if not args.public_key:
        print("WARNING: no --public-key: the coordinator's signing key is trusted on first use (fetched from the "
              "server itself, then stored in the cache). Anyone on the path at that moment can substitute their own "
              "key; pin the key that `fl-server serve` prints.", file=sys.stderr, flush=True)
    if args.server.startswith("http://") and not args.server.startswith(("http://127.0.0.1", "http://localhost")):
        print("WARNING: plain HTTP to a remote coordinator: the bearer token travels in clear; use https:// "
              "(fl-server serve --tls-cert/--tls-key)", file=sys.stderr, flush=True)

    with EdgeClient(args.server, cache_dir=args.cache, public_key=args.public_key, ca_file=args.ca_file) as client:
        try:
            client.wait_ready(None if method == "none" else method, timeout=args.wait, on_wait=_print_progress)
            info = client.join(None if method == "none" else method, enrollment_token=args.enrollment_token)
        except EdgeClientError as exc:
            if exc.status == 404 and method == "BTFL":
                print(f"error: this coordinator has no BTFL bundle and no BTFL job (start one with the admin "
                      f"token: POST /v1/jobs {{\"method\": \"BTFL\"}}, or FL_SERVE_DEFAULT_METHODS=...,BTFL); "
                      f"or try --method fedtta++, odpfl-hn, tent or none. ({exc})", file=sys.stderr)
                return 3
            print(f"error: {exc}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        bundle = client.download(info.manifest)
        t_download = time.perf_counter() - t0
        print(f"joined {args.server} as {info.client_id[:12]} (methods served: {', '.join(info.methods)}); "
              f"{bundle.method} bundle {info.manifest['bundle_id'][:12]} verified, "
              f"{len(bundle.manifest['artifacts'])} artifacts, {1e3 * t_download:.0f} ms")
        data = load_samples(args.data)
        warm, warm_y, xs, ys, phase = (data[k] for k in ("warm_x", "warm_y", "stream_x", "stream_y", "stream_phase"))
        device = edge_sdk.open_bundle(bundle, method="none" if method == "none" else None, client=client,
                                      safeguard=_safeguard(args.safeguard))
        baseline = edge_sdk.open_bundle(bundle, method="none")  # the received model, for comparison
        t0 = time.perf_counter()
        result = device.personalize(warm, warm_y if device.needs_labels else None, epsilon=args.epsilon)
        t_personalize = time.perf_counter() - t0
    btfl_info: dict | None = None
    if device.method == "BTFL":
        acc = result.details["local_head_train_accuracy"]
        btfl_info = {"local_head_train_accuracy": round(100 * acc, 2), "dle_uploaders": result.details["dle_clients"],
                     "dle_base": result.details["dle_base"]}
        what = (f"trained its local head on {len(warm)} labeled samples (train acc {100 * acc:.1f}%), uploaded its "
                f"DLE ({result.details['dle_clients']} client DLE(s) in the aggregate)")
    elif device.method == "none":
        what = "kept the received model as it is (--method none)"
    elif "skipped" in result.details:  # a rule that always keeps the received model: nothing was adapted
        what = f"did not personalise ({result.details['skipped']}; --safeguard off adapts)"
    else:
        what = f"personalised with {device.method} on {len(warm)} unlabeled samples"
    safeguard: dict | None = None
    predictor = device  # after a rollback the device predicts with the received model itself
    if result.safeguard is not None:  # label-free: decided on the warm-up window only
        print(result.safeguard.message)
        safeguard = result.safeguard.as_dict()
    print(f"{what} in {1e3 * t_personalize:.1f} ms ({result.steps} step(s)); streaming {len(xs)} samples: "
          f"{' -> '.join(PHASES)}")

    correct = np.zeros(len(xs))
    base_correct = np.zeros(len(xs))
    latency = np.zeros(len(xs))
    e = np.full(len(xs), np.nan)  # BTFL's weight of the global head per sample
    for t in range(len(xs)):  # one sample at a time, as a device sees them
        s = time.perf_counter()
        pred = int(predictor.predict(xs[t:t + 1]).argmax())
        latency[t] = 1e3 * (time.perf_counter() - s)
        if btfl_info is not None:
            e[t] = device.global_weight
        correct[t] = pred == ys[t]
        base_correct[t] = int(baseline.predict(xs[t:t + 1]).argmax()) == ys[t]
        if (t + 1) % args.print_every == 0 or t == len(xs) - 1:
            acc = rolling(correct[:t + 1], args.window)[-1]
            print(f"  [{t + 1:>4}] {PHASES[phase[t]]:<16} rolling acc {100 * acc:5.1f}%   "
                  f"latency p50 {np.median(latency[:t + 1]):.3f} ms  p99 {np.percentile(latency[:t + 1], 99):.3f} ms")

    summary = {"method": args.method, "bundle_method": bundle.method, "server": args.server,
               "dataset": bundle.manifest.get("dataset"), "client": int(data.get("client", -1)), "warmup": len(warm),
               "samples": len(xs), "download_ms": round(1e3 * t_download, 1),
               "personalize_ms": round(1e3 * t_personalize, 1),
               "latency_ms_p50": round(float(np.median(latency)), 4),
               "latency_ms_p99": round(float(np.percentile(latency, 99)), 4),
               "accuracy": {name: round(100 * float(correct[phase == k].mean()), 2) for k, name in enumerate(PHASES)},
               "accuracy_received_model": {name: round(100 * float(base_correct[phase == k].mean()), 2)
                                           for k, name in enumerate(PHASES)},
               "safeguard": safeguard, "lowered_accuracy": bool(correct.mean() < base_correct.mean()),
               "torch_imported": "torch" in sys.modules, "fl_server_imported": "fl_server" in sys.modules}
    if btfl_info is not None:
        summary["btfl"] = {**btfl_info, "mean_e": {name: round(float(e[phase == k].mean()), 4)
                                                   for k, name in enumerate(PHASES)}}
        print("BTFL mean e (weight of the global head): "
              + ", ".join(f"{k} {v:.3f}" for k, v in summary["btfl"]["mean_e"].items()))
    print("summary: " + ", ".join(f"{k} {v:.1f}%" for k, v in summary["accuracy"].items())
          + f" (received model: " + ", ".join(f"{v:.1f}%" for v in summary["accuracy_received_model"].values())
          + f"); latency p50 {summary['latency_ms_p50']:.3f} ms, p99 {summary['latency_ms_p99']:.3f} ms per sample")
    if summary["lowered_accuracy"]:  # the labelled check: never a silent loss on screen
        print(f"NOTE: personalisation LOWERED accuracy on this labelled check: {100 * correct.mean():.1f}% against "
              f"{100 * base_correct.mean():.1f}% for the received model (no label-free rule can tell on the device; "
              f"see the unseen-domain table in docs/RESULTS.md)")
    png = Path(args.png or f"runs/stream-{args.method}.png")
    title = f"{bundle.method} on {bundle.manifest.get('dataset', 'your data')}: rolling accuracy (window {args.window})"
    if save_plot(png, rolling(correct, args.window), phase, title, e if btfl_info is not None else None):
        print(f"plot: {png}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    print(f"torch imported: {summary['torch_imported']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
