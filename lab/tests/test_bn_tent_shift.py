"""lab/research/bn_tent_shift.py (the docs/results/bn-tent-shift.json experiment) at its CI size."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def test_bn_tent_shift_script_smoke(fashion_all) -> None:  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[1] / "research" / "bn_tent_shift.py"
    spec = importlib.util.spec_from_file_location("bn_tent_shift", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    record = module.main(["--smoke"])
    seed = record["seeds"][0]
    assert seed["tent_lr"] in seed["tent_lr_val"]
    assert {(r["shift"], r["method"]) for r in seed["results"]} == {
        (s, m) for s in ("clean", "gaussian_noise") for m in ("received", "BN stats", "TENT")}
    assert all(0.0 <= r["value"] <= 100.0 for r in seed["results"])
