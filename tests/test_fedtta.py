"""FedTTA: the meta-gradient really is second order; FedTTA++ early stopping returns the right iterate."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from edge_sdk import EntropyEarlyStopping
from fl_server.algorithms import build_algorithm
from fl_server.algorithms.losses import entropy_from_logits, kl_from_logits
from fl_server.functional import tree_map
from fl_server.models import build_model


def _tiny(mu: float = 0.0, **hp):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    alg = build_algorithm("FedTTA", build_model("mlp", (1, 4, 4), 3, seed=0), 1, inner_lr=0.5, lr=0.1,
                          adapt_lr=0.01, mu=mu, adapt_width=8, **hp)
    state = alg.init_state(torch.float64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(16, 1, 4, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=gen)
    return alg, state, x, y


@pytest.mark.parametrize("mu", [0.0, 0.01])
def test_meta_gradient_matches_finite_differences(mu: float) -> None:
    alg, s, x, y = _tiny(mu)
    server = tree_map(lambda t: t + 0.01 * torch.randn_like(t), s["params"])  # frozen received model
    loss = lambda psi, phi: alg.meta_loss(psi, phi, server, x, y)  # noqa: E731
    g_psi, g_phi = torch.func.grad(loss, argnums=(0, 1))(s["params"], s["phi"])
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        d_psi = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in s["params"].items()}
        d_phi = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in s["phi"].items()}
        eps = 1e-6
        shift = lambda sign: loss(  # noqa: E731
            {k: v + sign * eps * d_psi[k] for k, v in s["params"].items()},
            {k: v + sign * eps * d_phi[k] for k, v in s["phi"].items()})
        fd = float((shift(1) - shift(-1)) / (2 * eps))
        analytic = sum(float((g_psi[k] * d_psi[k]).sum()) for k in d_psi) + \
            sum(float((g_phi[k] * d_phi[k]).sum()) for k in d_phi)
        assert abs(fd - analytic) < 1e-6 * max(1.0, abs(fd))


def test_proxy_term_reuses_the_inner_steps_forward_exactly() -> None:
    """meta_loss takes Eq. 13's f(X; psi) from the Eq. 5 step's own forward: the same gradients (float64) as a
    second forward of psi, the KL part included."""
    alg, s, x, y = _tiny(mu=1.0)
    server = tree_map(lambda t: t + 0.05 * torch.randn_like(t), s["params"])

    def two_forwards(psi, phi):  # type: ignore[no-untyped-def]
        loss = torch.nn.functional.cross_entropy(alg.forward(alg.adapt_step(psi, phi, x), x), y)
        return loss + kl_from_logits(alg.forward(psi, x), alg.forward(server, x).detach()).mean()

    reused = torch.func.grad(lambda p, f: alg.meta_loss(p, f, server, x, y), argnums=(0, 1))(s["params"], s["phi"])
    direct = torch.func.grad(two_forwards, argnums=(0, 1))(s["params"], s["phi"])
    for got, want in zip(reused, direct):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12)
    kl_only = torch.func.grad(lambda p: kl_from_logits(alg.adapt_step_and_logits(p, s["phi"], x)[1],
                                                       alg.forward(server, x)).mean())(s["params"])
    assert sum(float(v.abs().sum()) for v in kl_only.values()) > 1e-3  # the aux logits carry psi's gradient


def test_second_order_term_is_present() -> None:
    """dL/dphi exists only through the inner step's gradient (a second-order path); and the first-order
    approximation of dL/dpsi (treating grad_psi l_per as a constant) differs from the exact one."""
    alg, s, x, y = _tiny()
    g_psi, g_phi = torch.func.grad(lambda p, f: alg.meta_loss(p, f, s["params"], x, y), argnums=(0, 1))(
        s["params"], s["phi"])
    assert sum(float(v.abs().sum()) for v in g_phi.values()) > 0

    def first_order(psi):  # type: ignore[no-untyped-def]
        inner = torch.func.grad(alg.personalization_loss)(psi, s["phi"], x)
        inner = {k: v.detach() for k, v in inner.items()}
        return torch.nn.functional.cross_entropy(alg.forward({k: psi[k] - 0.5 * inner[k] for k in psi}, x), y)

    g_fo = torch.func.grad(first_order)(s["params"])
    diff = max(float((g_psi[k] - g_fo[k]).abs().max()) for k in g_psi)
    assert diff > 1e-6


def test_vmap_and_loop_agree_for_the_meta_step() -> None:
    alg, s, x, y = _tiny()
    states = alg.client_start(s, np.arange(3))
    xs, ys = torch.stack([x, x.flip(0), x * 0.5]), torch.stack([y, y.flip(0), y])
    batched = torch.vmap(alg.local_step, in_dims=(0, None, 0, 0))(states, s, xs, ys)
    for k in range(3):
        single = alg.local_step({"params": {n: v[k] for n, v in states["params"].items()},
                                 "phi": {n: v[k] for n, v in states["phi"].items()}}, s, xs[k], ys[k])
        for n in single["params"]:
            assert torch.allclose(single["params"][n], batched["params"][n][k], atol=1e-12)


def test_early_stopping_on_a_known_curve() -> None:
    stop = EntropyEarlyStopping(patience=2, max_steps=50)
    curve = [1.0, 0.8, 0.9, 0.85, 0.7]
    decisions = [stop.update(h) for h in curve[:4]]
    assert decisions == [False, False, False, True]  # step 3 is the 2nd step without improvement
    assert stop.best_step == 1 and stop.best_entropy == 0.8


def test_early_stopping_keeps_the_unadapted_model_and_caps_steps() -> None:
    stop = EntropyEarlyStopping(patience=1)
    assert [stop.update(h) for h in (0.5, 0.6)] == [False, True] and stop.best_step == 0
    capped = EntropyEarlyStopping(patience=1, max_steps=3)
    assert [capped.update(h) for h in (4, 3, 2, 1)] == [False, False, False, True] and capped.best_step == 3
    with pytest.raises(ValueError, match="finite"):
        EntropyEarlyStopping().update(float("nan"))
    with pytest.raises(ValueError, match="patience"):
        EntropyEarlyStopping(patience=0)


def test_fedtta_plus_plus_returns_the_lowest_entropy_iterate() -> None:
    alg, s, x, _ = _tiny(patience=2, max_steps=10)
    s = {k: tree_map(lambda t: t.float(), v) for k, v in s.items()}
    x = x.float()
    best, stopper = alg.personalize_early_stopping(s["params"], s["phi"], x)
    # replay the iterates and check the returned one is the argmin of the recorded entropies
    psi, iterates = s["params"], [s["params"]]
    for _ in range(len(stopper.history) - 1):
        psi = {k: v.detach() for k, v in alg.adapt_step(psi, s["phi"], x).items()}
        iterates.append(psi)
    with torch.no_grad():
        ent = [float(entropy_from_logits(alg.forward(p, x)).mean()) for p in iterates]
    np.testing.assert_allclose(ent, stopper.history, rtol=1e-5)
    assert stopper.best_step == int(np.argmin(ent))
    assert all(torch.equal(best[k], iterates[stopper.best_step][k]) for k in best)


def test_first_candidate_skips_the_unadapted_model() -> None:
    """first_candidate = 1 (docs/research/fedttapp-diagnosis.md): iterate 0 is recorded but never returned, and
    patience counts from the first candidate."""
    stop = EntropyEarlyStopping(patience=1, first_candidate=1)
    assert [stop.update(h) for h in (0.5, 0.6, 0.7)] == [False, False, True]  # 0.5 is lowest, not a candidate
    assert stop.best_step == 1 and stop.history == [0.5, 0.6, 0.7]
    with pytest.raises(ValueError, match="first_candidate"):
        EntropyEarlyStopping(max_steps=3, first_candidate=4)
    alg, s, x, _ = _tiny(patience=1, max_steps=10, first_candidate=1)
    s = {k: tree_map(lambda t: t.float(), v) for k, v in s.items()}
    _, stopper = alg.personalize_early_stopping(s["params"], s["phi"], x.float())
    assert stopper.best_step >= 1 and len(stopper.history) >= 3


def test_new_option_at_its_default_keeps_run_fingerprints() -> None:
    """Checkpoints made before first_candidate existed still resume: at its default it is not part of the
    fingerprint; set, it is."""
    from fl_server.algorithms.fedtta import FedTTAConfig
    from fl_server.engine.simulation import fingerprint_hp

    assert "first_candidate" not in fingerprint_hp(FedTTAConfig())
    assert fingerprint_hp(FedTTAConfig(first_candidate=1))["first_candidate"] == 1
    assert set(fingerprint_hp(FedTTAConfig())) == set(dataclasses.asdict(FedTTAConfig())) - {"first_candidate"}


def test_adapter_init_is_seeded() -> None:
    make = lambda seed: build_algorithm("FedTTA", build_model("mlp", (1, 4, 4), 3, seed=0), 1, seed=seed)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    pa, pb, pc = (list(m.adapter.parameters()) for m in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb)) and not torch.equal(pa[0], pc[0])


def test_personalization_loss_is_the_paper_norm_at_batch_b_and_invariant_to_set_size() -> None:
    """l_per = sqrt(B mean g^2): the paper's ||g||_2 on a batch of B samples; on a new client's full set the
    step no longer grows like sqrt(N) (a set repeated k times gives exactly the same step)."""
    alg, s, x, _ = _tiny(loss_batch=16)
    raw = build_algorithm("FedTTA", alg.model, 1, inner_lr=0.5, adapt_width=8, loss_batch=None)
    psi, phi = s["params"], s["phi"]
    assert torch.allclose(alg.personalization_loss(psi, phi, x), raw.personalization_loss(psi, phi, x), atol=1e-12)
    x4 = x.repeat(4, 1, 1, 1)
    one, four = alg.adapt_step(psi, phi, x), alg.adapt_step(psi, phi, x4)
    assert max(float((one[k] - four[k]).abs().max()) for k in one) < 1e-12
    raw_one, raw_four = raw.adapt_step(psi, phi, x), raw.adapt_step(psi, phi, x4)  # the paper's: 2x the step
    ratio = [float(((raw_four[k] - psi[k]).norm() / (raw_one[k] - psi[k]).norm())) for k in psi]
    np.testing.assert_allclose(ratio, 2.0, rtol=1e-9)


def test_fedtta_plus_plus_ends_at_an_overflowing_iterate_with_the_best_finite_one() -> None:
    """An Eq. 5 step whose entropy overflows ends adaptation (the device's rule): the received model stays."""
    alg, s, x, _ = _tiny(patience=3, max_steps=10)
    alg.hp.inner_lr = 1e300  # the first step sends the weights to inf
    best, stopper = alg.personalize_early_stopping(s["params"], s["phi"], x)
    assert stopper.history and stopper.best_step == 0 and len(stopper.history) == 1
    assert all(torch.equal(best[k], s["params"][k]) for k in best)
