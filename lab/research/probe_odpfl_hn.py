"""Diagnostic: does ODPFL-HN's hypernetwork actually personalise, and at which learning rate?

With UPFL Table 4's hn_lr = 0.5 under the pFedHN optimiser (momentum 0.9, so an effective step of 5) the
hypernetwork's ReLUs die within a few rounds: every hidden unit is zero for every client embedding, the heads
see a constant input, and f_theta(e) no longer depends on e -- the "personalised" model is one global model.
This probe decides hn_lr on *validation* only: the new clients are removed from the federation before the
run, so their data is never touched. Per hn_lr it records the training clients' validation accuracy curve,
the fraction of hypernetwork hidden units alive (non-zero for at least one training client's embedding), and
how much the generated weights vary across clients (std across clients / mean |w|, averaged over tensors), and
the embeddings likewise (std across clients / mean |e|), and the validation accuracy when every client is
served f_theta(mean embedding): the gap to the personalised accuracy is what the embedding buys.
``--set KEY=VALUE`` (JSON value) overrides any other ODPFL-HN hyperparameter for every probed hn_lr; the command
recorded with a row adds ``--set`` for each of the protocol's other ODPFL-HN rates, so it reproduces the row after
the protocol's rates change.
``--holdout-clients K`` also holds the first K training clients out of training (all their samples) and scores
the served model on them at every evaluation: a client-level validation, which sees what the per-sample
validation split of the training clients cannot, a hypernetwork that memorises the training clients.
``--experiment odpfl-dp`` probes on that experiment's own split (lab/odpfl.py): its training clients only, the
new clients' pools are never built into the run. Every row records the norms of gamma's (the encoder's) gradient
over the run's rounds (``encoder_grad_norm``: median, 90th percentile, max; spikes of it come with a client's
local step that blew up) and the round whose weights were found non-finite, if any (``diverged_round``).
``--diagnose-run DIR`` instead reads a bench run directory (run.json, checkpoint.npz, metrics.jsonl) and records
its validation curve, the same diagnostics of its last checkpoint and the classes its generated models
predict on the training clients' validation data (a one-class model shows as a single class).

    python lab/research/probe_odpfl_hn.py --dataset mnist --rounds 40 --hn-lr 0.5 0.05 0.01
    python lab/research/probe_odpfl_hn.py --experiment odpfl-dirichlet --dataset fashion_mnist-a1 --rounds 100 --device cuda
    python lab/research/probe_odpfl_hn.py --experiment odpfl-dirichlet --dataset fashion_mnist-a0.1 --rounds 100 \
        --eval-every 10 --hn-lr 0.05 --set standardize_init=true --set encoder_lr=1e-4
    python lab/research/probe_odpfl_hn.py --experiment odpfl-dp --dataset fashion_mnist --seed 1 --rounds 100 \
        --eval-every 25 --hn-lr 0.05
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from fl_server.algorithms import build_algorithm
from fl_server.algorithms.odpfl_hn import ODPFLHN
from fl_server.data.federated import hold_out_validation_clients
from fl_server.torch_device import describe
from fl_server.engine import RunConfig
from fl_server.engine.simulation import Simulation
from fl_server.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: lab/ is not installed
from lab.experiments import get_experiment  # noqa: E402
from lab.rows import merge_rows  # noqa: E402
from lab.odpfl import protocol_dp_split  # noqa: E402
from lab.runner import build_federated  # noqa: E402


@torch.no_grad()
def hypernet_diagnostics(sim: Simulation, alg: ODPFLHN) -> dict:
    """Alive hidden units of f_theta over the training clients' embeddings, the spread of the generated
    weights across clients (0 = the hypernetwork ignores the embedding), and validation accuracy when all
    clients get the model of the mean embedding."""
    state = sim.server_state
    emb = alg.embed_clients(state["enc"], np.arange(sim.fed.num_train_clients))
    mean_model = alg.generate(state["hn"], emb.mean(0))
    val_mean = float(np.mean([sim.accuracy(mean_model, v) for v in sim.fed.val]))
    h, alive = emb, []
    body = list(alg.hypernet.body)
    hn = state["hn"]
    for k in range(0, len(body), 2):  # (Linear, ReLU) pairs
        h = torch.relu(h @ hn[f"body.{k}.weight"].T + hn[f"body.{k}.bias"])
        alive.append(float((h > 0).any(0).float().mean()))
    w = alg.generate(hn, emb)
    spread = [float(v.std(0).mean() / v.abs().mean().clamp_min(1e-12)) for v in w.values()]
    # the same ratio for the embeddings: near 0 means the encoder does not tell the clients apart either
    e_spread = float(emb.std(0).mean() / emb.abs().mean().clamp_min(1e-12))
    return {"val_with_mean_embedding": round(100 * val_mean, 2),
            "alive_fraction_per_layer": [round(a, 3) for a in alive],
            "weight_spread_across_clients": round(float(np.mean(spread)), 4),
            "embedding_spread_across_clients": round(e_spread, 4)}


def record_encoder_grad_norms(alg: ODPFLHN) -> list[float]:
    """A list that fills with the global norm of gamma's gradient at every server step of ``alg``."""
    norms: list[float] = []
    server_update = alg.server_update

    def recording(server_state: dict, grad_theta: dict, grad_gamma: dict) -> dict:
        norms.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grad_gamma.values()))))
        return server_update(server_state, grad_theta, grad_gamma)

    alg.server_update = recording  # type: ignore[method-assign]
    return norms


def grad_norm_summary(norms: list[float]) -> dict[str, float]:
    """Median, 90th percentile and max of the finite norms, and how many steps there were."""
    finite = np.asarray([n for n in norms if np.isfinite(n)])
    if not len(finite):
        return {"steps": len(norms)}
    p50, p90 = np.percentile(finite, [50, 90])
    return {"steps": len(norms), "p50": round(float(p50), 2), "p90": round(float(p90), 2),
            "max": round(float(finite.max()), 2)}


def diagnose_run(run_dir: Path, args: argparse.Namespace, command: str) -> None:
    """One row for a bench run directory: validation curve, diagnostics and predicted classes at its checkpoint."""
    from lab.runner import build_simulation
    from fl_server.engine.simulation import complete_rows, checkpoint_meta, load_state

    run = json.loads((run_dir / "run.json").read_text())
    protocol = get_experiment(args.experiment).protocols[args.dataset]
    if (protocol.dataset, protocol.model) != (run["dataset"], run["model"]):
        raise SystemExit(f"error: {run_dir} is a {run['dataset']}/{run['model']} run; --experiment {args.experiment} "
                         f"--dataset {args.dataset} is {protocol.dataset}/{protocol.model}")
    protocol = dataclasses.replace(protocol, method_hp={**protocol.method_hp, run["method"]: run["hyper"]})
    sim = build_simulation(protocol, run["method"], run["seed"], None, device=args.device, progress=False)
    sim.server_state = load_state(run_dir / "checkpoint.npz", sim.device)
    alg = sim.algorithm
    assert isinstance(alg, ODPFLHN)
    meta = checkpoint_meta(run_dir / "checkpoint.npz") or {}
    done = meta.get("rounds_done", 0)  # rows past the checkpoint belong to rounds it does not hold
    metrics = [r for r in complete_rows((run_dir / "metrics.jsonl").read_text()) if r["round"] < done]
    emb = alg.embed_clients(sim.server_state["enc"], np.arange(sim.fed.num_train_clients))
    predicted = torch.zeros(sim.fed.dataset.num_classes, dtype=torch.long)
    for k, idx in enumerate(sim.fed.val):
        pred = sim._logits(alg.generate(sim.server_state["hn"], emb[k]), idx).argmax(-1).cpu()
        predicted += torch.bincount(pred, minlength=len(predicted))
    hp = {k: run["hyper"][k] for k in ("local_lr", "encoder_lr", "hn_lr")}
    row = {"what": f"ODPFL-HN {args.experiment} {args.dataset} seed {run['seed']}: run diagnosis after "
                   f"{meta.get('rounds_done')} rounds, hn_lr {hp['hn_lr']}",
           "experiment": args.experiment, "variant": "run diagnosis", "metric": "best val accuracy %",
           "value": round(100 * meta.get("best_val", float("nan")), 2), "dataset": args.dataset,
           "seed": run["seed"], "hn_lr": hp["hn_lr"], "rounds": meta.get("rounds_done"),
           "best_round": meta.get("best_round"),
           "val_curve": [round(100 * r["val"], 2) for r in metrics if r.get("val") is not None],
           **hypernet_diagnostics(sim, alg), "predicted_class_counts_on_val": predicted.tolist(), "hyper": hp,
           "device": describe(sim.device), "command": command}
    print(row, flush=True)
    merge_rows(args.out, [row], key=("experiment", "dataset", "seed", "hn_lr", "rounds", "variant"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="upfl-table1", help="whose protocol (and ODPFL-HN rates) to probe")
    ap.add_argument("--dataset", default="mnist", help="the experiment's protocol key")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--hn-lr", type=float, nargs="+", default=[0.5, 0.05, 0.01])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override an ODPFL-HN hyperparameter (JSON value), e.g. standardize_init=true")
    ap.add_argument("--holdout-clients", type=int, default=0, metavar="K",
                    help="hold out K training clients as validation clients (scored like new clients)")
    ap.add_argument("--out", default="docs/results/odpfl-hn-probe.json",
                    help="rows merged by (experiment, dataset, seed, hn_lr, rounds, variant)")
    ap.add_argument("--diagnose-run", type=Path, metavar="DIR",
                    help="diagnose a bench run directory (its run.json, checkpoint.npz, metrics.jsonl) instead")
    args = ap.parse_args()
    command = "python lab/research/probe_odpfl_hn.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.diagnose_run is not None:
        torch.set_num_threads(1)
        diagnose_run(args.diagnose_run, args, command)
        return
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    variant = " ".join([f"{k}={json.dumps(v)}" for k, v in sorted(overrides.items())]
                       + ([f"holdout_clients={args.holdout_clients}"] if args.holdout_clients else [])) or None
    torch.set_num_threads(1)
    protocol = get_experiment(args.experiment).protocols[args.dataset]
    # the recorded command pins the protocol's other ODPFL-HN rates with --set, so that it still reproduces the
    # row after the protocol's rates change
    base = {k: v for k, v in protocol.method_hp["ODPFL-HN"].items() if k not in overrides and k != "hn_lr"}
    command += "".join(f" --set {shlex.quote(f'{k}={json.dumps(v)}')}" for k, v in sorted(base.items()))
    # the probe holds clients out itself (--holdout-clients), not through the protocol's validation clients
    protocol = dataclasses.replace(protocol, options={k: v for k, v in protocol.options.items() if k != "val_clients"})
    fed = (protocol_dp_split(protocol, args.seed).fed if args.experiment == "odpfl-dp"
           else build_federated(protocol, args.seed))
    fed = dataclasses.replace(fed, new=[])  # validation only: the new clients' data is never read
    if k := args.holdout_clients:  # held-out clients scored as "new" next to the per-sample validation curve
        held = hold_out_validation_clients(fed, k)
        fed = dataclasses.replace(held, new=held.val_clients, val_clients=[])
    rows = []
    for lr in args.hn_lr:
        model = build_model(protocol.model, fed.dataset.x.shape[1:], fed.dataset.num_classes, seed=args.seed)
        hp = {**protocol.method_hp["ODPFL-HN"], **overrides, "hn_lr": lr}
        alg = build_algorithm("ODPFL-HN", model, fed.num_train_clients, seed=args.seed, **hp)
        cfg = RunConfig(rounds=args.rounds, local_iterations=protocol.local_iterations,
                        batch_size=protocol.batch_size, client_fraction=protocol.client_fraction,
                        eval_every=args.eval_every, seed=args.seed, device=args.device, progress=False)
        sim = Simulation(alg, fed, cfg)
        grad_norms = record_encoder_grad_norms(alg)
        res = sim.run()
        diag = hypernet_diagnostics(sim, alg)
        curve = [round(100 * r["val"], 2) for r in res.history if "val" in r]
        if args.holdout_clients:
            diag["heldout_client_curve"] = [round(100 * r["test"], 2) for r in res.history if "val" in r]
        print(f"hn_lr {lr}: val curve {curve}  {diag}  ({res.wall_s:.0f} s)", flush=True)
        rows.append({"what": f"ODPFL-HN {args.experiment} {args.dataset} seed {args.seed}: hn_lr {lr}, "
                             f"{args.rounds} rounds" + (f", {variant}" if variant else ""),
                     "experiment": args.experiment, "variant": variant,
                     "metric": "best val accuracy %", "value": round(100 * res.best_val, 2),
                     "dataset": args.dataset, "seed": args.seed, "hn_lr": lr, "rounds": args.rounds,
                     "best_round": res.best_round, "val_curve": curve, **diag,
                     "encoder_grad_norm": grad_norm_summary(grad_norms), "diverged_round": res.diverged_round,
                     "hyper": hp,
                     "wall_s": round(res.wall_s, 1), "device": describe(sim.device), "command": command})
        rows[-1] = {k: None if isinstance(v, float) and not np.isfinite(v) else v for k, v in rows[-1].items()}
        merge_rows(args.out, rows, key=("experiment", "dataset", "seed", "hn_lr", "rounds", "variant"))


if __name__ == "__main__":
    main()
