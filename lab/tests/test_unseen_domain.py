"""The unseen-domain experiment (issue #39): its data (upsampled 8x8 digits, two-class new clients, the
corruptions at severities 3 and 5), a --quick smoke run through the console script, and the device SDK's
safeguard default against the committed table's validation rows."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.safeguard import EVIDENCE, SafeguardRule
from fl_server.algorithms import ALGORITHMS
from fl_server.data import load_dataset
from fl_server.data.corruptions import corrupt
from fl_server.data.domains import two_class_clients, upsampled_digits
from fl_server.data.shifts import resize

from lab.experiments import get_experiment
from lab.safeguard_choice import (HOLDOUT_FEATURES, PREVIOUS, SIMPLE_MARGIN, VARIANTS, Client, choose,
                                  meta_choice, procedure_check)
from lab.unseen import PERSONALISING, candidate_rules, summarise
from lab.unseen_report import headline
from test_lab_cli import run_lab

TABLE = Path(__file__).resolve().parents[2] / "docs" / "results" / "unseen-domain.json"
CHOICE = TABLE.with_name("safeguard-choice.json")


def test_upsampled_digits_shape_and_range() -> None:
    d = upsampled_digits()
    assert d.x.shape == (1797, 1, 28, 28) and d.x.dtype == np.float32 and d.y.shape == (1797,)
    assert d.x.min() >= 0.0 and d.x.max() <= 1.0 and d.x.max() > 0.9
    assert sorted(np.unique(d.y)) == list(range(10))
    # the same images: resized back to 8x8 they match the originals
    small = load_dataset("digits", split="all")
    back = resize(d.x, (8, 8))
    assert np.corrcoef(back.ravel(), small.x.ravel())[0, 1] > 0.95 and np.array_equal(d.y, small.y)


def test_two_class_clients() -> None:
    y = np.repeat(np.arange(10), 60)
    clients = two_class_clients(y, 8, 100, np.random.default_rng(0))
    assert len(clients) == 8
    for c in clients:
        assert len(c) == 100 and len(np.unique(c)) == 100
        labels, counts = np.unique(y[c], return_counts=True)
        assert len(labels) == 2 and counts.tolist() == [50, 50]
    with pytest.raises(ValueError, match="fewer than the 50 a client needs"):
        two_class_clients(np.repeat(np.arange(10), 40), 1, 100, np.random.default_rng(0))


def test_corruption_severities_on_mnist(mnist_all) -> None:  # type: ignore[no-untyped-def]
    x = mnist_all.x[:64]
    opts = get_experiment("unseen-domain").protocols["mnist"].options
    assert tuple(opts["severities"]) == (3, 5)
    val = (*opts["val_corruptions"], *opts["val_corruptions_added"])
    assert not set(val) & set(opts["test_corruptions"])  # validation never sees a test type
    assert len(set(val)) == len(val) == 10  # every implemented corruption no test condition uses (issue #52)
    for name in (*opts["test_corruptions"], *val):
        d3 = np.abs(corrupt(x, name, 3, 0) - x).mean()
        d5 = np.abs(corrupt(x, name, 5, 0) - x).mean()
        if name == "elastic_transform":  # the reference's affine part shrinks with severity as its warp grows
            assert 0 < d5 != d3 > 0, name
        else:
            assert 0 < d3 < d5, name  # severity 5 moves the images further than severity 3


def test_summarise_with_a_rule() -> None:
    ev = lambda d: {"disagreement": d}  # noqa: E731
    clients = [{"received": 0.9, "personalised": 0.5, "ensemble": 0.7, "evidence": ev(0.4)},
               {"received": 0.6, "personalised": 0.8, "ensemble": 0.7, "evidence": ev(0.1)}]
    s = summarise(clients, SafeguardRule("disagreement", threshold=0.2))  # the first client keeps its received model
    assert s["personalised"] == pytest.approx(65) and s["safeguard"] == pytest.approx(85)
    assert s["worse"] == 50 and s["safeguard_worse"] == 0 and s["kept"] == 50
    s = summarise(clients, SafeguardRule("disagreement", threshold=0.2, partial=True))  # the first: the mix
    assert s["safeguard"] == pytest.approx(75) and s["safeguard_worse"] == 50


def _client(condition: str, gain: float, signal: float, dataset: str = "mnist", other: float = 0.0) -> Client:
    ev = {name: 0.0 for name in (*EVIDENCE, *HOLDOUT_FEATURES)}
    ev["marginal_entropy_change"], ev["entropy_drop"] = signal, other
    return Client(dataset, condition, 0, 0.5, 0.5 + gain, ev, partial=0.5 + gain / 2)


def test_choice_is_scored_on_held_out_conditions_and_refuses_harm() -> None:
    # adaptation helps where the marginal entropy holds (signal 0) and hurts where it collapses (signal -1)
    clients = [_client(f"c{k}", g, s) for k in range(4) for g, s in ((0.1, 0.0), (-0.3, -1.0))]
    rule, table = choose(clients)
    by = {row["candidate"]: row for row in table}
    assert not by["off"]["admissible"] and by["rollback"]["val_mean_gain"] == 0.0
    assert rule.kind == "linear" and [r["candidate"] for r in table if r["chosen"]] == ["linear(margin=0)"]
    assert rule.action({**{n: 0.0 for n in EVIDENCE}, "marginal_entropy_change": -1.0}) == "received"
    assert rule.action({n: 0.0 for n in EVIDENCE}) == "personalised"
    assert all(not r["chosen"] for r in table if not r["declarable"])  # held-out rules are only compared
    # where every adaptation hurts, nothing admissible adapts: the choice rolls back
    rule, _ = choose([_client(f"c{k}", -0.2, 0.0) for k in range(4)])
    assert rule.action({**{n: 0.0 for n in EVIDENCE}, "disagreement": 0.5}) == "received"


def test_a_fitted_rule_must_carry_over_to_another_data_set_and_beat_the_simple_rules() -> None:
    # a signal that tells help from harm on mnist (marginal entropy) and another one on fashion_mnist (entropy
    # drop): a rule fitted on both separates every client, but one fitted on either data set alone harms the other
    clients = [c for k in range(4) for c in (
        _client(f"c{k}", 0.1, 0.0), _client(f"c{k}", -0.3, -1.0),
        _client(f"c{k}", 0.1, -1.0, "fashion_mnist", 1.0), _client(f"c{k}", -0.3, 0.0, "fashion_mnist", -1.0))]
    rule, table = choose(clients, **PREVIOUS)  # the earlier criterion: leave one condition out only
    assert rule.kind == "linear"
    rule, table = choose(clients)  # the declared one also fits on one data set and scores on the other
    by = {row["candidate"]: row for row in table}
    assert not by["linear(margin=0)"]["admissible"] and by["linear(margin=0)"]["val_worst_cell"] < -1
    assert rule == SafeguardRule("rollback") and by["rollback"]["chosen"]
    # a fitted rule adding less than SIMPLE_MARGIN points of mean gain over the best fixed-form rule is not declared
    small = [_client(f"c{k}", g, s) for k in range(4) for g, s in ((0.01, 0.0), (-0.03, -1.0))]
    assert max(r["val_mean_gain"] for r in choose(small, **PREVIOUS)[1]) < SIMPLE_MARGIN
    assert choose(small, **PREVIOUS)[0].kind == "linear" and choose(small)[0] == SafeguardRule("rollback")


def test_the_nested_check_scores_the_choice_on_held_out_shifts() -> None:
    """procedure_check holds out a corruption type or a data set, chooses on the rest and scores what it chose
    on the held-out cells: the rule that separates the mnist clients fails on fashion_mnist's."""
    clients = [c for k in range(2) for sev in (3, 5) for c in (
        _client(f"t{k}-{sev}", 0.1, 0.0), _client(f"t{k}-{sev}", -0.3, -1.0),
        _client(f"t{k}-{sev}", 0.1, -1.0, "fashion_mnist", 1.0),
        _client(f"t{k}-{sev}", -0.3, 0.0, "fashion_mnist", -1.0))]
    for criterion in (PREVIOUS, {}):
        check = procedure_check({"M": clients}, **criterion)
        # chosen on both data sets, a held-out corruption type loses nothing (the earlier criterion's linear rule
        # separates it, the declared one rolls back) ...
        assert check["hold out one family"]["cells"] == 8 and check["hold out one family"]["below"] == 0
        assert check["hold out one family"]["worst"][0] >= 0
        # ... chosen on one data set, neither can see the failure: every cell of the other one is lost
        assert check["hold out one dataset"]["below"] == 8 and check["hold out one dataset"]["worst"][0] == -15


def test_the_meta_rule_picks_the_criterion_with_fewest_held_out_failures() -> None:
    """meta_choice: fewest held-out cells below -1, then the best held-out mean gain, then declaration order."""
    rows = [{"variant": "a", "below": 5, "mean_gain": 2.6}, {"variant": "b", "below": 2, "mean_gain": 1.0},
            {"variant": "c", "below": 2, "mean_gain": 1.5}, {"variant": "d", "below": 2, "mean_gain": 1.5}]
    assert meta_choice(rows) == "c"  # b loses the tie on gain, d the tie on order
    assert meta_choice(rows[:2]) == "b" and meta_choice([{**rows[0], "below": 0}, *rows[1:]]) == "a"
    # the committed comparison covers every declared variant, and its criterion is the one the meta-rule picks
    choice = json.loads(CHOICE.read_text())
    assert [r["variant"] for r in choice["variants"]] == [name for name, _, _ in VARIANTS]
    assert choice["criterion"] == meta_choice(choice["variants"])


def test_declared_rules_are_the_validation_choice() -> None:
    """Every personalising method declares the rule lab.safeguard_choice chose on the committed validation
    clients (docs/results/safeguard-choice.json); the test conditions never enter the choice."""
    choice = json.loads(CHOICE.read_text())
    for method in PERSONALISING:
        assert ALGORITHMS[method].safeguard == choice["methods"][method]["rule"], method
    rows = json.loads(TABLE.read_text())
    assert {r["seeds"] for r in rows} == {3}


def test_the_safeguard_headline_is_computed_from_the_table() -> None:
    """The committed table's headline (lab.unseen_report.headline, the cells RESULTS.md states): the declared
    rules keep part of personalisation's positive gain and leave fewer cells more than a point below the received
    model than personalisation alone, their worst cell above personalisation's. The targets themselves (no cell
    below -1, 80% of the gain kept) are tracked by lab/criteria.py, which reports each as met or not."""
    h = headline(json.loads(TABLE.read_text()))
    assert h["cells"] > 100 and 0 < h["gain_kept"] <= 1.5, h
    assert h["worse_on"] < h["worse_off"] and h["worst_on"][0] > h["worst_off"][0], h


@pytest.mark.slow
def test_unseen_domain_quick(tmp_path: Path, data_root: Path) -> None:
    args = ["bench", "unseen-domain", "--quick", "--seeds", "1", "--dataset", "mnist", "--methods", "FedAvg",
            "TENT", "--results-dir", str(tmp_path / "docs" / "results"), "--runs-dir", str(tmp_path / "runs"),
            "--no-progress"]
    out = run_lab(*args, env={"FL_DATA_DIR": str(data_root)})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "docs" / "results" / "unseen-domain.json").read_text())
    by = {(r["method"], r["shift"], r["measure"], r["rule"]): r["mean"] for r in rows}
    for shift in ("clean", "digits", "gaussian_noise-5", "covariate-s5", "impulse_noise-5", "val-mean"):
        assert ("TENT", shift, "personalised", None) in by, shift
        assert {("TENT", shift, "safeguard", t) in by for t in (*candidate_rules(), "declared")} == {True}, shift
    # FedAvg does not adapt: personalised = received, nobody made worse, the safeguard never intervenes
    assert by[("FedAvg", "digits", "personalised", None)] == by[("FedAvg", "digits", "received", None)]
    assert by[("FedAvg", "digits", "worse", None)] == 0
    assert by[("FedAvg", "digits", "kept", "disagreement<=0.05")] == 0
    # the safeguard off never keeps the received model: it equals personalisation; rollback equals received
    assert by[("TENT", "digits", "safeguard", "off")] == by[("TENT", "digits", "personalised", None)]
    assert by[("TENT", "digits", "safeguard", "rollback")] == by[("TENT", "digits", "received", None)]
    # TENT and FedAvg receive the same model (TENT evaluates the FedAvg run)
    assert by[("TENT", "clean", "received", None)] == by[("FedAvg", "clean", "received", None)]
    report = run_lab("report", "--docs", str(tmp_path / "docs"))
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "docs" / "RESULTS.md").read_text()  # the compact table: method x condition
    assert "**mnist**" in text and "| method | clean | digits |" in text and "\n| TENT | " in text
    detail = (tmp_path / "docs" / "research" / "results-detail.md").read_text()  # every measure, per condition
    assert "### mnist: new clients (test)" in detail and "| digits | TENT |" in detail
