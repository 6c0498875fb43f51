"""FedICON: contrastive losses against Eq. 4 / Eq. 7 written out, augmentations, training and TTA on real data."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fl_server.algorithms import build_algorithm
from fl_server.algorithms.contrastive import memory_contrastive_loss, supcon_loss, unsup_contrastive_loss
from fl_server.data.augment import augment, hash_uniform, num_uniforms, two_views
from fl_server.data.federated import make_federated
from fl_server.engine import RunConfig, Simulation
from fl_server.models import build_model


def _eq4_loop(z: torch.Tensor, y: torch.Tensor, tau: float) -> float:
    """Eq. 4 term by term: for each anchor x, -1/|P(x)| sum_p log exp(z_x.z_p/tau) / sum_{a != x} exp(z_x.z_a/tau)."""
    total, m = 0.0, len(z)
    for i in range(m):
        denom = sum(math.exp(float(z[i] @ z[a]) / tau) for a in range(m) if a != i)
        pos = [p for p in range(m) if p != i and int(y[p]) == int(y[i])]
        total += -sum(math.log(math.exp(float(z[i] @ z[p]) / tau) / denom) for p in pos) / len(pos)
    return total / m


def test_supcon_matches_eq4_loop() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(10, 4, generator=g, dtype=torch.float64), dim=1)
    y = torch.tensor([0, 1, 0, 2, 1, 0, 1, 0, 2, 1])
    assert float(supcon_loss(z, y, 0.1)) == pytest.approx(_eq4_loop(z, y, 0.1), rel=1e-10)
    assert float(supcon_loss(z, y, 0.5)) == pytest.approx(_eq4_loop(z, y, 0.5), rel=1e-10)


def test_unsupervised_loss_is_eq7_with_the_other_view_as_only_positive() -> None:
    g = torch.Generator().manual_seed(1)
    z = torch.nn.functional.normalize(torch.randn(8, 3, generator=g, dtype=torch.float64), dim=1)
    ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    assert float(unsup_contrastive_loss(z, 0.1)) == pytest.approx(_eq4_loop(z, ids, 0.1), rel=1e-10)
    # online form: anchor x, positive its view, A(x) = view + memory
    x, v, mem = z[:2], z[2:4], z[4:]
    def term(i: int) -> float:
        pos = math.exp(float(x[i] @ v[i]) / 0.1)
        return -math.log(pos / (pos + sum(math.exp(float(x[i] @ m) / 0.1) for m in mem)))

    direct = np.mean([term(0), term(1)])
    assert float(memory_contrastive_loss(x, v, mem, 0.1)) == pytest.approx(direct, rel=1e-10)


def test_supcon_prefers_class_aligned_representations() -> None:
    y = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    aligned = torch.nn.functional.one_hot(y, 2).double() + 0.01 * torch.randn(8, 2, dtype=torch.float64)
    shuffled = aligned[torch.tensor([0, 2, 1, 3, 4, 6, 5, 7])]
    norm = torch.nn.functional.normalize
    assert supcon_loss(norm(aligned, dim=1), y) < supcon_loss(norm(shuffled, dim=1), y)


def test_augment_is_seeded_bounded_and_vmappable(mnist_all) -> None:  # type: ignore[no-untyped-def]
    x = torch.from_numpy(mnist_all.x[:16])
    key = torch.tensor(42)
    a, b = two_views(x, key), two_views(x, key)
    assert torch.equal(a, b) and a.shape == (32, 1, 28, 28)
    assert not torch.equal(two_views(x, torch.tensor(43)), a)
    assert float(a.min()) >= 0.0 and float(a.max()) <= 1.0
    assert not torch.allclose(a[:16], a[16:])  # two different views
    # a view stays close to its image (small rotation/shift): correlation well above unrelated digits
    corr = torch.nn.functional.cosine_similarity(a[:16].flatten(1), x.flatten(1))
    assert float(corr.mean()) > 0.5
    keys = torch.tensor([1, 2, 3])
    batched = torch.vmap(lambda k, xx: two_views(xx, k))(keys, x[:4].expand(3, 4, 1, 28, 28))
    assert torch.allclose(batched[1], two_views(x[:4], torch.tensor(2)), atol=1e-6)
    u = hash_uniform(torch.tensor(5), 1000, 3)
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.03
    # zero-strength augmentation is the identity
    from fl_server.data.augment import AugmentConfig
    ident = augment(x[:4], hash_uniform(key, 4, num_uniforms(x.shape[1:])), AugmentConfig(0, 0, 0, 0))
    assert torch.allclose(ident, x[:4], atol=1e-5)


@pytest.fixture(scope="module")
def trained(mnist_all):  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    ds = mnist_all.subset(np.arange(4000))
    fed = make_federated(ds, "dirichlet", num_clients=8, new_fraction=0.25, alpha=0.5, seed=0)
    model = build_model("mlp", (1, 28, 28), 10, seed=0)
    algo = build_algorithm("FedICON", model, fed.num_train_clients, seed=0, encoder_rounds=4, lr=0.05,
                           head_lr=1.0, ft_iterations=10, tta_lr=0.01)
    sim = Simulation(algo, fed, RunConfig(rounds=6, local_iterations=15, batch_size=32, seed=0, progress=False,
                                          eval_every=6))
    result = sim.run()
    return algo, sim, result


def test_fedicon_trains_encoder_then_head(trained) -> None:  # type: ignore[no-untyped-def]
    _, sim, result = trained
    assert int(sim.server_state["round"]) == 6
    assert result.best_val > 0.5  # linear probe on the contrastive encoder after 6 short rounds, 10 classes


def test_fedicon_tta_changes_encoder_only_and_keeps_accuracy(trained) -> None:  # type: ignore[no-untyped-def]
    algo, sim, _ = trained
    idx = torch.from_numpy(sim.fed.new[0])
    x, y = sim.x[idx], sim.y[idx]
    before = sim.server_state["params"]
    after = algo.personalize(sim.server_state, x)
    assert torch.equal(after["head.weight"], before["head.weight"])
    assert not torch.equal(after["features.1.weight"], before["features.1.weight"])
    acc = lambda p: float((algo.predict(p, x).argmax(-1) == y).double().mean())
    assert acc(after) > acc(before) - 0.05
    # the step lowers the Eq. 7 loss on the batch it was taken on
    u = algo._uniforms(x[:64], 128, 0)
    enc = {k: v for k, v in before.items() if k.startswith("features.")}
    loss0 = algo.tta_objective(enc, sim.server_state["proj"], x[:64], u)
    p1, q1 = algo.tta_step(before, sim.server_state["proj"], x[:64], u)
    loss1 = algo.tta_objective({k: v for k, v in p1.items() if k.startswith("features.")}, q1, x[:64], u)
    assert float(loss1) < float(loss0)


def test_fedicon_online_mode(trained) -> None:  # type: ignore[no-untyped-def]
    algo, sim, _ = trained
    idx = torch.from_numpy(sim.fed.new[0][:40])
    memory = sim.x[torch.from_numpy(sim.fed.train[0][:64])]
    algo.hp.tta_lr = 0.001  # one step per arriving sample: a smaller rate than batch mode
    params, logits = algo.online(sim.server_state["params"], sim.server_state["proj"], sim.x[idx], memory)
    assert logits.shape == (40, 10)
    assert not torch.equal(params["features.1.weight"], sim.server_state["params"]["features.1.weight"])
    acc = float((logits.argmax(-1) == sim.y[idx]).double().mean())
    with torch.no_grad():
        before = float((algo.predict(sim.server_state["params"], sim.x[idx]).argmax(-1) == sim.y[idx]).double().mean())
    algo.hp.tta_lr = 0.01
    assert acc >= before - 0.1  # adapting on the stream does not wreck the classifier


def test_fedicon_online_memory_keeps_its_size_and_takes_the_arriving_samples(mnist_all) -> None:  # type: ignore[no-untyped-def]
    x = torch.from_numpy(mnist_all.x[:300])
    algo = build_algorithm("FedICON", build_model("mlp", (1, 28, 28), 10, seed=0), 4, seed=0, memory_size=32)
    rng = np.random.default_rng(0)

    def present(a: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:  # [len(a)] bool: row of a in memory
        return (a.flatten(1)[:, None] == memory.flatten(1)[None]).all(-1).any(1)

    training, arriving = x[:32], x[100:116]
    memory = algo.remember(training.clone(), arriving, rng)
    assert memory.shape == training.shape
    assert bool(present(arriving, memory).all())  # every arriving sample entered ...
    assert int(present(training, memory).sum()) == 32 - 16  # ... each in place of a different training sample
    # a memory below memory_size fills up first; of a chunk longer than the memory, its last samples stay
    assert torch.equal(algo.remember(x[:20].clone(), arriving[:8], rng), torch.cat([x[:20], arriving[:8]]))
    assert bool(present(x[118:150], algo.remember(training.clone(), x[100:150], rng)).all())
    # over a stream, the memory ends as the latest samples mixed with the survivors, always 32 of them
    for start in range(116, 300, 16):
        memory = algo.remember(memory, x[start:start + 16], rng)
        assert memory.shape == training.shape and bool(present(x[start:start + 16], memory).all())


@pytest.mark.parametrize("chunk, memory_rows", [(1, 40), (16, 10), (7, 0)])
def test_fedicon_online_equals_drawing_at_every_chunk(mnist_all, chunk: int, memory_rows: int) -> None:  # type: ignore[no-untyped-def]
    """online() draws every chunk's augmentation keys and memory slots up front (no host-to-device copy per
    streamed sample on a GPU); it equals the plain loop that draws them as each chunk arrives, bit for bit."""
    x = torch.from_numpy(mnist_all.x[:300])
    algo = build_algorithm("FedICON", build_model("btfl_cnn", (1, 28, 28), 10, seed=0), 4, seed=3,
                           tta_mode="online", memory_size=32, tta_lr=0.01)
    state = algo.init_state(torch.float32, torch.device("cpu"))
    stream, memory = x[:60], x[200:200 + memory_rows].clone()
    params, logits = algo.online(state["params"], state["proj"], stream, memory, chunk=chunk)

    ref, proj, rng, out = state["params"], state["proj"], np.random.default_rng([3, 17]), []
    memory = memory[:32]  # online() keeps at most memory_size of the samples it starts with
    for i, start in enumerate(range(0, len(stream), chunk)):
        xb = stream[start:start + chunk]
        if len(memory):
            ref, proj = algo.online_step(ref, proj, xb, memory, algo._uniforms(xb, len(xb), i))
            ref, proj = {k: v.detach() for k, v in ref.items()}, {k: v.detach() for k, v in proj.items()}
        with torch.no_grad():
            out.append(algo.forward(ref, xb))
        memory = algo.remember(memory, xb, rng)
    assert torch.equal(logits, torch.cat(out))
    assert all(torch.equal(params[k], ref[k]) for k in ref)


def test_tta_step_exports_to_onnx_with_parity(tmp_path, trained) -> None:  # type: ignore[no-untyped-def]
    """The Eq. 7 step is a pure graph (x, u, weights) -> weights: ONNX on onnxruntime matches torch at
    another batch size than the traced one."""
    import onnxruntime as ort

    from fl_server.export.fedicon import fedicon_tta_step_spec
    from fl_server.export.graphs import export_function

    algo, sim, _ = trained
    spec = fedicon_tta_step_spec(algo, sim.server_state["params"], sim.server_state["proj"], batch=4)
    path = export_function(spec.fn, spec.example, spec.input_names, spec.output_names, spec.batch_inputs,
                           tmp_path / "tta.onnx")
    x = sim.x[:6]
    u = hash_uniform(torch.tensor(3), 12, num_uniforms(x.shape[1:])).reshape(6, 2, -1)
    inputs = [x, u, *spec.example[2:]]
    out = ort.InferenceSession(str(path)).run(None, {n: v.numpy() for n, v in zip(spec.input_names, inputs)})
    ref = spec.fn(*inputs)
    assert max(float(np.abs(o - r.detach().numpy()).max()) for o, r in zip(out, ref)) < 1e-4
    # and it is the step personalize() takes (view 1 of all samples, then view 2)
    new_p, _ = algo.tta_step(sim.server_state["params"], sim.server_state["proj"], x,
                             u.transpose(0, 1).reshape(12, -1))
    assert np.allclose(out[0], new_p[spec.input_names[2][len("psi."):]].numpy(), atol=1e-5)


def test_without_projection_the_losses_act_on_the_encoder_output(mnist_all) -> None:  # type: ignore[no-untyped-def]
    """projection="none" is Eq. 3 as written: z = normalize(h(x)), no projection parameters; training and the
    test-time step run on an empty projection state and move the encoder the classifier reads."""
    x, y = torch.from_numpy(mnist_all.x[:64]), torch.from_numpy(mnist_all.y[:64]).long()
    algo = build_algorithm("FedICON", build_model("mlp", (1, 28, 28), 10, seed=0), 4, seed=0, projection="none")
    state = algo.init_state(torch.float32, torch.device("cpu"))
    assert state["proj"] == {}
    enc = {k: v for k, v in state["params"].items() if k.startswith("features.")}
    feats = algo.features_forward({k[len("features."):]: v for k, v in enc.items()}, x)
    torch.testing.assert_close(algo.represent(enc, state["proj"], x), torch.nn.functional.normalize(feats, dim=1))
    clients = algo.client_start(state, np.arange(2))
    stepped = torch.vmap(algo.local_step, in_dims=(0, None, 0, 0))(clients, state, x[None].expand(2, -1, -1, -1, -1),
                                                                   y[None].expand(2, -1))
    assert stepped["proj"] == {} and not torch.equal(stepped["params"]["features.1.weight"][0],
                                                     state["params"]["features.1.weight"])
    adapted = algo.personalize(state, x)
    assert not torch.equal(adapted["features.1.weight"], state["params"]["features.1.weight"])
    restored = {k: v for k, v in state.items() if k != "proj"}  # a checkpoint keeps no empty sub-state
    assert all(torch.equal(a, b) for a, b in zip(algo.personalize(restored, x).values(), adapted.values()))
    assert algo.client_start(restored, np.arange(2))["proj"] == {}
    with pytest.raises(ValueError, match="projection must be 'mlp' or 'none'"):
        build_algorithm("FedICON", build_model("mlp", (1, 28, 28), 10, seed=0), 4, projection="linear")
