"""Does FedTTA++'s early-stopping rule gain anything over FedTTA-Prox's single step? A paired reading of finished rows.

FedTTA-Prox and FedTTA++ share one training (the same class, hyperparameters and per-round client RNG; on the CPU
their server states are bit-identical after every round, see ``--check-cpu``). They differ only at test time: one
step of UPFL Eq. 5 against FedTTA++'s entropy early stopping. Their validation curves in the committed raw
records (``docs/results/raw/upfl-table1/<dataset>/<method>/seedK.json``) are therefore a paired measurement of
the rule, round by round, as long as the GPU's non-deterministic kernels (and separate resumes) have not made
the two trainings drift apart. Writes a JSON summary and a figure
(validation curves of the FedTTA family, and FedTTA++ minus FedTTA-Prox); nothing here chooses a hyperparameter.

    python lab/research/fedttapp_vs_prox.py [--dataset fashion_mnist] [--check-cpu]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "edge_sdk")]
from lab.experiments import UPFL_TABLE1_PAPER  # noqa: E402
from lab.runner import safe_name  # noqa: E402

FAMILY = ("FedTTA", "FedTTA-Prox", "FedTTA++")


def load_rows(raw: Path, dataset: str) -> dict[str, dict[int, dict[str, Any]]]:
    """{method: {seed: raw record}} of the FedTTA family's finished rows."""
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for method in FAMILY:
        for path in sorted((raw / dataset / safe_name(method)).glob("seed*.json")):
            record = json.loads(path.read_text())
            rows.setdefault(method, {})[int(record["seed"])] = record
    return rows


def paired(prox: dict[str, Any], plus: dict[str, Any]) -> dict[str, Any]:
    """FedTTA++ minus FedTTA-Prox (points) at every round both validated, and at the rows' reported test."""
    a = {c["round"]: c["val"] for c in prox["curve"] if c.get("val") is not None}
    b = {c["round"]: c["val"] for c in plus["curve"] if c.get("val") is not None}
    rounds = sorted(set(a) & set(b))
    diff = np.array([100 * (b[r] - a[r]) for r in rounds])
    half = len(rounds) // 2
    return {"rounds": rounds, "val_diff": [round(float(d), 3) for d in diff],
            # medians: the first validations (an untrained base model) differ by tens of points
            "val_diff_first_half_median": round(float(np.median(diff[:half])), 3),
            "val_diff_second_half_median": round(float(np.median(diff[half:])), 3),
            "val_diff_last": round(float(diff[-1]), 3),
            "rounds_rule_below": int((diff < 0).sum()), "rounds_compared": len(rounds),
            "test_prox": prox["test"], "test_plus": plus["test"],
            "test_diff": round(plus["test"] - prox["test"], 3)}


def paper_gap(dataset: str, seed: int, rows: dict[str, dict[int, dict[str, Any]]], pair: dict[str, Any],
              devices: str, command: str, floor: float = 95.0) -> dict[str, Any]:
    """Where FedTTA++'s distance to ``floor`` sits: the shared training (each method's shortfall under its UPFL
    Table 1 row) against the rule (FedTTA++'s margin over FedTTA-Prox, ours and the paper's)."""
    paper = {(m, split): UPFL_TABLE1_PAPER[(dataset, m, split)] for m in FAMILY for split in ("test", "val")}
    margin_test = paper[("FedTTA++", "test")] - paper[("FedTTA-Prox", "test")]
    return {"what": f"FedTTA++ against {floor}, {dataset} seed {seed}", "metric": "points below the floor",
            "value": round(floor - pair["test_plus"], 2),
            **{f"shortfall_{m}": round(paper[(m, "test")] - rows[m][seed]["test"], 2)
               for m in FAMILY if seed in rows.get(m, {})},
            "paper_margin_test": round(margin_test, 2),
            "paper_margin_val": round(paper[("FedTTA++", "val")] - paper[("FedTTA-Prox", "val")], 2),
            "paper_training_our_rule": round(paper[("FedTTA-Prox", "test")] + pair["test_diff"], 2),
            "our_training_paper_margin": round(pair["test_prox"] + margin_test, 2),
            "device": devices, "command": command}


def late_gain(record: dict[str, Any], window: int = 50) -> float:
    """Validation gained (points) over the last ``window`` rounds: is training still improving at the end?"""
    curve = [c for c in record["curve"] if c.get("val") is not None]
    last = curve[-1]
    before = max((c for c in curve if c["round"] <= last["round"] - window), key=lambda c: c["round"])
    return round(100 * (last["val"] - before["val"]), 3)


def check_cpu(dataset: str, rounds: int = 3) -> float:
    """Max |difference| of the server states of FedTTA-Prox and FedTTA++ after ``rounds`` CPU rounds (10 clients)."""
    import tempfile

    from fl_server.recipes.presets import builtin_recipe
    from fl_server.recipes.run import train

    states = []
    for method in ("FedTTA-Prox", "FedTTA++"):
        run_dir = Path(tempfile.mkdtemp())
        train(builtin_recipe(dataset, method, rounds=rounds, num_clients=10, max_samples=3000), run_dir, seed=0,
              device="cpu", progress=False, checkpoint_every=1)
        states.append(np.load(run_dir / "checkpoint.npz"))
    a, b = states
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a.files if k != "__checkpoint__")


def plot(rows: dict[str, dict[int, dict[str, Any]]], pairs: dict[int, dict[str, Any]], path: Path, dataset: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    for method, colour in zip(FAMILY, ("tab:blue", "tab:orange", "tab:green")):
        for seed, record in sorted(rows.get(method, {}).items()):
            curve = [c for c in record["curve"] if c.get("val") is not None]
            top.plot([c["round"] for c in curve], [100 * c["val"] for c in curve], color=colour, lw=1,
                     label=method if seed == min(rows[method]) else None)
    top.set_ylim(70, 100)
    top.set_ylabel("validation accuracy %")
    top.legend(loc="lower right")
    top.set_title(f"UPFL Table 1, {dataset}: the FedTTA family's validation ({len(pairs)} paired seed(s))")
    for seed, pair in sorted(pairs.items()):
        bottom.plot(pair["rounds"], pair["val_diff"], lw=1, label=f"seed {seed}")
    bottom.axhline(0, color="black", lw=0.6)
    bottom.set_ylim(-5, 2)
    bottom.set_ylabel("FedTTA++ - Prox, points")
    bottom.set_xlabel("round")
    bottom.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="fashion_mnist")
    ap.add_argument("--raw", type=Path, default=REPO / "docs/results/raw/upfl-table1")
    ap.add_argument("--out", type=Path, default=REPO / "docs/results/fedttapp-vs-prox-fmnist.json")
    ap.add_argument("--figure", type=Path, default=REPO / "docs/research/fedttapp-vs-prox-fmnist.png")
    ap.add_argument("--check-cpu", action="store_true", help="also train both for 3 rounds on the CPU and compare")
    args = ap.parse_args()
    rows = load_rows(args.raw, args.dataset)
    seeds = sorted(set(rows.get("FedTTA-Prox", {})) & set(rows.get("FedTTA++", {})))
    if not seeds:
        sys.exit(f"no seed with both FedTTA-Prox and FedTTA++ rows under {args.raw / args.dataset}")
    pairs = {s: paired(rows["FedTTA-Prox"][s], rows["FedTTA++"][s]) for s in seeds}
    command = "python lab/research/fedttapp_vs_prox.py" + (" --check-cpu" if args.check_cpu else "") + \
        (f" --dataset {args.dataset}" if args.dataset != "fashion_mnist" else "")
    devices = ", ".join(sorted({r["device"] for m in rows.values() for r in m.values()}))
    # one row per seed (the report renders a list of rows; the per-round series is the figure's)
    table: list[dict[str, Any]] = [
        {"what": f"FedTTA++ - FedTTA-Prox, {args.dataset} seed {s}", "metric": "test points at the reported round",
         "value": p["test_diff"], "test_plus": round(p["test_plus"], 2), "test_prox": round(p["test_prox"], 2),
         "val_diff_last": p["val_diff_last"], "val_diff_first_half_median": p["val_diff_first_half_median"],
         "val_diff_second_half_median": p["val_diff_second_half_median"],
         "rounds_rule_below": f"{p['rounds_rule_below']}/{p['rounds_compared']}",
         "val_diff_by_round": " ".join(f"{r}:{d:+.2f}" for r, d in zip(p["rounds"], p["val_diff"])),
         "device": devices, "command": command} for s, p in pairs.items()]
    table += [paper_gap(args.dataset, s, rows, p, devices, command) for s, p in pairs.items()]
    table += [{"what": f"{m}, {args.dataset} seed {s}", "metric": "validation points gained over the last 50 rounds",
               "value": late_gain(r), "best_round": r["best_round"], "rounds": r["rounds"], "device": devices,
               "command": command} for m in FAMILY for s, r in sorted(rows.get(m, {}).items())]
    if args.check_cpu:
        table.append({"what": "FedTTA-Prox vs FedTTA++ server states, 3 CPU rounds (10 clients)",
                      "metric": "max abs difference", "value": check_cpu(args.dataset), "device": "cpu",
                      "command": command})
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    plot(rows, pairs, args.figure, args.dataset)
    for s, p in pairs.items():
        print(f"seed {s}: FedTTA++ - Prox validation, median: {p['val_diff_first_half_median']:+.2f} (first half "
              f"of the rounds), {p['val_diff_second_half_median']:+.2f} (second half), {p['val_diff_last']:+.2f} (last); "
              f"below at {p['rounds_rule_below']}/{p['rounds_compared']} rounds; test {p['test_plus']:.2f} vs "
              f"{p['test_prox']:.2f} ({p['test_diff']:+.2f})")
    for row in table[len(pairs):]:
        print(f"{row['what']}: {row['metric']} {row['value']}",
              *(f"{k}={v}" for k, v in row.items() if k.startswith(("paper", "our", "shortfall"))))
    print(f"wrote {args.out} and {args.figure}")


if __name__ == "__main__":
    main()
