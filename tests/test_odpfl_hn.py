"""ODPFL-HN (SPEC.md section 2): DP noise scale (Sec. 7), embedding-only requests, the pFedHN chain rule,
set-order invariance of the encoder, and a short real-MNIST run that beats the round-0 model."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from edge_sdk import _dp as dp
from fl_server.algorithms import ALGORITHMS, build_algorithm
from fl_server.algorithms.odpfl_hn import ODPFLHN
from fl_server.recipes.presets import ODPFL_HP
from fl_server.data.federated import make_federated
from fl_server.engine import RunConfig, Simulation
from fl_server.functional import tree_map
from fl_server.models import build_model


def _mnist_alg(**hp):  # type: ignore[no-untyped-def]
    alg = build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), 1, seed=0, **hp)
    return alg, alg.init_state(torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def mnist_fed(mnist_all):  # type: ignore[no-untyped-def]
    sub = mnist_all.subset(np.random.default_rng(1).choice(len(mnist_all), 14_000, replace=False))
    return make_federated(sub, "pathological", 40, seed=0)


@pytest.fixture(scope="module")
def client_x(mnist_fed) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.from_numpy(mnist_fed.dataset.x[mnist_fed.new[0]]).float()


# ------------------------------------------------------------------- DP (Sec. 7)
def test_gaussian_sigma_is_the_analytic_mechanism_for_lemma_2s_sensitivity() -> None:
    eps, delta, n = 0.3, 0.01, 3000
    sens = 2 * 1.0 * 1.0 / n  # Lemma 2: 2 L B / |D|
    assert dp.sensitivity(n) == pytest.approx(sens)
    assert dp.gaussian_sigma(eps, delta, n) == pytest.approx(dp.analytic_gaussian_sigma(eps, delta, sens))
    # below the paper's classic calibration sqrt(2 ln(1.25/delta)) Delta / eps (Sec. 7), which is loose at eps < 1
    assert dp.gaussian_sigma(eps, delta, n) < math.sqrt(2 * sens ** 2 * math.log(1.25 / delta)) / eps
    assert dp.gaussian_sigma(eps, delta, n, bound=2.0, lipschitz=3.0) == pytest.approx(6 * dp.gaussian_sigma(eps, delta, n))
    assert dp.gaussian_sigma(eps, delta, 100) == pytest.approx(30 * dp.gaussian_sigma(eps, delta, 3000))  # ~ 1/|D|
    assert dp.gaussian_sigma(math.inf, delta, n) == 0.0
    e = np.arange(4.0)
    assert np.array_equal(dp.privatize_embedding(e, math.inf, delta, n, np.random.default_rng(0)), e)
    for bad in ({"epsilon": 0.0}, {"epsilon": -1.0}, {"delta": 0.0}, {"delta": 1.0}, {"set_size": 0}):
        args = {"epsilon": eps, "delta": delta, "set_size": n} | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            dp.gaussian_sigma(**args)
    rows = dp.unit_sphere(np.array([[3.0, 4.0], [0.0, 0.0]]))
    assert np.allclose(rows, [[0.6, 0.8], [0.0, 0.0]])


def test_personalize_noise_uses_the_clients_own_set_size(client_x: torch.Tensor) -> None:
    alg, state = _mnist_alg(dp=True, dp_epsilon=0.3, dp_delta=0.01)
    enc = state["enc"]
    # the DP encoder's per-sample outputs lie on the unit sphere, exactly as edge_sdk._dp.unit_sphere puts them
    with torch.no_grad():
        raw = alg.encoder.phi(alg.encoder.trunk(client_x[:50]))
        h = alg.encoder.per_sample(client_x[:50])
    assert np.allclose(h.double().numpy(), dp.unit_sphere(raw.double().numpy()), atol=1e-6)
    for n in (40, len(client_x)):
        x = client_x[:n]
        with torch.no_grad():  # the pooled vector: mean of the unit-sphere per-sample outputs (B = 1)
            pooled = alg.encoder.per_sample(x).mean(0).double()
        assert float(pooled.norm()) <= 1.0 + 1e-6
        alg.dp_rng = np.random.default_rng(5)
        w = alg.personalize(state, x)
        sigma = dp.analytic_gaussian_sigma(0.3, 0.01, 2 / n)  # sensitivity 2 B / |D| with the own |D|
        noisy = pooled + torch.from_numpy(np.random.default_rng(5).normal(0.0, sigma, pooled.shape))
        e = noisy @ enc["psi.weight"].double().T + enc["psi.bias"].double()  # psi: post-processing
        expect = alg.generate(state["hn"], e.float())
        for k in w:
            assert torch.allclose(w[k], expect[k], atol=1e-5)
    # eps = inf: no noise
    alg_inf, _ = _mnist_alg(dp=True)
    for k, v in alg_inf.personalize(state, client_x).items():
        assert torch.equal(v, alg_inf.generate(state["hn"], alg_inf.encode(enc, client_x))[k])
    with pytest.raises(ValueError, match="dp=True"):
        _mnist_alg(dp_epsilon=1.0)


# ------------------------------------------------------ inference request data
def test_new_client_sends_only_the_embedding(client_x: torch.Tensor) -> None:
    alg, state = _mnist_alg()
    e = alg.encode(state["enc"], client_x)
    assert e.shape == (alg.hp.embed_dim,) == (32,)
    w = alg.generate(state["hn"], e)  # the server needs nothing but e
    assert {k: tuple(v.shape) for k, v in w.items()} == \
        {k: tuple(p.shape) for k, p in alg.model.named_parameters()}
    for k, v in alg.personalize(state, client_x).items():
        assert torch.equal(v, w[k])
    assert alg.predict(w, client_x[:5]).shape == (5, 10)
    batched = alg.generate(state["hn"], torch.stack([e, 2 * e]))
    assert all(torch.allclose(batched[k][0], w[k], atol=1e-6) for k in w)


@pytest.mark.parametrize("use_dp", [False, True])
def test_embedding_is_invariant_to_sample_order(client_x: torch.Tensor, use_dp: bool) -> None:
    alg, state = _mnist_alg(dp=use_dp)
    perm = torch.from_numpy(np.random.default_rng(0).permutation(len(client_x)))
    e1, e2 = alg.encode(state["enc"], client_x), alg.encode(state["enc"], client_x[perm])
    assert torch.allclose(e1, e2, atol=1e-5)
    assert not torch.allclose(e1, alg.encode(state["enc"], client_x[: len(client_x) // 3]), atol=1e-3)


# ------------------------------------------------------------------- chain rule
def test_chain_rule_matches_a_separate_autograd_pass() -> None:
    alg = ODPFLHN(build_model("mlp", (1, 4, 4), 3, seed=0), seed=0, encoder_model="mlp", embed_dim=5,
                  hn_width=7, set_width=6)
    state = alg.init_state(torch.float64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    xs = [torch.rand(n, 1, 4, 4, generator=gen, dtype=torch.float64) for n in (9, 4, 13)]
    coef = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    emb = torch.stack([alg.encode(state["enc"], x) for x in xs])
    delta = {k: torch.randn((3, *v.shape), generator=gen, dtype=torch.float64) for k, v in state["params"].items()}

    g_theta, g_e = alg.hypernet_backprop(state["hn"], emb, delta, coef)
    g_gamma = [alg.encoder_backprop(state["enc"], x, g_e[k]) for k, x in enumerate(xs)]
    g_gamma_sum = {n: sum(g[n] for g in g_gamma) for n in g_gamma[0]}

    def surrogate(theta, gamma):  # type: ignore[no-untyped-def]
        # sum_k coef_k < w(theta, e_k(gamma)), -Delta w_k >: its gradient is the pFedHN update direction
        total = torch.zeros((), dtype=torch.float64)
        for k, x in enumerate(xs):
            w = alg.hn_fn(theta, alg.enc_fn(gamma, x))
            total = total + coef[k] * sum((w[n] * -delta[n][k]).sum() for n in w)
        return total

    ref_theta, ref_gamma = torch.func.grad(surrogate, argnums=(0, 1))(state["hn"], state["enc"])
    for n in ref_theta:
        assert torch.allclose(g_theta[n], ref_theta[n], rtol=1e-10, atol=1e-12), n
    for n in ref_gamma:
        assert torch.allclose(g_gamma_sum[n], ref_gamma[n], rtol=1e-10, atol=1e-12), n
    assert sum(float(v.abs().sum()) for v in g_gamma_sum.values()) > 0

    # server_update: clip 50, weight decay 1e-3, momentum 0.9 (torch.optim.SGD semantics)
    new = alg.server_update(state, g_theta, g_gamma_sum)
    ref = {n: torch.nn.Parameter(v.clone()) for n, v in state["hn"].items()}
    opt = torch.optim.SGD(ref.values(), lr=alg.hp.hn_lr, momentum=0.9, weight_decay=1e-3)
    for n, p in ref.items():
        p.grad = g_theta[n].clone()
    torch.nn.utils.clip_grad_norm_(ref.values(), 50.0)
    opt.step()
    for n, p in ref.items():
        assert torch.allclose(new["hn"][n], p.detach(), atol=1e-6 * max(1.0, float(p.detach().abs().max()))), n
    for n, v in state["enc"].items():
        assert torch.allclose(new["enc"][n], v - alg.hp.encoder_lr * g_gamma_sum[n])


@pytest.mark.parametrize("dp", [False, True])
# one concatenated pass; passes split on client boundaries; one pass per client (the CPU default)
@pytest.mark.parametrize("chunk", [8192, 20, 0])
def test_concatenated_encoder_passes_equal_one_pass_per_client(dp: bool, chunk: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """embed_clients and clients_encoder_backprop encode several clients' sets in one pass (segment pooling):
    the same embeddings and the same summed ClientBackprop as one encoder pass per client."""
    import fl_server.algorithms.odpfl_hn as odpfl_module
    monkeypatch.setitem(odpfl_module.ENCODE_CHUNK_SAMPLES, "cpu", chunk)
    alg = ODPFLHN(build_model("mlp", (1, 4, 4), 3, seed=0), seed=0, encoder_model="mlp", embed_dim=5,
                  hn_width=7, set_width=6, dp=dp)
    state = alg.init_state(torch.float64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(60, 1, 4, 4, generator=gen, dtype=torch.float64)
    perm = np.random.default_rng(0).permutation(60)
    train = [perm[:9], perm[9:13], perm[13:40], perm[40:]]  # 9, 4, 27 (> chunk 20: alone) and 20 samples
    alg.attach(x, torch.zeros(60, dtype=torch.long), train)
    ids = np.array([2, 0, 3, 1])
    per_client = torch.stack([alg.encode(state["enc"], x[torch.from_numpy(train[i])]) for i in ids])
    assert torch.allclose(alg.embed_clients(state["enc"], ids), per_client, rtol=1e-12, atol=1e-12)
    if chunk == 0:  # one pass per client is encode's own pass: bit-identical (runs before segment pooling)
        assert torch.equal(alg.embed_clients(state["enc"], ids), per_client)
    g_e = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    summed = alg.clients_encoder_backprop(state["enc"], ids, g_e)
    for n, g in summed.items():
        ref = sum(alg.encoder_backprop(state["enc"], x[torch.from_numpy(train[i])], g_e[k])[n]
                  for k, i in enumerate(ids))
        assert torch.allclose(g, ref, rtol=1e-10, atol=1e-12), n
        assert float(g.abs().sum()) > 0, n


# -------------------------------------------------------------- training run
@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    """The run is many small ops: on a busy 2-core machine one intra-op thread is ~8x faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_short_mnist_run_beats_round_zero(mnist_fed, one_thread) -> None:  # type: ignore[no-untyped-def]
    assert "ODPFL-HN" in ALGORITHMS
    alg = build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), mnist_fed.num_train_clients,
                          seed=0, **ODPFL_HP["mnist"]["ODPFL-HN"])
    assert alg.hp.encoder_model == "mlp"  # taken from the protocol's model
    sim = Simulation(alg, mnist_fed, RunConfig(rounds=10, local_iterations=10, batch_size=32, eval_every=10,
                                               seed=0, device="cpu", progress=False))
    before = sim.evaluate_new()
    res = sim.run()
    after = res.last["test"]
    # measured (seed 0, 20 training / 20 new pathological clients): 0.110 -> 0.827 new, val 0.885
    assert before < 0.2 and after > 0.70 and res.last["val"] > 0.75
    assert after > before + 0.5


def test_aggregate_reuses_the_rounds_embeddings_exactly(mnist_fed, one_thread) -> None:  # type: ignore[no-untyped-def]
    """aggregate takes the embeddings client_start computed for the same encoder and clients (one encoder pass
    saved per round) and its update equals the one from embeddings computed afresh, bit for bit."""
    alg = build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), mnist_fed.num_train_clients,
                          seed=0, **ODPFL_HP["mnist"]["ODPFL-HN"])
    sim = Simulation(alg, mnist_fed, RunConfig(rounds=1, local_iterations=5, batch_size=32, seed=0, device="cpu",
                                               progress=False))
    ids, server = np.arange(mnist_fed.num_train_clients), sim.server_state
    states = alg.client_start(server, ids)
    cached = alg._round_embeddings[3]  # type: ignore[index]
    assert alg.round_embeddings(server, ids) is cached  # a hit: no second encoder pass
    assert "round" not in server  # no noise, no round counter: the state (and fingerprints) as before
    states = sim.local_train(alg.local_step, states, server, ids, 5, np.random.default_rng(0))
    reused = alg.aggregate(server, ids, states, sim.train_sizes[ids])
    alg._round_embeddings = None
    fresh = alg.aggregate(server, ids, states, sim.train_sizes[ids])
    for part in ("hn", "enc"):
        assert all(torch.equal(reused[part][k], fresh[part][k]) for k in fresh[part])
    other_encoder = {**server, "enc": tree_map(torch.clone, server["enc"])}
    assert alg.round_embeddings(other_encoder, ids) is not alg.round_embeddings(server, ids)


def test_embedding_noise_is_training_only_and_the_same_in_client_start_and_aggregate(
        mnist_fed, one_thread) -> None:  # type: ignore[no-untyped-def]
    """``embedding_noise``: the training models come from g(D_i) + sigma n with n ~ N(0, I) fixed by (seed,
    round, client); aggregate's chain rule sees the same noisy embeddings (a fresh recomputation agrees bit for
    bit); validation and new clients get the clean embedding."""
    hp = {**ODPFL_HP["mnist"]["ODPFL-HN"], "embedding_noise": 0.5}
    alg = build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), mnist_fed.num_train_clients,
                          seed=0, **hp)
    sim = Simulation(alg, mnist_fed, RunConfig(rounds=1, local_iterations=5, batch_size=32, seed=0, device="cpu",
                                               progress=False))
    ids, server = np.arange(mnist_fed.num_train_clients), sim.server_state
    clean = alg.embed_clients(server["enc"], ids)
    states = alg.client_start(server, ids)
    states_emb = alg._round_embeddings[3]  # type: ignore[index]
    noise = alg.noise_draw(server, ids).to(clean)
    assert noise.shape == clean.shape and 0.8 < float(noise.std()) < 1.2
    assert not torch.equal(noise[0], noise[1])  # per client
    assert not torch.equal(noise, alg.noise_draw({**server, "round": server["round"] + 1}, ids))  # per round
    expected = alg.generate(server["hn"], clean + 0.5 * noise)
    assert all(torch.allclose(states["params"][k], expected[k], atol=1e-6) for k in expected)
    states = sim.local_train(alg.local_step, states, server, ids, 5, np.random.default_rng(0))
    reused = alg.aggregate(server, ids, states, sim.train_sizes[ids])
    alg._round_embeddings = None
    fresh = alg.aggregate(server, ids, states, sim.train_sizes[ids])
    assert all(torch.equal(reused["hn"][k], fresh["hn"][k]) for k in fresh["hn"])
    assert int(reused["round"]) == 1  # the next round draws new noise
    val = alg.val_params(server, ids[:2], sim)
    clean_models = alg.generate(server["hn"], clean[:2])
    # (allclose: on a GPU the two clients' data go through the encoder in another concatenated pass than all)
    assert all(torch.allclose(val[k], clean_models[k], atol=1e-6) for k in val)
    x_new = torch.from_numpy(mnist_fed.dataset.x[mnist_fed.new[0]]).float()
    served = alg.personalize(server, x_new)
    direct = alg.generate(server["hn"], alg.encode(server["enc"], x_new))
    assert all(torch.equal(served[k], direct[k]) for k in served)
    assert not torch.equal(alg.round_embeddings({**server, "round": server["round"] + 1}, ids), states_emb)
    with pytest.raises(ValueError, match="embedding_noise must be >= 0, got -0.5"):
        build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), 4, seed=0, embedding_noise=-0.5)


# ------------------------------------------------------------- two-phase (App. B.2)
def test_two_phase_learns_embeddings_fits_the_encoder_then_fine_tunes(mnist_fed, one_thread) -> None:  # type: ignore[no-untyped-def]
    """Phase 1: learned per-client embeddings (Eq. 9) take pFedHN's step on their own client's chain-rule
    gradient, and the encoder takes one GD step on the data-size-weighted Eq. 10; phase 2 (Eq. 11) moves theta
    only. Checked against a separate autograd computation of both objectives."""
    hp = dict(two_phase=True, phase1_rounds=1, encoder_local_steps=1, hn_lr=0.05, embedding_lr=0.3,
              embedding_init_std=0.5, encoder_lr=0.01, local_lr=0.1)
    alg = build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), mnist_fed.num_train_clients,
                          seed=0, **hp)
    sim = Simulation(alg, mnist_fed, RunConfig(rounds=2, local_iterations=3, batch_size=16, client_fraction=0.25,
                                               eval_every=2, seed=0, device="cpu", progress=False))
    s0 = tree_map(torch.clone, sim.server_state)
    assert s0["emb"].shape == (mnist_fed.num_train_clients, 32) and float(s0["round"]) == 0
    assert 0.4 < float(s0["emb"].std()) < 0.6

    ids, states = sim.run_round(0)
    s1 = sim.server_state
    assert float(s1["round"]) == 1 and alg.in_phase1(s0) and not alg.in_phase1(s1)
    coef = sim.train_sizes[ids] / sim.train_sizes[ids].sum()
    delta = alg.client_delta(states)
    # the embedding rows: each selected client's own gradient (not scaled by its weight), pFedHN's SGD
    # (first step: no momentum history), weight decay 1e-3; the other rows only decay
    e_sel = s0["emb"][torch.as_tensor(ids)].clone().requires_grad_(True)
    w = alg.hn_fn(s0["hn"], e_sel)
    (g_rows,) = torch.autograd.grad(list(w.values()), [e_sel], grad_outputs=[-delta[n] for n in w])
    assert float(g_rows.norm()) < alg.hp.hn_clip
    expect = s0["emb"] * (1 - 0.3 * 1e-3)
    expect[torch.as_tensor(ids)] -= 0.3 * g_rows
    assert torch.allclose(s1["emb"], expect, atol=1e-6)
    assert float((s1["emb"][torch.as_tensor(ids)] - s0["emb"][torch.as_tensor(ids)]).abs().max()) > 1e-3
    # the encoder: one GD step on sum_k coef_k ||g(D_k) - e_k||^2 at the encoder rate
    def eq10(gamma):  # type: ignore[no-untyped-def]
        return sum(c * ((alg.enc_fn(gamma, alg._client_x(int(i))) - s0["emb"][int(i)]) ** 2).sum()
                   for c, i in zip(coef, ids))
    grad = torch.func.grad(eq10)(s0["enc"])
    for n, v in s0["enc"].items():
        assert torch.allclose(s1["enc"][n], v - 0.01 * grad[n], atol=1e-5), n
    assert eq10(s1["enc"]) < eq10(s0["enc"])

    # phase 2 (Eq. 11): the encoder and the embedding table stay, theta moves
    sim.run_round(1)
    s2 = sim.server_state
    assert all(torch.equal(s2["enc"][n], s1["enc"][n]) for n in s1["enc"])
    assert torch.equal(s2["emb"], s1["emb"])
    assert any(not torch.equal(s2["hn"][n], s1["hn"][n]) for n in s1["hn"])
    with pytest.raises(ValueError, match="phase1_rounds"):
        build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), 5, two_phase=True)


def test_standardize_init_spreads_the_training_clients_embeddings(mnist_fed, one_thread) -> None:  # type: ignore[no-untyped-def]
    """At random init the clients' embeddings differ by a few % of their norm; the data-dependent init of psi
    makes them zero-mean, unit-std per dimension over the training clients, and is the same map as before up
    to a per-dimension affine transform (so a new client's embedding is standardized the same way)."""
    def build(**hp):  # type: ignore[no-untyped-def]
        alg = build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), mnist_fed.num_train_clients,
                              seed=0, **hp)
        x = torch.from_numpy(mnist_fed.dataset.x).float()
        alg.attach(x, torch.from_numpy(mnist_fed.dataset.y), mnist_fed.train)
        return alg, alg.init_state(torch.float32, torch.device("cpu"))

    raw_alg, raw = build()
    alg, std = build(standardize_init=True)
    ids = np.arange(mnist_fed.num_train_clients)
    e_raw, e_std = raw_alg.embed_clients(raw["enc"], ids), alg.embed_clients(std["enc"], ids)
    assert float((e_raw.std(0) / e_raw.abs().mean()).mean()) < 0.2  # the problem: nearly one embedding
    assert torch.allclose(e_std.mean(0), torch.zeros(32), atol=1e-4)
    assert torch.allclose(e_std.std(0), torch.ones(32), atol=1e-4)
    new_x = torch.from_numpy(mnist_fed.dataset.x[mnist_fed.new[0]]).float()
    scale, shift = e_raw.std(0), e_raw.mean(0)
    assert torch.allclose(alg.encode(std["enc"], new_x), (raw_alg.encode(raw["enc"], new_x) - shift) / scale, atol=1e-3)
    assert all(torch.equal(std["enc"][n], raw["enc"][n]) for n in raw["enc"] if not n.startswith("psi."))


def test_standardized_encoder_personalises_new_clients(mnist_fed, one_thread) -> None:  # type: ignore[no-untyped-def]
    """With ``standardize_init`` the served model depends on the new client's embedding: a short MNIST run
    (pathological 2-class clients) scores clearly higher with each new client's own embedding than with the
    model of the training clients' mean embedding. (With the Table-4 setup the two are equal: one global model.)"""
    alg = build_algorithm("ODPFL-HN", build_model("mlp", (1, 28, 28), 10, seed=0), mnist_fed.num_train_clients,
                          seed=0, local_lr=0.3, hn_lr=0.05, encoder_lr=1e-5, standardize_init=True)
    # the method's own personalisation, without the safeguard (ODPFL-HN declares rollback: chosen on the lab's
    # validation shifts, where its personalisation gained under a point)
    sim = Simulation(alg, mnist_fed, RunConfig(rounds=15, local_iterations=10, batch_size=32, eval_every=15,
                                               seed=0, device="cpu", progress=False, safeguard=False))
    sim.run()
    state = sim.server_state
    own = float(np.mean(sim.personalized_accuracies(mnist_fed.new)))
    mean_model = alg.generate(state["hn"], alg.embed_clients(state["enc"], np.arange(mnist_fed.num_train_clients)).mean(0))
    shared = float(np.mean([sim.accuracy(mean_model, idx) for idx in mnist_fed.new]))
    # measured (seed 0, 20 training / 20 new clients): own 0.615, mean embedding 0.530
    assert own > shared + 0.05, (own, shared)


def test_target_head_init_starts_the_hypernetwork_at_the_target_models_init() -> None:
    """``hn_head_init="target"``: with head scale 0 every embedding is served exactly the target model's own
    init (FedAvg's starting point); with scale s the client-dependent part is s times the default init's, and
    the heads' weights are s times the default heads' weights (same RNG draw)."""
    model = build_model("lenet", (1, 28, 28), 10, seed=3)
    target = {n: p.detach().clone() for n, p in model.named_parameters()}
    e = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))

    def generated(**hp):  # type: ignore[no-untyped-def]
        alg = build_algorithm("ODPFL-HN", model, 1, seed=0, **hp)
        return alg, alg.generate(alg.init_state(torch.float32, torch.device("cpu"))["hn"], e)

    _, w0 = generated(hn_head_init="target", hn_head_scale=0.0)
    for n, t in target.items():
        assert torch.equal(w0[n], t.expand_as(w0[n])), n
    base, wd = generated()
    alg, ws = generated(hn_head_init="target", hn_head_scale=0.1)
    for head_d, head_s in zip(base.hypernet.heads, alg.hypernet.heads):
        assert torch.allclose(head_s.weight, 0.1 * head_d.weight)
    for n, t in target.items():  # w = bias + W h: the e-dependent part scales with W
        spread_default = (wd[n] - wd[n].mean(0)).abs().max()
        spread_scaled = (ws[n] - ws[n].mean(0)).abs().max()
        assert torch.allclose(spread_scaled, 0.1 * spread_default, rtol=1e-3), n
    with pytest.raises(ValueError, match="hn_head_init must be 'default' or 'target', got 'zeros'"):
        build_algorithm("ODPFL-HN", model, 1, seed=0, hn_head_init="zeros")
    with pytest.raises(ValueError, match="hn_head_scale must be >= 0, got -1.0"):
        build_algorithm("ODPFL-HN", model, 1, seed=0, hn_head_init="target", hn_head_scale=-1.0)
