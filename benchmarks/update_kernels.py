"""The weight update of K stacked clients: the composed element-wise form that MAP's step and
``functional.sgd`` used before (one kernel per operator) against the fused ``torch.add(..., alpha=)`` form
they use now, on the MAP protocol's MLP 2x512 (Fashion-MNIST, 669,706 weights per client) for K = 20
(Q = 0.2 of 100 clients: a training round) and K = 100 (MAP's personalisation pass). Both forms run in the
same process, vmapped as in the engine; rows merge into docs/benchmarks/update-kernels.json by (what, device).

    python benchmarks/update_kernels.py [--device cpu|cuda] [--repeats 20]

The two forms agree to float32 rounding (max abs difference reported). ``grad_ms`` times the forward and
backward of the same step (batch 64, cross-entropy), so ``update_share_*`` is the update's share of a step.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import torch

from fl_server.torch_device import describe, pick_device
from fl_server.functional import get_params
from fl_server.models import build_model
from timing import median_ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: lab/ is not installed
from lab.rows import merge_rows  # noqa: E402

LR, WD, M = 0.03, 1e-5, 0.9  # MAP Sec. 5


def composed(p: dict, g: dict, b: dict, agg: dict, stage1: torch.Tensor) -> tuple[dict, dict, dict]:
    """The previous formulation of MAP's step (momentum SGD + stage-1 snapshot), one kernel per operator."""
    mom = {k: M * b[k] + g[k] + WD * p[k] for k in p}
    new = {k: p[k] - LR * 1.0 * mom[k] for k in p}
    return new, mom, {k: stage1 * new[k] + (1 - stage1) * agg[k] for k in p}


def fused(p: dict, g: dict, b: dict, agg: dict, stage1: torch.Tensor) -> tuple[dict, dict, dict]:
    """The current formulation (fl_server/algorithms/map.py)."""
    mom = {k: torch.add(g[k], p[k], alpha=WD).add_(b[k], alpha=M) for k in p}
    new = {k: torch.add(p[k], mom[k], alpha=-LR) for k in p}
    return new, mom, {k: torch.lerp(agg[k], new[k], stage1) for k in p}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="docs/benchmarks/update-kernels.json")
    args = ap.parse_args()
    device = pick_device(args.device)
    params = get_params(build_model("mlp_2x512", (1, 28, 28), 10, seed=0), torch.float32, device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for k in (20, 100):
        def stacked() -> dict:
            return {n: torch.randn((k, *t.shape), generator=gen, device=device) for n, t in params.items()}

        p, g, b, agg = stacked(), stacked(), stacked(), stacked()
        stage1 = (torch.arange(k, device=device) % 2).float()  # half the clients still in stage 1
        ref, out = torch.vmap(composed)(p, g, b, agg, stage1), torch.vmap(fused)(p, g, b, agg, stage1)
        diff = max(float((x[n] - y[n]).abs().max()) for x, y in zip(ref, out) for n in params)
        x = torch.randn((k, 64, 1, 28, 28), generator=gen, device=device)
        y = torch.randint(0, 10, (k, 64), generator=gen, device=device)
        model = build_model("mlp_2x512", (1, 28, 28), 10, seed=0).to(device)

        def loss(w: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(torch.func.functional_call(model, w, (xb,)), yb)

        grad_step = torch.vmap(torch.func.grad(loss))

        def grad_call() -> None:
            grad_step(p, x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()

        times = {"grad": median_ms(grad_call, args.repeats)}  # the forward/backward of the same step
        for name, fn in (("composed", composed), ("fused", fused)):
            step = torch.vmap(fn)

            def call() -> None:
                step(p, g, b, agg, stage1)
                if device.type == "cuda":
                    torch.cuda.synchronize()

            times[name] = median_ms(call, args.repeats)
        row = {"benchmark": "update-kernels", "what": f"MAP weight update, MLP 2x512, K={k} clients",
               "metric": "speedup", "value": round(times["composed"] / times["fused"], 2),
               "composed_ms": round(times["composed"], 2), "fused_ms": round(times["fused"], 2),
               "grad_ms": round(times["grad"], 2),  # share of a step: update / (grad + update)
               "update_share_composed": round(times["composed"] / (times["grad"] + times["composed"]), 3),
               "update_share_fused": round(times["fused"] / (times["grad"] + times["fused"]), 3),
               "max_abs_diff": diff, "device": describe(device), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "load_average_1min": round(os.getloadavg()[0], 1),
               "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)}
        rows.append(row)
        print(json.dumps(row))
    merge_rows(args.out, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
