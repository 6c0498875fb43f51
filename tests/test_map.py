"""MAP / FedRS / FedPHP: restricted softmax (Eq. 8), KD (Eq. 11), HPM momentum (Eq. 10), training on real data."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fl_server.algorithms import build_algorithm
from fl_server.algorithms.map import kd_loss, restricted_softmax_logits
from fl_server.data.federated import make_federated
from fl_server.engine import RunConfig, Simulation
from fl_server.engine.simulation import run_local_steps
from fl_server.functional import index
from fl_server.models import build_model


def _algo(fashion, name="MAP", n_clients=6, **hp):  # type: ignore[no-untyped-def]
    ds = fashion.subset(np.arange(3000))
    fed = make_federated(ds, "incomplete", num_clients=n_clients, new_fraction=0.0, val_fraction=0.2, seed=0)
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    algo = build_algorithm(name, model, fed.num_train_clients, seed=0, **hp)
    return algo, fed


def _one_procedure(fashion, name="MAP", **hp):  # type: ignore[no-untyped-def]
    """4 local steps of every client from the initial global model: (client states before, after)."""
    algo, fed = _algo(fashion, name=name, local_iterations=4, **hp)
    sim = Simulation(algo, fed, RunConfig(rounds=1, local_iterations=4, progress=False))
    states = algo.client_start(sim.server_state, np.arange(fed.num_train_clients))
    batches = torch.from_numpy(np.stack([np.resize(t, (4, 32)) for t in fed.train]))
    return states, run_local_steps(algo.local_step, states, sim.server_state, sim.x, sim.y, batches, "vmap")


@pytest.mark.parametrize("mode", ["vmap", "loop"])
def test_phase_steps_equal_the_counter_steps(fashion_all, mode: str) -> None:  # type: ignore[no-untyped-def]
    """The engine's per-iteration steps (local_step_at: stage 1 without the teacher, stage 2 without the RS
    term) reproduce local_step, which reads the stage from the counter, bit for bit (MAP, MAP (code))."""
    for hp in ({}, {"kd_form": "soft_ce", "stage2_fresh_momentum": True, "stage2_lr_scale": 0.2}):
        algo, fed = _algo(fashion_all, local_iterations=6, **hp)
        sim = Simulation(algo, fed, RunConfig(rounds=1, local_iterations=6, progress=False))
        ids = np.arange(fed.num_train_clients)
        server = {**sim.server_state, "count": torch.ones_like(sim.server_state["count"]),  # an HPM to distil from
                  "hpm": {k: v + 0.01 for k, v in sim.server_state["hpm"].items()}}
        states = algo.client_start(server, ids)
        batches = torch.from_numpy(np.stack([np.resize(t, (6, 32)) for t in fed.train]))
        assert algo.local_step_at(0) is not algo.local_step_at(5)
        phased = run_local_steps(algo.local_step, states, server, sim.x, sim.y, batches, mode,
                                 step_at=algo.local_step_at)
        counter = run_local_steps(algo.local_step, states, server, sim.x, sim.y, batches, mode)
        for key in ("params", "agg", "mom"):
            for k in counter[key]:
                assert torch.equal(phased[key][k], counter[key][k]), (hp, key, k)


def test_restricted_softmax_alpha_one_is_softmax() -> None:
    logits = torch.randn(5, 10, dtype=torch.float64)
    observed = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 0, 1], dtype=torch.float64)
    assert torch.allclose(F.softmax(restricted_softmax_logits(logits, observed, 1.0), -1), F.softmax(logits, -1))
    rs = restricted_softmax_logits(logits, observed, 0.5)
    assert torch.allclose(rs[:, observed == 1], logits[:, observed == 1])
    assert torch.allclose(rs[:, observed == 0], 0.5 * logits[:, observed == 0])


def test_alpha_zero_leaves_missing_class_proxies_unchanged(fashion_all) -> None:  # type: ignore[no-untyped-def]
    algo, fed = _algo(fashion_all, alpha=0.0, weight_decay=0.0, momentum=0.0, lr=0.5)
    sim = Simulation(algo, fed, RunConfig(rounds=1, progress=False))
    ids = np.array([0])
    states = algo.client_start(sim.server_state, ids)
    idx = torch.from_numpy(fed.train[0][:64])
    step = torch.vmap(algo.local_step, in_dims=(0, None, 0, 0))
    new = step(states, sim.server_state, sim.x[idx][None], sim.y[idx][None])
    observed = algo.observed[0].bool()
    assert 0 < int(observed.sum()) < 10
    w0, w1 = states["params"]["head.weight"][0], new["params"]["head.weight"][0]
    b0, b1 = states["params"]["head.bias"][0], new["params"]["head.bias"][0]
    assert torch.equal(w0[~observed], w1[~observed]) and torch.equal(b0[~observed], b1[~observed])
    assert not torch.allclose(w0[observed], w1[observed])
    # with alpha = 1 (softmax) the same step pushes the missing proxies away
    algo.hp.alpha = 1.0
    new1 = step(states, sim.server_state, sim.x[idx][None], sim.y[idx][None])
    assert not torch.allclose(w0[~observed], new1["params"]["head.weight"][0][~observed])


def test_kd_loss_is_scaled_kl() -> None:
    s, t = torch.randn(4, 10, dtype=torch.float64), torch.randn(4, 10, dtype=torch.float64)
    pt = F.softmax(t / 4, -1)
    direct = 16 * (pt * (pt.log() - F.log_softmax(s / 4, -1))).sum(-1).mean()
    assert float(kd_loss(s, t, 4.0)) == pytest.approx(float(direct), rel=1e-12)
    assert float(kd_loss(t, t, 4.0)) == pytest.approx(0.0, abs=1e-12)


def test_hpm_moving_average_with_client_specific_momentum(fashion_all) -> None:  # type: ignore[no-untyped-def]
    algo, fed = _algo(fashion_all, expected_selections=4.0)
    sim = Simulation(algo, fed, RunConfig(rounds=1, progress=False))
    server = sim.server_state
    ids = np.array([1, 3])
    states = algo.client_start(server, ids)
    personal = {k: v + 1.0 for k, v in states["params"].items()}  # a recognisable "personalised" model
    out = algo.aggregate(server, ids, {**states, "params": personal}, torch.ones(2))
    # first selection: the HPM is the personalised model
    assert torch.allclose(index(out["hpm"], ids)["head.bias"], personal["head.bias"])
    assert torch.equal(out["count"][torch.tensor([0, 1, 3])], torch.tensor([0.0, 1.0, 1.0]))
    assert torch.equal(out["hpm"]["head.bias"][0], server["hpm"]["head.bias"][0])  # unselected: untouched
    # second selection: mu = 0.9 * 2 / 4 = 0.45
    personal2 = {k: v + 3.0 for k, v in states["params"].items()}
    out2 = algo.aggregate(out, ids, {**states, "params": personal2}, torch.ones(2))
    expect = 0.55 * personal2["head.bias"] + 0.45 * personal["head.bias"]
    assert torch.allclose(index(out2["hpm"], ids)["head.bias"], expect, atol=1e-6)
    # the uploaded model is the end of stage 1 ("agg"), not the personalised one
    assert torch.allclose(out2["params"]["head.bias"], states["agg"]["head.bias"].mean(0))


def test_two_stages_and_kd_only_with_hpm(fashion_all) -> None:  # type: ignore[no-untyped-def]
    algo, fed = _algo(fashion_all, local_iterations=4)
    sim = Simulation(algo, fed, RunConfig(rounds=1, local_iterations=4, progress=False))
    ids = np.arange(fed.num_train_clients)
    states = algo.client_start(sim.server_state, ids)
    assert float(states["kd"].sum()) == 0.0  # no HPM yet
    batches = torch.from_numpy(np.stack([np.resize(t, (4, 32)) for t in fed.train]))
    out = run_local_steps(algo.local_step, states, sim.server_state, sim.x, sim.y, batches, "vmap")
    ref = run_local_steps(algo.local_step, states, sim.server_state, sim.x, sim.y, batches, "loop")
    assert torch.allclose(out["params"]["head.weight"], ref["params"]["head.weight"], atol=1e-5)
    # agg = the model after the first 2 steps, params after all 4
    two = run_local_steps(algo.local_step, states, sim.server_state, sim.x, sim.y, batches[:, :2], "vmap")
    assert torch.allclose(out["agg"]["head.weight"], two["params"]["head.weight"], atol=1e-6)
    assert not torch.allclose(out["params"]["head.weight"], out["agg"]["head.weight"])


def test_map_personalises_above_the_global_model(fashion_all) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    algo, fed = _algo(fashion_all, n_clients=10, local_iterations=10, expected_selections=3.0)
    sim = Simulation(algo, fed, RunConfig(rounds=6, local_iterations=10, client_fraction=0.5, eval_every=6,
                                          progress=False, seed=0))
    result = sim.run()
    personal = result.best_val
    idx = np.concatenate(fed.val)
    global_acc = sim.accuracy(sim.server_state["params"], idx)
    assert personal > global_acc + 0.05  # clients see 2..10 classes: local models beat the global one
    assert float(sim.server_state["count"].sum()) == 6 * 5
    heads = algo.local_heads(sim.server_state)
    assert heads["weight"].shape == (fed.num_train_clients, 10, 200)


def test_head_only_stage2_gives_heads_on_the_global_features(fashion_all) -> None:  # type: ignore[no-untyped-def]
    """The BTFL composition: stage 2 moves only the classifier, so the personalised model = uploaded
    features + a personal head."""
    _, out = _one_procedure(fashion_all, head_only_stage2=True)
    assert torch.equal(out["params"]["features.1.weight"], out["agg"]["features.1.weight"])
    assert not torch.allclose(out["params"]["head.weight"], out["agg"]["head.weight"])


def test_map_composes_with_btfl(fashion_all) -> None:  # type: ignore[no-untyped-def]
    """MAP -> BTFL: the local head BTFL interpolates is MAP's personalised model (HPM classifier on the global
    features), and the stream trusts it more on the client's own data than on another client's."""
    from edge_sdk._btfl import BTFLStream
    from fl_server.algorithms.btfl import BTFL
    from fl_server.algorithms.compose import map_btfl_artifacts

    algo, fed = _algo(fashion_all, local_iterations=8, head_only_stage2=True)
    sim = Simulation(algo, fed, RunConfig(rounds=4, local_iterations=8, progress=False, seed=0))
    sim.run()
    state = sim.server_state
    arts = map_btfl_artifacts(algo, state, sim.x, fed.train)
    assert len(arts) == fed.num_train_clients and all(a.local_bias is not None for a in arts)
    heads = algo.local_heads(state)
    k, other = 0, 1
    xk = sim.x[torch.from_numpy(fed.val[k])]
    personalised = {**state["params"], "head.weight": heads["weight"][k], "head.bias": heads["bias"][k]}
    btfl = BTFL(algo.model)  # only its feature / global-head functions
    with torch.no_grad():
        expect = algo.forward(personalised, xk).double().numpy()
        zk = btfl.features(state["params"], xk).double().numpy()
    np.testing.assert_allclose(arts[k].local_logits(zk), expect, atol=1e-4)
    assert "local_bias" in arts[k].arrays()

    def mean_e(idx: np.ndarray) -> float:
        x = sim.x[torch.from_numpy(idx)]
        with torch.no_grad():
            z_ = btfl.features(state["params"], x)
            g_ = btfl.global_head(state["params"], z_).double().numpy()
        z_ = z_.double().numpy()
        a = arts[k]
        stream = BTFLStream(a.local_dle, a.global_dle, a.h_local_bar, a.h_global_bar)
        stream.predict(a.local_logits(z_), g_, z_)
        return float(stream.last_weights.mean())

    with pytest.raises(ValueError, match="head_only_stage2"):
        map_btfl_artifacts(_algo(fashion_all)[0], state, sim.x, fed.train)
    ind, exd = mean_e(np.concatenate([fed.train[k], fed.val[k]])), mean_e(np.concatenate([fed.train[other], fed.val[other]]))
    assert ind < exd, (ind, exd)  # e = weight of the global head: low on the client's own distribution


def test_personalised_model_is_the_updated_hpm(fashion_all) -> None:  # type: ignore[no-untyped-def]
    """Definition 2 / Algorithm 1 (psi^k <- psi_p,T+1^k): with an HPM the scored model is the HPM after one
    more client procedure, (1 - mu_k) psi_hat + mu_k psi_p, not the stage-2 model psi_hat."""
    algo, fed = _algo(fashion_all, local_iterations=4, expected_selections=4.0)
    sim = Simulation(algo, fed, RunConfig(rounds=1, local_iterations=4, progress=False))
    ids = np.arange(fed.num_train_clients)
    # clients 0, 1, 2 selected 0, 2 and 5 times so far: mu = 0 (no HPM), 0.9 * 3 / 4 and min(1, 0.9 * 6 / 4)
    count = torch.zeros(len(ids), dtype=sim.dtype)
    count[1], count[2] = 2.0, 5.0
    server = {**sim.server_state, "count": count,
              "hpm": {k: v + 0.5 for k, v in sim.server_state["hpm"].items()}}

    def trainer(step, states, srv, sel, iters, step_at=None):  # type: ignore[no-untyped-def]
        return sim.local_train(step, states, srv, sel, iters, np.random.default_rng(0), step_at)

    psi_hat = trainer(algo.local_step, algo.client_start(server, ids), server, ids, 4)["params"]["head.bias"]
    got = algo.val_params(server, ids, trainer)["head.bias"]
    hpm = server["hpm"]["head.bias"]
    assert torch.allclose(got[0], psi_hat[0], atol=1e-6)
    assert torch.allclose(got[1], 0.325 * psi_hat[1] + 0.675 * hpm[1], atol=1e-6)
    assert torch.allclose(got[2], hpm[2], atol=1e-6)
    assert float(server["count"][1]) == 2.0  # evaluation leaves the server state alone
    # without an HPM the personalised model is psi_hat itself
    algo.hp.hpm = False
    plain = trainer(algo.local_step, algo.client_start(server, ids), server, ids, 4)["params"]["head.bias"]
    assert torch.allclose(algo.val_params(server, ids, trainer)["head.bias"], plain)


def test_fedphp_uploads_the_personalised_model(fashion_all) -> None:  # type: ignore[no-untyped-def]
    """FedPHP = FedAvg + HPM (Sec. 4.2): one stage on Eq. 13, psi_hat uploaded; only MAP splits E in two."""
    states, out = _one_procedure(fashion_all, name="FedPHP")
    assert torch.equal(out["agg"]["head.weight"], out["params"]["head.weight"])
    assert not torch.allclose(out["params"]["head.weight"], states["params"]["head.weight"])


def test_authors_code_procedure_uploads_all_rs_steps_then_a_short_fresh_kd_stage(fashion_all) -> None:  # type: ignore[no-untyped-def]
    """MAP (code), the client procedure of lxcnju/MAP fedap.py: the uploaded model is the end of E epochs of
    RS (equal to FedRS after the same steps); stage 2 starts from it with zero momentum at 0.2 lr and the
    code's soft-target cross-entropy KD."""
    from fl_server.algorithms.map import MAP, authors_code_procedure, kd_soft_ce

    code = authors_code_procedure(6)
    assert (code["local_iterations"], code["stage2_steps"]) == (11, 5)  # max(int(0.1 * 6), 5) KD steps
    algo, fed = _algo(fashion_all, expected_selections=4.0, **code)
    sim = Simulation(algo, fed, RunConfig(rounds=1, local_iterations=11, progress=False))
    ids = np.arange(fed.num_train_clients)
    server = {**sim.server_state, "count": torch.ones(len(ids), dtype=sim.dtype),  # every client has an HPM
              "hpm": {k: v + 0.01 for k, v in sim.server_state["hpm"].items()}}
    states = algo.client_start(server, ids)
    batches = torch.from_numpy(np.stack([np.resize(t, (11, 32)) for t in fed.train]))
    out = run_local_steps(algo.local_step, states, server, sim.x, sim.y, batches, "vmap")
    ref = run_local_steps(algo.local_step, states, server, sim.x, sim.y, batches, "loop")
    assert torch.allclose(out["params"]["head.weight"], ref["params"]["head.weight"], atol=1e-5)
    # the upload = 6 steps of restricted softmax, exactly FedRS's model after those steps
    rs_algo, _ = _algo(fashion_all, name="FedRS", local_iterations=6)
    rs = run_local_steps(rs_algo.local_step, rs_algo.client_start(server, ids), server, sim.x, sim.y,
                         batches[:, :6], "vmap")
    assert torch.allclose(out["agg"]["head.weight"], rs["params"]["head.weight"], atol=1e-6)
    # the first stage-2 step: fresh momentum, 0.2 lr, (1 - lambda) CE + lambda soft-target CE
    seven = run_local_steps(algo.local_step, states, server, sim.x, sim.y, batches[:, :7], "loop")
    c = 0
    after6 = {k: v[c] for k, v in rs["params"].items()}
    x, y = sim.x[batches[c, 6]], sim.y[batches[c, 6]]
    teacher = algo.forward({k: v[c] for k, v in server["hpm"].items()}, x)

    def loss(p):  # type: ignore[no-untyped-def]
        logits = algo.forward(p, x)
        return 0.99 * F.cross_entropy(logits, y) + 0.01 * kd_soft_ce(logits, teacher, 4.0)

    g = torch.func.grad(loss)(after6)
    hp = algo.hp
    expect = after6["head.weight"] - 0.2 * hp.lr * (g["head.weight"] + hp.weight_decay * after6["head.weight"])
    assert torch.allclose(seven["params"]["head.weight"][c], expect, atol=1e-6)
    assert isinstance(algo, MAP) and hp.kd_form == "soft_ce"


def test_authors_code_hpm_momentum_counts_earlier_selections_and_caps_at_0_9(fashion_all) -> None:  # type: ignore[no-untyped-def]
    """fedap.py generate_mu: mu = min(0.9, 0.9 * z / (Q T)) with z the selections before this one."""
    algo, fed = _algo(fashion_all, expected_selections=4.0, mu_previous_count=True, mu_cap=0.9)
    sim = Simulation(algo, fed, RunConfig(rounds=1, progress=False))
    ids = np.array([0, 1, 2])
    count = torch.zeros(fed.num_train_clients, dtype=sim.dtype)
    count[1], count[2] = 2.0, 10.0
    hpm = {k: v + 0.5 for k, v in sim.server_state["hpm"].items()}
    server = {**sim.server_state, "count": count, "hpm": hpm}
    personal = {k: index(v, ids) + 1.0 for k, v in sim.server_state["hpm"].items()}
    out = algo.aggregate(server, ids, {**algo.client_start(server, ids), "params": personal}, torch.ones(3))
    got, old = index(out["hpm"], ids)["head.bias"], index(hpm, ids)["head.bias"]
    assert torch.allclose(got[0], personal["head.bias"][0])  # first selection: the model itself
    assert torch.allclose(got[1], 0.55 * personal["head.bias"][1] + 0.45 * old[1], atol=1e-6)  # 0.9 * 2 / 4
    assert torch.allclose(got[2], 0.1 * personal["head.bias"][2] + 0.9 * old[2], atol=1e-6)  # capped at 0.9
    with pytest.raises(ValueError, match="kd_form"):
        _algo(fashion_all, kd_form="mse")
    with pytest.raises(ValueError, match="stage2_steps=8"):
        _algo(fashion_all, local_iterations=8, stage2_steps=8)
