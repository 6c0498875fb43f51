"""BTFL training recipe (fl_server.algorithms.btfl) and FedTHE (edge_sdk._fedthe); the btgfl experiment's tests are
lab/tests/test_btgfl.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edge_sdk._fedthe import code_history, feature_history, fedthe_predict
from edge_sdk.shared import BUNDLE_FORMAT
from fl_server.algorithms import build_algorithm
from fl_server.algorithms.btfl import BTFL
from fl_server.engine.simulation import run_local_steps
from fl_server.functional import index
from fl_server.models import build_model


# ------------------------------------------------------------------------------------------------ FedTHE
def authors_history(z: torch.Tensor, bs: int) -> torch.Tensor:
    """The loop of the authors' THE_worker: per batch, the first entry is the previous batch's last history
    (the stream's first feature at the start) and only the other samples enter the EMA."""
    hist: list[torch.Tensor] = []
    for b in range(0, len(z), bs):
        h = [z[0] if not hist else hist[-1]]
        for i in range(1, len(z[b:b + bs])):
            h.append(0.1 * z[b + i] + 0.9 * h[-1])
        hist += h
    return torch.stack(hist)


def fedthe_reference(g, l_, z, mu_l, mu_g, bs, variant="spec", steps=20, lr=0.1, tol=1e-5):  # type: ignore[no-untyped-def]
    """Slow reference: per batch, torch autograd + torch.optim.Adam on a [B, 2], EMA by a Python loop."""
    g, l_, z = (torch.tensor(a) for a in (g, l_, z))
    hist, h = [], None
    for zi in z:
        h = zi.clone() if h is None else 0.1 * zi + 0.9 * h
        hist.append(h)
    z_t = 0.1 * z + 0.9 * torch.stack(hist)
    code_hist = authors_history(z, bs)
    s = torch.nn.functional.cosine_similarity(g.softmax(1), l_.softmax(1), dim=1, eps=1e-6)
    out = []
    for b in range(0, len(g), bs):
        sl = slice(b, b + bs)
        a = torch.ones(len(g[sl]), 2, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([a], lr=lr)
        rep = z[sl]
        for _ in range(steps):
            if variant == "code":  # the authors re-assign test_rep = 0.3 test_rep + 0.7 history at every step
                rep = 0.3 * rep + 0.7 * code_hist[sl]
                z_t = torch.zeros_like(z)
                z_t[sl] = rep
            d_g, d_l = (torch.linalg.norm(z_t - torch.tensor(m), dim=1) for m in (mu_g, mu_l))
            w = a.softmax(1)
            o = w[:, :1] * g[sl] + w[:, 1:] * l_[sl]
            ent = -(o.softmax(1) * o.log_softmax(1)).sum(1)
            loss = (s[sl] * ent + (1 - s[sl]) * (w[:, 0] * d_g[sl] + w[:, 1] * d_l[sl])).mean()
            opt.zero_grad()
            loss.backward()
            if torch.linalg.norm(a.grad) < tol:
                break
            opt.step()
        w = a.detach().softmax(1)
        out.append(w[:, :1] * g[sl] + w[:, 1:] * l_[sl])
    return torch.cat(out).numpy()


@pytest.mark.parametrize("variant", ["spec", "code"])
@pytest.mark.parametrize("bs", [1, 7, 32])
def test_fedthe_matches_autograd_adam_reference(bs: int, variant: str) -> None:
    rng = np.random.default_rng(bs)
    n, c, d = 45, 10, 16
    g, l_ = rng.normal(0, 2, (n, c)), rng.normal(0, 2, (n, c))
    z = rng.exponential(1.0, (n, d))
    mu_l, mu_g = rng.exponential(1.0, d), rng.exponential(1.0, d)
    ours, w = fedthe_predict(g, l_, z, mu_l, mu_g, bs, variant=variant)
    np.testing.assert_allclose(ours, fedthe_reference(g, l_, z, mu_l, mu_g, bs, variant), atol=1e-8)
    assert np.allclose(w.sum(1), 1.0) and not np.allclose(w, 0.5)  # the weights moved


@pytest.mark.parametrize("bs", [1, 2, 5, 32])
def test_code_history_is_the_authors_loop(bs: int) -> None:
    z = np.random.default_rng(bs).normal(size=(23, 4))
    np.testing.assert_allclose(code_history(z, bs), authors_history(torch.tensor(z), bs).numpy(), atol=1e-12)
    if bs == 1:  # batch size 1: the history never leaves the first feature
        assert np.array_equal(code_history(z, 1), np.tile(z[0], (23, 1)))


def test_fedthe_prefers_the_head_whose_prototype_is_closer() -> None:
    """Heads that disagree (s ~ 0): the alignment term pulls the weight toward the closer prototype."""
    n, c, d = 64, 10, 8
    g = np.tile(np.eye(c)[0] * 8, (n, 1))
    l_ = np.tile(np.eye(c)[1] * 8, (n, 1))
    mu_l, mu_g = np.zeros(d), np.full(d, 5.0)
    _, w_near_local = fedthe_predict(g, l_, np.zeros((n, d)), mu_l, mu_g, 32)
    _, w_near_global = fedthe_predict(g, l_, np.full((n, d), 5.0), mu_l, mu_g, 32)
    assert (w_near_local[:, 1] > 0.8).all() and (w_near_global[:, 0] > 0.8).all()


def test_feature_history_is_the_ema_recursion() -> None:
    z = np.random.default_rng(0).normal(size=(20, 3))
    h = [z[0]]
    for zi in z[1:]:
        h.append(0.1 * zi + 0.9 * h[-1])
    np.testing.assert_allclose(feature_history(z), np.stack(h), atol=1e-12)


# ------------------------------------------------------------------------------------------------ recipe
def _small_btfl(mnist_all, body: int | None = 2):  # type: ignore[no-untyped-def]
    model = build_model("btfl_cnn", mnist_all.x.shape[1:], 10, seed=0)
    alg = build_algorithm("BTFL", model, 3, seed=0, lr=0.05, body_iterations=body)
    x = torch.from_numpy(mnist_all.x[:96])
    y = torch.from_numpy(mnist_all.y[:96]).long()
    train = [np.arange(0, 32), np.arange(32, 64), np.arange(64, 96)]
    alg.attach(x, y, train)
    return alg, alg.init_state(torch.float32, torch.device("cpu")), x, y, train


def test_local_step_trains_body_then_only_the_local_head(mnist_all) -> None:  # type: ignore[no-untyped-def]
    alg, server, x, y, _ = _small_btfl(mnist_all)
    assert isinstance(alg, BTFL)
    st = index(alg.client_start(server, np.array([1])), 0)
    after_body = alg.local_step(st, server, x[:32], y[:32])
    assert not torch.equal(after_body["params"]["features.0.weight"], st["params"]["features.0.weight"])
    assert torch.equal(after_body["local_head"], st["local_head"])  # phase 1: the local head is untouched
    mid = alg.local_step(after_body, server, x[:32], y[:32])
    pers = alg.local_step(mid, server, x[:32], y[:32])  # step index 2 >= body_iterations: personalization
    assert all(torch.equal(pers["params"][k], mid["params"][k]) for k in mid["params"])  # features frozen
    assert not torch.equal(pers["local_head"], mid["local_head"])


@pytest.mark.parametrize("body", [None, 2])
def test_phase_steps_equal_the_counter_steps(mnist_all, body) -> None:  # type: ignore[no-untyped-def]
    """The engine's per-iteration steps (local_step_at: a head step skips the backward through the features)
    reproduce local_step, which reads the phase from the counter, bit for bit, under vmap and in the loop."""
    alg, server, x, y, train = _small_btfl(mnist_all, body)
    ids = np.arange(3)
    batches = torch.from_numpy(np.stack([np.resize(t, (7, 16)) for t in train]))
    assert alg.local_step_at(0) is not alg.local_step_at(5 if body is None else 2)
    for mode in ("vmap", "loop"):
        states = alg.client_start(server, ids)
        phased = run_local_steps(alg.local_step, states, server, x, y, batches, mode, step_at=alg.local_step_at)
        counter = run_local_steps(alg.local_step, states, server, x, y, batches, mode)
        assert torch.equal(phased["local_head"], counter["local_head"]) and torch.equal(phased["step"], counter["step"])
        assert all(torch.equal(phased["params"][k], counter["params"][k]) for k in counter["params"])


def test_aggregate_averages_the_body_and_keeps_each_clients_head(mnist_all) -> None:  # type: ignore[no-untyped-def]
    alg, server, x, y, _ = _small_btfl(mnist_all)
    ids = np.array([0, 2])
    states = alg.client_start(server, ids)
    per_client = []
    for k, st in zip(ids, [index(states, 0), index(states, 1)]):
        for _ in range(3):
            st = alg.local_step(st, server, x[32 * k:32 * k + 32], y[32 * k:32 * k + 32])
        per_client.append(st)
    stacked = {key: torch.stack([s[key] for s in per_client]) for key in ("local_head", "step")}
    stacked["params"] = {n: torch.stack([s["params"][n] for s in per_client]) for n in per_client[0]["params"]}
    new = alg.aggregate(server, ids, stacked, torch.tensor([1.0, 3.0]))
    w = new["params"]["head.bias"]
    assert torch.allclose(w, 0.25 * per_client[0]["params"]["head.bias"] + 0.75 * per_client[1]["params"]["head.bias"])
    assert torch.equal(new["local_heads"][2], per_client[1]["local_head"])
    assert torch.equal(new["local_heads"][1], server["local_heads"][1])  # not selected: unchanged
    with pytest.raises(ValueError, match="body_iterations"):  # a round without personalization steps
        alg.aggregate(server, ids, alg.client_start(server, ids), torch.ones(2))


def test_default_schedule_interleaves_one_head_step_in_six(mnist_all) -> None:  # type: ignore[no-untyped-def]
    """Without body_iterations (e.g. `fl-server train --method BTFL`): steps 5, 11, ... train only the local head."""
    alg, server, x, y, _ = _small_btfl(mnist_all, body=None)
    st = index(alg.client_start(server, np.array([0])), 0)
    head_steps = []
    for t in range(12):
        new = alg.local_step(st, server, x[:32], y[:32])
        if not torch.equal(new["local_head"], st["local_head"]):
            head_steps.append(t)
            assert torch.equal(new["params"]["head.weight"], st["params"]["head.weight"])
        st = new
    assert head_steps == [5, 11]


def test_client_artifacts_leave_one_out_global_dle(mnist_all) -> None:  # type: ignore[no-untyped-def]
    alg, server, x, _, train = _small_btfl(mnist_all)
    arts = alg.client_artifacts(server, x, train)
    dles = np.stack([a.local_dle for a in arts])
    assert np.allclose(dles.sum(-1), 1.0)
    for k, a in enumerate(arts):
        np.testing.assert_allclose(a.global_dle, np.delete(dles, k, 0).mean(0))
        assert a.h_local_bar > 0 and a.h_global_bar > 0 and a.local_head.shape == (10, 64)
        assert set(a.arrays()) == {"local_head", "local_dle", "global_dle", "h_bar", "mu_local", "mu_global"}
    np.testing.assert_allclose(arts[0].mu_global, np.mean([a.mu_local for a in arts], 0))


# ------------------------------------------------------------------------------------------------ device bundle
def test_btfl_client_bundle_runs_on_the_device_path(mnist_all, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Export client 1's bundle, load it torch-free (onnxruntime + numpy) and reproduce the server-side stream."""
    from edge_sdk._btfl import BTFLStream
    from edge_sdk._bundle import load_bundle
    from fl_server.export.btfl import export_btfl_client

    alg, server, x, y, train = _small_btfl(mnist_all)
    for _ in range(3):  # a few real steps so the heads are not at their init
        st = alg.client_start(server, np.array([0, 1, 2]))
        sts = [index(st, k) for k in range(3)]
        sts = [alg.local_step(alg.local_step(alg.local_step(s, server, x[32 * k:32 * k + 32], y[32 * k:32 * k + 32]),
                                             server, x[:32], y[:32]), server, x[:32], y[:32]) for k, s in enumerate(sts)]
        stacked = {"params": {n: torch.stack([s["params"][n] for s in sts]) for n in sts[0]["params"]},
                   "local_head": torch.stack([s["local_head"] for s in sts]),
                   "step": torch.stack([s["step"] for s in sts])}
        server = alg.aggregate(server, np.arange(3), stacked, torch.ones(3))
    arts = alg.client_artifacts(server, x, train)
    bundle = load_bundle(export_btfl_client(alg, server["params"], arts[1], tmp_path / "client1"))
    assert bundle.method == "BTFL"
    state = bundle.weights("btfl")
    sess = bundle.session("features")
    test_x = mnist_all.x[500:540]
    assert [i.name for i in sess.get_inputs()] == ["x"]  # frozen: the weights are embedded (format 2)
    feeds = {"x": test_x}
    z, g = sess.run(["features", "global_logits"], feeds)
    with torch.no_grad():
        z_ref = alg.features(server["params"], torch.from_numpy(test_x))
        g_ref = alg.global_head(server["params"], z_ref)
    np.testing.assert_allclose(z, z_ref.numpy(), atol=1e-4)
    np.testing.assert_allclose(g, g_ref.numpy(), atol=1e-4)
    z64 = z.astype(np.float64)
    device = BTFLStream.from_arrays(state).predict(z64 @ state["local_head"].T, g.astype(np.float64), z64)
    server_side = BTFLStream(arts[1].local_dle, arts[1].global_dle, arts[1].h_local_bar, arts[1].h_global_bar)
    ref = server_side.predict(z64 @ arts[1].local_head.T, g.astype(np.float64), z64)
    np.testing.assert_allclose(device, ref, atol=1e-12)
    with pytest.raises(ValueError, match="lack"):
        BTFLStream.from_arrays({"local_dle": state["local_dle"]})


def test_frozen_features_graph_equals_the_format1_graph(mnist_all, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Bundle formats 2 and on embed the frozen weights in ``features``; format 1 takes them as inputs. Same outputs,
    and the device (graph_feeds) runs both."""
    from edge_sdk._bundle import load_bundle
    from edge_sdk._steps import graph_feeds
    from fl_server.export.btfl import export_btfl_client
    from fl_server.export.embed import embed_inputs

    alg, server, x, _, train = _small_btfl(mnist_all)
    art = alg.client_artifacts(server, x, train)[0]
    test_x = mnist_all.x[500:517]
    outs = {}
    for frozen in (False, True):
        bundle = load_bundle(export_btfl_client(alg, server["params"], art, tmp_path / f"b{frozen}", frozen=frozen))
        sess = bundle.session("features")
        feeds = graph_feeds(sess, {"x": test_x, **{f"psi.{n}": v for n, v in bundle.weights("psi").items()}})
        assert (len(feeds) == 1) == frozen
        outs[frozen] = sess.run(["features", "global_logits"], feeds)
        assert bundle.manifest["format"] == BUNDLE_FORMAT
    for a, b in zip(outs[False], outs[True]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"the graph needs inputs \['x'\]"):
        graph_feeds(sess, {})
    with pytest.raises(ValueError, match=r"has no inputs \['psi.nope'\] to embed"):
        embed_inputs(bundle.path("features"), {"psi.nope": np.zeros(1)})
