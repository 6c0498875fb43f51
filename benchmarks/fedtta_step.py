"""FedTTA-Prox / FedTTA++ compute reuse, measured against the formulations they replaced, in one run:

- the meta step (Eq. 6 + the proxy term of Eq. 13): the KL term takes f(X; psi) from the inner step's own
  forward pass (``FedTTA.adapt_step_and_logits``) instead of a second forward of psi; K clients' local steps
  under torch.func.vmap on real MNIST batches (B = 64);
- FedTTA++'s entropy early stopping on a new client's set: one forward per iterate (its entropy and, if the
  stopper goes on, its Eq. 5 step through ``torch.func.vjp``) instead of a step plus a second forward.

Parity (max |difference| of the gradients / of the returned model, float64) and the speed ratio come from the
same run, the two variants' calls alternating. Rows are merged into docs/benchmarks/fedtta-step.json by (what, device).

    python benchmarks/fedtta_step.py [--device cpu|cuda] [--repeats 5] [--data-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fl_server.algorithms import build_algorithm
from fl_server.algorithms.fedtta import FedTTA
from fl_server.recipes.presets import FEDTTA_HP
from fl_server.algorithms.losses import entropy_from_logits, kl_from_logits
from fl_server.data import load_dataset
from fl_server.torch_device import describe, pick_device
from fl_server.functional import State, tree_map
from fl_server.models import build_model

from timing import interleaved_median_ms, run_fields, sync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.rows import merge_rows  # noqa: E402

CLIENTS, BATCH, NEW_CLIENT_SAMPLES = 10, 64, 500


def meta_loss_two_forwards(alg: FedTTA, psi: State, phi: State, psi_server: State, x: torch.Tensor,
                           y: torch.Tensor) -> torch.Tensor:
    """The previous formulation: Eq. 13's f(X; psi) from a second forward pass."""
    loss = F.cross_entropy(alg.forward(alg.adapt_step(psi, phi, x), x), y)
    kl = kl_from_logits(alg.forward(psi, x), alg.forward(psi_server, x).detach())
    return loss + alg.hp.mu * kl.mean()


def early_stopping_two_forwards(alg: FedTTA, psi: State, phi: State, x: torch.Tensor) -> State:
    """The previous FedTTA++ loop: each iterate's Eq. 5 step, then a second forward for its entropy."""
    from edge_sdk import EntropyEarlyStopping

    stopper = EntropyEarlyStopping(alg.hp.patience, alg.hp.max_steps, alg.hp.first_candidate)
    best, current = psi, psi
    with torch.no_grad():
        stop = stopper.update(float(entropy_from_logits(alg.forward(psi, x)).mean()))
    while not stop:
        current = {k: v.detach() for k, v in alg.adapt_step(current, phi, x).items()}
        with torch.no_grad():
            stop = stopper.update(float(entropy_from_logits(alg.forward(current, x)).mean()))
        if stopper.best_step == len(stopper.history) - 1:
            best = current
    return best


def max_diff(a: State, b: State) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def setup(model_name: str, dtype: torch.dtype, device: torch.device, data_dir: str | None):  # type: ignore[no-untyped-def]
    data = load_dataset("mnist", root=data_dir, split="test")
    hp = {**FEDTTA_HP["mnist"]["FedTTA++"], "patience": 50, "max_steps": 20}  # 21 iterates: per-iterate cost
    alg = build_algorithm("FedTTA++", build_model(model_name, data.x.shape[1:], 10, seed=0), 1, seed=0, **hp)
    state = alg.init_state(dtype, device)
    gen = torch.Generator().manual_seed(0)
    server = {"params": tree_map(lambda t: t + 0.01 * torch.randn(t.shape, generator=gen, dtype=t.dtype).to(device),
                                 state["params"]), "phi": state["phi"]}
    x = torch.as_tensor(data.x[:CLIENTS * BATCH], dtype=dtype, device=device).reshape(CLIENTS, BATCH, *data.x.shape[1:])
    y = torch.as_tensor(data.y[:CLIENTS * BATCH], device=device).reshape(CLIENTS, BATCH)
    new_x = torch.as_tensor(data.x[-NEW_CLIENT_SAMPLES:], dtype=dtype, device=device)
    return alg, state, server, x, y, new_x


def meta_step_row(model_name: str, device: torch.device, repeats: int, data_dir: str | None) -> dict:
    grads = {}
    for name, loss in (("reused", None), ("two_forwards", meta_loss_two_forwards)):
        alg, state, server, x, y, _ = setup(model_name, torch.float64, device, data_dir)
        fn = alg.meta_loss if loss is None else (lambda *a, alg=alg, loss=loss: loss(alg, *a))
        grads[name] = torch.func.grad(fn, argnums=(0, 1))(state["params"], state["phi"], server["params"], x[0], y[0])
    diff = max(max_diff(a, b) for a, b in zip(grads["reused"], grads["two_forwards"]))
    alg, state, server, x, y, _ = setup(model_name, torch.float32, device, data_dir)
    clients = alg.client_start(state, torch.arange(CLIENTS).numpy())

    def step(loss):  # type: ignore[no-untyped-def]
        def one(c: State, s: State, xb: torch.Tensor, yb: torch.Tensor) -> State:
            g_psi, g_phi = torch.func.grad(loss, argnums=(0, 1))(c["params"], c["phi"], s["params"], xb, yb)
            return alg.apply_gradients(c, g_psi, g_phi)
        batched = torch.vmap(one, in_dims=(0, None, 0, 0))
        return lambda: (batched(clients, server, x, y), sync(device))

    ms = interleaved_median_ms({"reused": step(alg.meta_loss),
                                "two_forwards": step(lambda *a: meta_loss_two_forwards(alg, *a))}, repeats)
    return {"what": f"FedTTA-Prox/++ meta step, {model_name}", "metric": "speedup",
            "value": round(ms["two_forwards"] / ms["reused"], 3), "reused_ms": round(ms["reused"], 2),
            "two_forwards_ms": round(ms["two_forwards"], 2), "max_abs_diff_float64": diff, "clients": CLIENTS,
            "batch_size": BATCH, "mu": alg.hp.mu}


def early_stopping_row(model_name: str, device: torch.device, repeats: int, data_dir: str | None) -> dict:
    alg, state, _, _, _, new_x = setup(model_name, torch.float64, device, data_dir)
    best, stopper = alg.personalize_early_stopping(state["params"], state["phi"], new_x)
    diff = max_diff(best, early_stopping_two_forwards(alg, state["params"], state["phi"], new_x))
    alg, state, _, _, _, new_x = setup(model_name, torch.float32, device, data_dir)
    psi, phi = state["params"], state["phi"]
    ms = interleaved_median_ms(
        {"one_forward": lambda: (alg.personalize_early_stopping(psi, phi, new_x), sync(device)),
         "two_forwards": lambda: (early_stopping_two_forwards(alg, psi, phi, new_x), sync(device))}, repeats)
    return {"what": f"FedTTA++ early-stopping personalization, {model_name}", "metric": "speedup",
            "value": round(ms["two_forwards"] / ms["one_forward"], 3), "one_forward_ms": round(ms["one_forward"], 2),
            "two_forwards_ms": round(ms["two_forwards"], 2), "max_abs_diff_float64": diff,
            "iterates": len(stopper.history), "samples": NEW_CLIENT_SAMPLES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--models", nargs="+", default=["mlp", "convnet"])
    ap.add_argument("--out", default="docs/benchmarks/fedtta-step.json")
    args = ap.parse_args()
    device = pick_device(args.device)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for model_name in args.models:
        for make in (meta_step_row, early_stopping_row):
            row = {"benchmark": "fedtta-step", **make(model_name, device, args.repeats, args.data_dir),
                   **run_fields(describe(device), args.repeats)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    merge_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
