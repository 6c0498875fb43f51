"""TENT on a batch-normalised ResNet-8 (``resnet8_bn``) against the received model, on covariate-shifted
Fashion-MNIST new clients (issue #34).

Per seed: a Dir(0.5) split of Fashion-MNIST into training and new clients (half each); FedAvg (clients' local
SGD steps vmapped, weighted by train size) with batch statistics; the federated population statistics of the final
weights (``fl_server.models.norm.client_statistics``); then every new client's data, clean and under each test
corruption at severity 3, is predicted by
- ``received``: the final global model with the population statistics (the frozen device forward);
- ``BN stats``: the same weights normalising each batch of 64 with its own statistics (no gradient step);
- ``TENT``: the original TENT -- per batch of 64 in the client's order, one SGD step on the mean prediction entropy
  over the normalisation affine parameters with the batch's statistics, then that batch is predicted (online).
TENT's rate is chosen per seed on the training clients' validation data under the validation corruptions
(types not used for testing). Numbers are accuracy in percent, the mean over new clients.

    python lab/research/bn_tent_shift.py --seeds 3 --workers 3 --out docs/results/bn-tent-shift.json
    python lab/research/bn_tent_shift.py --smoke        # seconds: the CI size
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_server.algorithms import build_algorithm
from fl_server.data import load_dataset
from fl_server.data.corruptions import corrupt
from fl_server.data.federated import make_federated
from fl_server.functional import broadcast, get_params, make_forward, sgd, weighted_mean
from fl_server.models import build_model
from fl_server.models.norm import client_statistics, norm_mode

TEST_CORRUPTIONS = ("gaussian_noise", "defocus_blur", "contrast", "fog")
VAL_CORRUPTIONS = ("shot_noise", "motion_blur")
TENT_LRS = (0.1, 1.0, 10.0)


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, clients: list[np.ndarray], rounds: int,
          steps: int, batch: int, lr: float, seed: int) -> dict[str, torch.Tensor]:
    """FedAvg: every client runs ``steps`` local SGD steps per round (vmapped), the server averages by size."""
    forward = make_forward(model)
    rng = np.random.default_rng([seed, 1])
    sizes = torch.tensor([len(c) for c in clients], dtype=torch.float32)

    def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(forward(p, xb), yb)

    step = torch.func.vmap(torch.func.grad(loss))
    params = get_params(model)
    for _ in range(rounds):
        local = broadcast(params, len(clients))
        for _ in range(steps):
            idx = torch.from_numpy(np.stack([rng.choice(c, batch, replace=len(c) < batch) for c in clients]))
            local = sgd(local, step(local, x[idx], y[idx]), lr)
        params = weighted_mean(local, sizes)
    return params


def accuracy(model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
             how: str, tent: Any = None) -> float:
    """Accuracy (%) of one client's data predicted in batches of 64 (``how``: received / BN stats / TENT)."""
    forward = make_forward(model)
    correct = 0
    with norm_mode(model, "population" if how == "received" else "batch"):
        for s in range(0, len(x), 64):
            xb = x[s:s + 64]
            if how == "TENT":
                params = tent.entropy_step(params, xb)  # online: the step, then this batch's prediction
            with torch.no_grad():
                correct += int((forward(params, xb).argmax(1) == y[s:s + 64]).sum())
    return 100.0 * correct / len(x)


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    data = load_dataset("fashion_mnist", split="all")
    fed = make_federated(data, "dirichlet", 2 * args.clients, new_fraction=0.5, val_fraction=0.15, seed=seed,
                         alpha=0.5)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y).long()
    model = build_model("resnet8_bn", data.x.shape[1:], data.num_classes, seed=seed)
    t0 = time.perf_counter()
    params = train(model, x, y, fed.train, args.rounds, args.local_steps, 32, args.lr, seed)
    forward = make_forward(model)
    client_statistics(model, lambda xb: forward(params, xb),
                      [[x[torch.from_numpy(t[i:i + 256])] for i in range(0, min(len(t), args.cap), 256)]
                       for t in fed.train])  # federated statistics, set on the model
    train_s = time.perf_counter() - t0

    def mean_accuracy(sets: list[np.ndarray], how: str, shift: str, tent: Any = None) -> float:
        out = []
        for j, idx in enumerate(sets):
            idx = idx[:args.cap]
            xs = data.x[idx] if shift == "clean" else corrupt(data.x[idx], shift, 3, [seed, j, len(shift)])
            out.append(accuracy(model, params, torch.from_numpy(xs), y[torch.from_numpy(idx)], how, tent))
        return float(np.mean(out))

    def tent_with(lr: float) -> Any:
        return build_algorithm("TENT", model, 1, seed=seed, adapt="norm_affine", tent_lr=lr, batch_size=64)

    val = {lr: float(np.mean([mean_accuracy(fed.val, "TENT", c, tent_with(lr)) for c in VAL_CORRUPTIONS]))
           for lr in args.tent_lrs}
    lr = max(val, key=lambda k: val[k])
    rows = []
    for shift in ("clean", *args.corruptions):
        for how in ("received", "BN stats", "TENT"):
            rows.append({"shift": shift, "method": how,
                         "value": round(mean_accuracy(fed.new, how, shift, tent_with(lr)), 3)})
    shifted = [r for r in rows if r["shift"] != "clean"]
    covariate = {how: round(float(np.mean([r["value"] for r in shifted if r["method"] == how])), 3)
                 for how in ("received", "BN stats", "TENT")}
    return {"seed": seed, "tent_lr": lr, "tent_lr_val": val, "results": rows, "covariate_mean": covariate,
            "train_s": round(train_s, 1), "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--clients", type=int, default=10, help="training clients (as many new clients)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--cap", type=int, default=128, help="samples per client used for statistics and evaluation")
    p.add_argument("--workers", type=int, default=1, help="seeds run in this many processes (one thread each)")
    p.add_argument("--smoke", action="store_true", help="CI size: 1 seed, 2 rounds, 2 clients, one corruption")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    args.corruptions, args.tent_lrs = TEST_CORRUPTIONS, TENT_LRS
    if args.smoke:
        args.seeds, args.clients, args.rounds, args.local_steps, args.cap = 1, 2, 2, 2, 64
        args.corruptions, args.tent_lrs = TEST_CORRUPTIONS[:1], TENT_LRS[:2]
    torch.set_num_threads(1)
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            seeds = list(pool.map(run_seed, range(args.seeds), [args] * args.seeds))
    else:
        seeds = [run_seed(s, args) for s in range(args.seeds)]
    summary = {how: {"mean": round(float(np.mean([s["covariate_mean"][how] for s in seeds])), 3),
                     "per_seed": [s["covariate_mean"][how] for s in seeds]} for how in ("received", "BN stats", "TENT")}
    record = {"experiment": "bn-tent-shift", "model": "resnet8_bn", "dataset": "fashion_mnist",
              "device": f"cpu: 1 thread ({platform.processor() or platform.machine()})",
              "command": "python lab/research/bn_tent_shift.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "covariate_mean_over_seeds": summary, "seeds": seeds}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(summary, indent=1))
    return record


if __name__ == "__main__":
    main()
