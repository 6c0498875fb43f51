"""The engine's fast paths for vmapped rounds: CUDA-graph replay of the local steps (fl_server/engine/graphs.py) and
convolutions as gathered patches plus a batched matrix product (fl_server/engine/gemm_conv.py) or in bfloat16
(fl_server/engine/bf16_conv.py). On a GPU the graphed rounds
equal the eager ones in float64; elsewhere the engine takes the eager path and the graph runner passes rounds
through. The GEMM convolution equals torch's, also under vmap and second-order gradients."""
from __future__ import annotations

import collections
import re

import numpy as np
import pytest
import torch

from fl_server.algorithms import build_algorithm
from fl_server.data.federated import make_federated
import torch.nn.functional as F

from fl_server.engine import RunConfig, Simulation
from fl_server.engine.bf16_conv import Bf16Conv
from fl_server.engine.gemm_conv import GemmConv, conv2d_gemm
from fl_server.engine.graphs import GraphedLocalSteps, vmapped_round
from fl_server.models import build_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU lease)")


def _sim(fed, method: str, model: str, device: str, graphs: bool, conv: str = "native", steps: int = 4,  # type: ignore[no-untyped-def]
         batch: int = 64, seed: int = 0, **hp) -> Simulation:
    alg = build_algorithm(method, build_model(model, (1, 28, 28), 10, seed=seed), fed.num_train_clients, seed=seed,
                          **hp)
    return Simulation(alg, fed, RunConfig(rounds=3, local_iterations=steps, batch_size=batch, seed=seed, mode="vmap",
                                          dtype="float64", device=device, progress=False, cuda_graphs=graphs,
                                          batched_conv=conv))


def _assert_states_close(got: dict, want: dict, tol: float) -> None:
    for key in ("params", "phi"):
        for name, ref in want.get(key, {}).items():
            assert bool(torch.isfinite(ref).all()), (key, name)  # a diverged run would compare inf with inf
            assert float((got[key][name] - ref).abs().max()) <= tol, (key, name)


@pytest.fixture(scope="module")
def small_fed(mnist_all):  # type: ignore[no-untyped-def]
    return make_federated(mnist_all.subset(np.arange(3000)), "pathological", 12, seed=0)


def test_graph_runner_passes_cpu_rounds_through(small_fed) -> None:  # type: ignore[no-untyped-def]
    """On CPU tensors the runner records nothing and returns exactly the eager round."""
    sim = _sim(small_fed, "FedTTA-Prox", "mlp", "cpu", graphs=True, mu=0.1)
    assert sim.graphed is None  # graphs are for vmapped runs on a GPU only
    alg, x, y = sim.algorithm, sim.x, sim.y
    ids = np.arange(small_fed.num_train_clients)
    states = alg.client_start(sim.server_state, ids)
    batches = torch.randint(0, len(x), (len(ids), 3, 8), generator=torch.Generator().manual_seed(0))
    runner = GraphedLocalSteps()
    steps = (alg.local_step,) * 3
    got = runner(steps, states, sim.server_state, x, y, batches, None)
    want = vmapped_round(steps, states, sim.server_state, x, y, batches, None)
    assert runner.captures == 0 and runner.replays == 0
    for key in ("params", "phi"):
        for name in want[key]:
            assert torch.equal(got[key][name], want[key][name])


@pytest.mark.parametrize("kwargs", [{}, {"stride": 2, "padding": 1}, {"padding": 2, "dilation": 2},
                                    {"stride": (2, 1), "padding": (1, 0)}, {"stride": (2,), "padding": (1,)},
                                    {"groups": 3}, {"padding": "same"}])
def test_gemm_convolution_equals_torch(kwargs: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 12, 12, dtype=torch.float64, generator=gen)
    w = torch.randn(9, 6 // kwargs.get("groups", 1), 3, 3, dtype=torch.float64, generator=gen)
    b = torch.randn(9, dtype=torch.float64, generator=gen)
    assert float((conv2d_gemm(x, w, b, **kwargs) - F.conv2d(x, w, b, **kwargs)).abs().max()) <= 1e-12
    assert float((conv2d_gemm(x[0], w, None, **kwargs) - F.conv2d(x[0], w, None, **kwargs)).abs().max()) <= 1e-12


def _vmapped_second_order_ops(clients: int, batch: int, conv=None) -> collections.Counter:  # type: ignore[no-untyped-def]
    """The operators of a GEMM convolution's forward, gradient and gradient of the gradient (input and weights),
    taken inside ``vmap`` over the clients as FedTTA's meta-step takes them."""
    from torch.func import grad
    from torch.profiler import ProfilerActivity, profile

    conv = conv or (lambda a, b: conv2d_gemm(a, b, None, 1, 1))
    loss = lambda a, b: conv(a, b).square().sum()  # noqa: E731
    second = grad(lambda a, b: sum(g.square().sum() for g in grad(loss, argnums=(0, 1))(a, b)), argnums=(0, 1))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(clients, batch, 2, 10, 10, generator=gen)
    w = torch.randn(clients, 4, 2, 3, 3, generator=gen)
    torch.vmap(second)(x, w)  # warm-up: the patch index is cached outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.vmap(second)(x, w)
    return collections.Counter(e.name for e in prof.events())


def test_gemm_convolution_launches_do_not_grow_with_the_batch_or_the_clients() -> None:
    """The patches are one gather and their gradient one scatter, with vmap batching rules: no operator runs once
    per image (F.unfold's im2col/col2im loop over the batch) or once per client (vmap's fallback loop, as for
    Tensor.unfold's gradient: turned off here, so such an operator raises), so sixteen times the images and twice
    the clients run no more operators."""
    fallback = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        base, images, clients = (_vmapped_second_order_ops(k, n) for k, n in ((3, 4), (3, 64), (6, 4)))
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(fallback)
    assert "aten::im2col" not in images and "aten::col2im" not in images
    assert sum(images.values()) <= sum(base.values()) + 5, (base, images)
    assert sum(clients.values()) <= sum(base.values()) + 5, (base, clients)


@pytest.mark.parametrize("kwargs", [{"padding": -1}, {"stride": 0}, {"dilation": 6}, {"in_channels": 2}])
def test_gemm_convolution_refuses_what_torch_refuses(kwargs: dict) -> None:
    """Arguments torch.conv2d refuses (negative padding, stride 0, a kernel wider than the padded input, weights
    of other input channels) raise torch's own error, not a cropped or empty result."""
    kwargs = dict(kwargs)
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, kwargs.pop("in_channels", 3), 3, 3)
    with pytest.raises(RuntimeError) as want:
        F.conv2d(x, w, **kwargs)
    with pytest.raises(RuntimeError, match=re.escape(str(want.value).splitlines()[0])):
        conv2d_gemm(x, w, **kwargs)


def test_gemm_convolution_engine_round_equals_native(small_fed) -> None:  # type: ignore[no-untyped-def]
    """FedTTA's second-order meta-step on the ConvNet, vmapped over the clients: one round with the convolutions as
    gathered patches + matmul equals the round with vmap's grouped convolution in float64."""
    native, gemm = (_sim(small_fed, "FedTTA", "convnet_small", "cpu", False, conv, steps=1, batch=4, lr=0.05,
                         inner_lr=0.1) for conv in ("native", "gemm"))
    native.run_round(0)
    gemm.run_round(0)
    _assert_states_close(gemm.server_state, native.server_state, 1e-10)
    calls = []

    class Spy(GemmConv):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(func is torch.conv2d)
            return super().__torch_function__(func, types, args, kwargs)

    with Spy():
        gemm.algorithm.forward(gemm.server_state["params"], gemm.x[:2])
    assert sum(calls) == 2  # the ConvNet's two convolutions went through the GEMM form


@pytest.mark.parametrize("call", ["positional", "keywords", "bias keyword", "module", "string padding"])
def test_bf16_convolution_takes_every_form_of_the_call(call: str) -> None:
    """However torch.conv2d is called, Bf16Conv computes it in bfloat16 and returns the input's dtype."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((2, 3, 8, 8), (4, 3, 3, 3), (4,)))
    module = torch.nn.Conv2d(3, 4, 3, padding=1).double()
    calls = {"positional": lambda: F.conv2d(x, w, b, 1, 1), "keywords": lambda: F.conv2d(input=x, weight=w, bias=b,
                                                                                        padding=1),
             "bias keyword": lambda: F.conv2d(x, w, bias=b, padding=1), "module": lambda: module(x),
             "string padding": lambda: F.conv2d(x, w, b, 1, "same")}
    want = calls[call]()
    with Bf16Conv():
        got = calls[call]()
    assert got.dtype == torch.float64 and got.shape == want.shape
    rel = float(((got - want).abs().max() / want.abs().max()).detach())
    assert 1e-6 < rel < 2e-2  # bf16's rounding: not float64's, and not more


def test_bf16_convolutions_round_the_update_and_are_part_of_the_runs_identity(small_fed) -> None:  # type: ignore[no-untyped-def]
    """FedTTA's second-order round on the ConvNet with the clients' convolutions in bfloat16: every tensor's update
    is the native round's up to bf16 rounding (within a quarter of the update's size; measured: at most a tenth),
    not equal to it (the path is taken), and a bf16 run does not resume a float32 run's checkpoint."""
    native, bf16 = (_sim(small_fed, "FedTTA", "convnet_small", "cpu", False, conv, steps=1, batch=4, lr=0.05,
                         inner_lr=0.1) for conv in ("native", "bf16"))
    start = {key: {n: t.clone() for n, t in native.server_state[key].items()} for key in ("params", "phi")}
    native.run_round(0)
    bf16.run_round(0)
    diffs = []
    for key in ("params", "phi"):
        for name, ref in native.server_state[key].items():
            got = bf16.server_state[key][name]
            assert got.dtype == torch.float64 and bool(torch.isfinite(got).all())
            diff, step = float((got - ref).abs().max()), float((ref - start[key][name]).abs().max())
            assert diff <= 0.25 * step, (key, name, diff, step)
            diffs.append(diff)
    assert max(diffs) > 1e-7
    assert bf16.cfg.identity()["batched_conv"] == "bf16" and "batched_conv" not in native.cfg.identity()
    assert bf16.fingerprint != native.fingerprint


def test_batched_conv_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FL_BATCHED_CONV", raising=False)
    assert RunConfig().batched_conv == "native"
    monkeypatch.setenv("FL_BATCHED_CONV", "gemm")  # how the lease scripts switch `fl-server bench` to the GEMM path
    assert RunConfig().batched_conv == "gemm"
    assert RunConfig(batched_conv="native").batched_conv == "native"
    assert "batched_conv" not in RunConfig().identity()  # a run resumes whichever path its checkpoint came from


def test_gemm_matrix_products_take_the_convolutions_precision() -> None:
    """Inside GemmConv, CUDA matrix products may use TF32 exactly where cuDNN's convolutions may; restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for conv_tf32 in (True, False):
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv_tf32, False
            with GemmConv():
                assert torch.backends.cuda.matmul.allow_tf32 is conv_tf32
                with GemmConv(tf32=not conv_tf32):
                    assert torch.backends.cuda.matmul.allow_tf32 is (not conv_tf32)
                assert torch.backends.cuda.matmul.allow_tf32 is conv_tf32
            assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_unknown_batched_conv_is_refused(small_fed) -> None:  # type: ignore[no-untyped-def]
    sim = _sim(small_fed, "FedAvg", "mlp", "cpu", False, "winograd")
    with pytest.raises(ValueError, match="unknown batched_conv 'winograd'; use 'native', 'gemm', 'bf16'"):
        sim.run_round(0)


@cuda
@pytest.mark.parametrize("method,model,conv,hp", [
    ("FedTTA-Prox", "mlp", "native", {"mu": 0.1}),
    ("FedTTA", "convnet", "native", {"lr": 0.05, "inner_lr": 0.1}),
    ("FedTTA", "convnet", "gemm", {"lr": 0.05, "inner_lr": 0.1}),
    ("FedTTA", "convnet", "bf16", {"lr": 0.05, "inner_lr": 0.1}),
    ("FedAvg", "convnet", "native", {"lr": 0.1})])
def test_graphed_rounds_equal_eager_rounds_on_cuda(small_fed, method: str, model: str, conv: str, hp: dict) -> None:  # type: ignore[no-untyped-def]
    """Three rounds (the first records the graph, the next two replay it) equal the eager engine's in float64 (the
    native eager round; a bf16 graph, which rounds otherwise, the eager bf16 round)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    # cuDNN may pick non-deterministic (atomic) kernels for bf16 gradients: the same kernels twice must agree
    deterministic, torch.backends.cudnn.deterministic = torch.backends.cudnn.deterministic, conv == "bf16"
    try:
        _graphed_equals_eager(small_fed, method, model, conv, hp)
    finally:
        torch.backends.cudnn.deterministic = deterministic


def _graphed_equals_eager(small_fed, method: str, model: str, conv: str, hp: dict) -> None:  # type: ignore[no-untyped-def]
    eager = _sim(small_fed, method, model, "cuda", False, "bf16" if conv == "bf16" else "native", **hp)
    graphed = _sim(small_fed, method, model, "cuda", True, conv, **hp)
    assert eager.graphed is None and graphed.graphed is not None
    for r in range(3):
        eager.run_round(r)
        graphed.run_round(r)
    assert (graphed.graphed.captures, graphed.graphed.replays) == (1, 2)
    _assert_states_close(graphed.server_state, eager.server_state, 1e-10)


@cuda
def test_stacked_graphed_rounds_equal_solo_eager_rounds_on_cuda(mnist_all) -> None:  # type: ignore[no-untyped-def]
    """Two seeds' FedTTA rounds on the ConvNet stepped together and replayed as one graph (what a stacked table row
    runs on a GPU) equal each seed's eager rounds alone in float64."""
    from fl_server.engine.stacked import stacked_round

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    feds = [make_federated(mnist_all.subset(np.arange(3000)), "pathological", 12, seed=s) for s in (0, 1)]
    hp = {"lr": 0.05, "inner_lr": 0.1}
    alone = [_sim(fed, "FedTTA", "convnet", "cuda", False, seed=s, **hp) for s, fed in enumerate(feds)]
    together = [_sim(fed, "FedTTA", "convnet", "cuda", True, seed=s, **hp) for s, fed in enumerate(feds)]
    for r in range(3):
        for sim in alone:
            sim.run_round(r)
        stacked_round(together, r, together[0].graphed)
    assert (together[0].graphed.captures, together[0].graphed.replays) == (1, 2)
    for got, want in zip(together, alone):
        _assert_states_close(got.server_state, want.server_state, 1e-10)


@cuda
def test_methods_with_round_dependent_steps_are_not_graphed(small_fed) -> None:  # type: ignore[no-untyped-def]
    """MAP's step reads its phase from Python state: it is never recorded."""
    sim = _sim(small_fed, "MAP", "mlp", "cuda", graphs=True)
    assert sim.graphed is None


def test_batchnorm_models_are_not_graphed() -> None:
    """StatBatchNorm2d switches its statistics by a Python attribute, which a recorded graph would freeze."""
    from fl_server.engine.simulation import graphable

    assert not graphable(build_model("resnet8_bn", (3, 32, 32), 10, seed=0))
    assert graphable(build_model("convnet", (1, 28, 28), 10, seed=0))
