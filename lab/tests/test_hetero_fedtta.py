"""HeteroFedTTA on real Fashion-MNIST: Eq. 14, the public set, and the reduction to per-group FedTTA."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.func import functional_call

from fl_server.algorithms import build_algorithm
from fl_server.algorithms.hetero_fedtta import SIZE_GROUPS, assign_sizes, digest, kd_loss, public_chunks
from fl_server.data.federated import make_federated
from fl_server.engine import RunConfig, Simulation
from fl_server.models import build_model

from lab.experiments import EXPERIMENTS
from lab.hetero import HeteroRun, split_by_size


def _small_fedtta(dtype: torch.dtype = torch.float64):  # type: ignore[no-untyped-def]
    alg = build_algorithm("FedTTA", build_model("convnet_small", (1, 28, 28), 10, seed=0), 1, seed=0,
                          inner_lr=0.05, lr=0.1, adapt_lr=0.001, adapt_width=32)
    return alg, alg.init_state(dtype, torch.device("cpu"))


def _kl_sum(student: np.ndarray, teacher: np.ndarray) -> float:
    """sum_x KL(softmax(student_x) || softmax(teacher_x)), one sample at a time (numpy)."""
    total = 0.0
    for s, t in zip(student, teacher):
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        q = np.exp(t - t.max()) / np.exp(t - t.max()).sum()
        total += float(np.sum(p * np.log(p / q)))
    return total


@pytest.mark.parametrize("lam", [0.0, 0.1, 1.0])
def test_kd_loss_is_eq14_recomputed_directly(fashion_all, lam: float) -> None:
    alg, s = _small_fedtta()
    x = torch.from_numpy(fashion_all.x[:6]).double()
    gen = torch.Generator().manual_seed(0)
    t_base, t_per = torch.randn(6, 10, generator=gen, dtype=torch.float64), torch.randn(6, 10, generator=gen,
                                                                                         dtype=torch.float64)
    # psi~ by plain autograd on the modules: l_per = ||g(f(x))||_2 taken at the reference batch of 64
    psi = {k: v.clone().requires_grad_(True) for k, v in s["params"].items()}
    scores = functional_call(alg.adapter, s["phi"], (functional_call(alg.model, psi, (x,)),))
    l_per = torch.linalg.vector_norm(scores) * np.sqrt(64 / len(x))
    grads = torch.autograd.grad(l_per, list(psi.values()))
    psi_tilde = {k: (v - 0.05 * g).detach() for (k, v), g in zip(psi.items(), grads)}
    with torch.no_grad():
        per = functional_call(alg.model, psi_tilde, (x,)).numpy()
        base = functional_call(alg.model, s["params"], (x,)).numpy()
    expected = _kl_sum(per, t_per.numpy()) + lam * _kl_sum(base, t_base.numpy())
    got = float(kd_loss(alg, s["params"], s["phi"], x, t_base, t_per, lam)) * len(x)  # Eq. 14 sums over D_p
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_kd_loss_trains_phi_only_through_the_adapted_term(fashion_all) -> None:
    """phi gets a gradient (second order, through psi~); lambda's term adds a psi-only gradient."""
    alg, s = _small_fedtta()
    x = torch.from_numpy(fashion_all.x[:8]).double()
    t = torch.randn(8, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g0 = torch.func.grad(lambda p, f: kd_loss(alg, p, f, x, t, t, 0.0), argnums=(0, 1))(s["params"], s["phi"])
    g1 = torch.func.grad(lambda p, f: kd_loss(alg, p, f, x, t, t, 1.0), argnums=(0, 1))(s["params"], s["phi"])
    assert sum(float(v.abs().sum()) for v in g0[1].values()) > 0
    assert all(torch.allclose(g0[1][k], g1[1][k], atol=1e-14) for k in g0[1])  # phi: same at any lambda
    assert max(float((g0[0][k] - g1[0][k]).abs().max()) for k in g0[0]) > 1e-6  # psi: the base term


def test_digest_moves_the_student_toward_the_consensus(fashion_all) -> None:
    alg, s = _small_fedtta(torch.float32)
    chunks = public_chunks(torch.from_numpy(fashion_all.x[:128]), 64)
    teacher_alg = build_algorithm("FedTTA", build_model("convnet_big", (1, 28, 28), 10, seed=3), 1, seed=3,
                                  inner_lr=0.05, adapt_width=128)
    t_state = teacher_alg.init_state(torch.float32, torch.device("cpu"))
    from fl_server.algorithms.hetero_fedtta import public_logits

    t_base, t_per = public_logits(teacher_alg, t_state["params"], t_state["phi"], chunks)
    loss = lambda st: sum(float(kd_loss(alg, st["params"], st["phi"], c, tb, tp, 1.0))  # noqa: E731
                          for c, tb, tp in zip(chunks, t_base, t_per))
    after = digest(alg, s, chunks, t_base, t_per, 1.0, steps=10)
    assert loss(after) < 0.9 * loss(s)


def test_public_set_is_disjoint_from_every_client(fashion_all) -> None:
    fed = make_federated(fashion_all, "pathological", 100, seed=0, public_size=1024)
    clients = np.concatenate(fed.train + fed.val + fed.new)
    assert len(fed.public) == 1024 and len(np.intersect1d(fed.public, clients)) == 0
    assert len(np.unique(clients)) == len(clients) == 70_000 - 1024  # every other sample still dealt once
    assert max(len(np.unique(fashion_all.y[c])) for c in fed.train + fed.new) <= 2  # still pathological
    other = make_federated(fashion_all, "pathological", 100, seed=1, public_size=1024)
    assert not np.array_equal(fed.public, other.public)
    plain = make_federated(fashion_all, "pathological", 100, seed=0)  # public_size 0: the plain protocol
    assert len(plain.public) == 0 and "public_size" not in plain.info


def test_sizes_are_balanced_and_seeded() -> None:
    a = assign_sizes(50, np.random.default_rng(0))
    assert sorted(np.bincount(a).tolist()) == [16, 17, 17]
    assert np.array_equal(a, assign_sizes(50, np.random.default_rng(0)))
    assert not np.array_equal(a, assign_sizes(50, np.random.default_rng(1)))


def _tiny_protocol():  # type: ignore[no-untyped-def]
    base = EXPERIMENTS["upfl-hetero"].protocols["fashion_mnist"]
    return dataclasses.replace(base, split="test", num_clients=12, rounds=2, local_iterations=2, batch_size=16,
                               options={**base.options, "public_size": 64, "public_batch": 32},
                               method_hp={"HeteroFedTTA": {"inner_lr": 0.05, "lr": 0.1, "adapt_lr": 0.001,
                                                           "clip_norm": 10.0}})


def test_without_knowledge_exchange_each_group_is_plain_fedtta(data_root) -> None:
    """No consensus (the 'no KD' control, or any first round): a HeteroFedTTA round is exactly the FedTTA
    round of the engine on the group's clients with the group's model and adaptation width (same seed)."""
    from lab.runner import build_federated

    protocol = _tiny_protocol()
    fed = build_federated(protocol, 0, str(data_root))
    run = HeteroRun(protocol, fed, 0, lam=None, mode="loop")
    for r in range(2):
        run.round(r)
    for name, group in split_by_size(fed, 0).items():
        arch, width = SIZE_GROUPS[name]
        alg = build_algorithm("FedTTA", build_model(arch, (1, 28, 28), 10, seed=0), group.num_train_clients, seed=0,
                              adapt_width=width, **protocol.method_hp["HeteroFedTTA"])
        cfg = RunConfig(rounds=protocol.rounds, local_iterations=protocol.local_iterations,
                        batch_size=protocol.batch_size, seed=0, mode="loop", progress=False)
        ref = Simulation(alg, group, cfg)
        for r in range(2):
            ref.run_round(r)
        got = run.sims[name].server_state
        for part in ("params", "phi"):
            for k, v in ref.server_state[part].items():
                assert torch.allclose(got[part][k], v, atol=1e-6), (name, part, k)


def test_groups_run_the_method_their_hyper_makes(data_root) -> None:
    """The protocol's early stopping (patience 5) makes every group FedTTA++, named so: no RecipeWarning."""
    import warnings

    from fl_server.recipes.errors import RecipeWarning
    from lab.runner import build_federated

    paper_hp = EXPERIMENTS["upfl-hetero"].protocols["fashion_mnist"].method_hp
    protocol = dataclasses.replace(_tiny_protocol(), method_hp=paper_hp)
    fed = build_federated(protocol, 0, str(data_root))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeWarning)
        run = HeteroRun(protocol, fed, 0, lam=0.1, mode="loop")
    assert {sim.algorithm.name for sim in run.sims.values()} == {"FedTTA++"}
    assert {sim.algorithm.hp.patience for sim in run.sims.values()} == {5}


def test_knowledge_exchange_changes_the_groups(data_root) -> None:
    from lab.runner import build_federated

    protocol = _tiny_protocol()
    fed = build_federated(protocol, 0, str(data_root))
    plain, kd = HeteroRun(protocol, fed, 0, lam=None, mode="loop"), HeteroRun(protocol, fed, 0, lam=1.0, mode="loop")
    plain.round(0)
    kd.round(0)
    assert kd.digest_steps == 2 and len(fed.public) == 64
    for name in SIZE_GROUPS:  # after the first consensus every group has digested it
        a, b = plain.sims[name].server_state["params"], kd.sims[name].server_state["params"]
        assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-6


def test_public_logits_vmap_equals_loop(fashion_all) -> None:
    """The GPU path (clients of a group vmapped) communicates the same logits as the per-client loop."""
    from fl_server.algorithms.hetero_fedtta import clients_public_logits
    from fl_server.functional import stack, tree_map

    alg, s = _small_fedtta(torch.float64)
    states = stack([s, tree_map(lambda t: t + 0.01 * torch.randn_like(t), s)])
    chunks = public_chunks(torch.from_numpy(fashion_all.x[:64]).double(), 32)
    loop, vmap = clients_public_logits(alg, states, chunks, "loop"), clients_public_logits(alg, states, chunks, "vmap")
    assert loop[0].shape == (2, 2, 32, 10)
    for a, b in zip(loop, vmap):
        assert torch.allclose(a, b, atol=1e-10)
    assert not torch.allclose(loop[0], loop[1])  # the adapted logits differ from the base ones


def test_resume_repeats_the_uninterrupted_run(data_root, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A run stopped after its first validation round and resumed from its folder ends where the
    uninterrupted run ends: same states, curve, best round and new-client accuracies; another config refuses
    the folder."""
    from lab.hetero import resume_hetero, run_hetero_seed, train_hetero
    from lab.runner import build_federated

    protocol = dataclasses.replace(_tiny_protocol(), rounds=4, eval_every=2)
    fed = build_federated(protocol, 0, str(data_root))
    method = "HeteroFedTTA (lambda=0.1)"
    straight = run_hetero_seed(protocol, method, 0, tmp_path / "a", mode="loop", progress=False, fed=fed)
    first = HeteroRun(protocol, fed, 0, lam=0.1, mode="loop")
    stopped = train_hetero(first, protocol, tmp_path / "b", progress=False, until=2)  # "killed" after round 1
    assert stopped.rounds_done == 2 and (tmp_path / "b" / "best.npz").exists()
    resumed = run_hetero_seed(protocol, method, 0, tmp_path / "b", mode="loop", progress=False, fed=fed)
    strip = lambda rec: {k: v for k, v in rec.items() if k != "wall_s"}  # noqa: E731
    assert strip(resumed) == strip(straight) and len(straight["curve"]) == 2
    # the final checkpoints hold the same states
    end_a, end_b = (HeteroRun(protocol, fed, 0, lam=0.1, mode="loop") for _ in range(2))
    resume_hetero(end_a, tmp_path / "a")
    resume_hetero(end_b, tmp_path / "b")
    for name in SIZE_GROUPS:
        a, b = end_a.sims[name].server_state["params"], end_b.sims[name].server_state["params"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="different run"):
        resume_hetero(HeteroRun(protocol, fed, 0, lam=1.0, mode="loop"), tmp_path / "b")


def test_variants_stacked_equal_their_solo_runs(data_root, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The 'no KD' and lambda=1 variants of one seed trained together (one stacked round per size group) end as
    their solo runs in float64: the same states, curve and best round, also when one of them resumes from a
    checkpoint a round ahead (it waits for the other); variants of different seeds are refused."""
    from lab.hetero import train_hetero, train_hetero_stacked
    from lab.runner import build_federated

    protocol = dataclasses.replace(_tiny_protocol(), local_iterations=1, batch_size=8, eval_every=1)
    fed = build_federated(protocol, 0, str(data_root))
    engine = {"dtype": "float64"}
    solo = [HeteroRun(protocol, fed, 0, lam=lam, mode="vmap", engine=engine) for lam in (None, 1.0)]
    solo_progress = [train_hetero(run, protocol, None, progress=False) for run in solo]
    together = [HeteroRun(protocol, fed, 0, lam=lam, mode="vmap", engine=engine) for lam in (None, 1.0)]
    ahead = train_hetero(together[1], protocol, tmp_path / "kd", progress=False, until=1)  # checkpointed
    assert ahead.rounds_done == 1 and (tmp_path / "kd" / "checkpoint.npz").exists()
    together[1] = HeteroRun(protocol, fed, 0, lam=1.0, mode="vmap", engine=engine)
    progress = train_hetero_stacked(together, protocol, [tmp_path / "nokd", tmp_path / "kd"], progress=False)
    for got, want, got_p, want_p in zip(together, solo, progress, solo_progress):
        assert got_p.best_round == want_p.best_round and got_p.rounds_done == want_p.rounds_done == 2
        assert [c["val"] for c in got_p.curve] == pytest.approx([c["val"] for c in want_p.curve], abs=1e-9)
        for name in SIZE_GROUPS:
            for part in ("params", "phi"):
                for k, v in want.sims[name].server_state[part].items():
                    assert float((got.sims[name].server_state[part][k] - v).abs().max()) <= 1e-10, (name, part, k)
    kd, plain = (run.sims["small"].server_state["params"] for run in together)
    assert max(float((kd[k] - plain[k]).abs().max()) for k in kd) > 1e-6  # the variants did not copy each other
    other = HeteroRun(protocol, build_federated(protocol, 1, str(data_root)), 1, lam=0.0, mode="vmap", engine=engine)
    with pytest.raises(ValueError, match=r"only the variants of one seed train together, got seeds \[0, 1\]"):
        train_hetero_stacked([together[0], other], protocol, [None, None], progress=False)
