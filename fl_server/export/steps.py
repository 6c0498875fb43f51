"""The graphs a device runs, as pure functions of (x, weights), ready for :func:`fl_server.export.graphs.export_function`.

Each builder returns a :class:`StepSpec`: the function, example inputs, and ONNX input/output names.
Weight inputs are named ``psi.<param>`` (base model) and ``phi.<param>`` (FedTTA's adaptation model);
updated weights come back as ``new.<param>``.
- ``forward_spec``: (x, psi) -> logits                         plain inference with the device's weights
- ``fedtta_step_spec``: (x, psi, phi) -> (new psi, logits, entropy)   one step of UPFL Eq. 5 on the batch
- ``tent_step_spec``: (x, psi) -> (new psi, logits, entropy)   one SGD step on the mean prediction entropy
- ``encoder_spec``: (x, gamma) -> embedding [E]               ODPFL-HN's client encoder g_gamma (Eq. 1)
``logits`` and ``entropy`` (mean prediction entropy, natural log) are those of the *updated* weights, which is
what FedTTA++'s early stopping needs. Each device step kind has one registered graph builder
(:func:`register_step_graph`, :data:`STEP_GRAPHS`); :func:`device_specs` picks it by the method's ``device_step``.

Batch-normalised models (:class:`fl_server.models.norm.StatBatchNorm2d`) take two more kinds of input after the
weights: ``stats.<layer>.mean`` / ``stats.<layer>.var`` (the population statistics) and ``bn_momentum``, a
float32 scalar m: every layer normalises with (1 - m) population + m batch statistics (``"mix"`` mode), so one
graph serves the bundle's whole ``batch_norm`` rule -- m = 0 the frozen forward's population statistics, m = 1 the
original TENT's test-batch statistics, in between an exponential update. Step graphs also return
``new_stats.<layer>.*``, the statistics the updated model normalised this batch with (the device's next
population statistics under the exponential rule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from fl_server.algorithms.base import Algorithm
from fl_server.algorithms.fedtta import FedTTA
from fl_server.algorithms.losses import entropy_from_logits
from fl_server.algorithms.odpfl_hn import ODPFLHN
from fl_server.algorithms.tent import Tent, norm_affine_names
from fl_server.functional import State, make_forward
from fl_server.models import Classifier
from fl_server.models.norm import norm_names, statistics, statistics_inputs, used_statistics

Stats = dict[str, torch.Tensor]


@dataclass
class StepSpec:
    fn: Callable[..., tuple[torch.Tensor, ...]]
    example: list[torch.Tensor]
    input_names: list[str]
    output_names: list[str]
    batch_inputs: tuple[str, ...] = ("x",)
    # inputs baked into the graph as initializers (their example values): frozen graphs (fl_server.export.embed)
    embedded: tuple[str, ...] = ()
    # weight inputs the step never changes (its new.* outputs return them as they came): what frozen_spec embeds
    frozen: tuple[str, ...] = ()
    # inputs that become initializers referring to the bundle's weights of their names, no bytes stored
    # (fl_server.export.embed.embed_inputs(reference=True); the device supplies the values): frozen_spec's
    referenced: tuple[str, ...] = ()


def example_x(model: Classifier, params: State, batch: int) -> torch.Tensor:
    first = next(iter(params.values()))
    shape = getattr(model, "input_shape", None)
    if shape is None:
        raise ValueError("model has no input_shape; build it with fl_server.models.build_model")
    return torch.rand(batch, *shape, dtype=first.dtype)


def with_norm_statistics(spec: StepSpec, model: torch.nn.Module, stats: Stats | None = None,
                         momentum: float = 0.0, return_stats: bool = True) -> StepSpec:
    """``spec`` with the population statistics and ``bn_momentum`` as inputs (and ``new_stats.*`` outputs when
    ``return_stats``) if ``model`` has batch normalisation; else ``spec`` unchanged. ``stats``: default the
    model's own (:func:`fl_server.models.norm.calibrate` must have run)."""
    layers = norm_names(model)
    if not layers:
        return spec
    stats = statistics(model) if stats is None else stats
    stat_names = [f"{layer}.{kind}" for layer in layers for kind in ("mean", "var")]
    n_in = len(spec.example) - 1  # x excluded
    dtype = spec.example[0].dtype

    def fn(x: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with statistics_inputs(model, dict(zip(stat_names, rest[n_in:n_in + len(stat_names)])), rest[-1]):
            out = spec.fn(x, *rest[:n_in])
            used = used_statistics(model) if return_stats else {}
        return (*out, *(used[n] for n in stat_names)) if return_stats else out

    example = [*spec.example, *(stats[n].to(dtype) for n in stat_names), torch.tensor(momentum, dtype=dtype)]
    outputs = [*spec.output_names, *(f"new_stats.{n}" for n in stat_names)] if return_stats else spec.output_names
    return StepSpec(fn, example, [*spec.input_names, *(f"stats.{n}" for n in stat_names), "bn_momentum"],
                    outputs, spec.batch_inputs, spec.embedded, referenced=spec.referenced)


def frozen_spec(spec: StepSpec, frozen: Iterable[str]) -> StepSpec:
    """``spec`` with the weight inputs ``frozen`` (graph input names, e.g. ``psi.features.0.weight``) baked into
    the graph as initializers that refer to the bundle's weights of those names (``referenced``: external data at
    :data:`edge_sdk.shared.FROZEN_LOCATION`, no bytes; the device supplies the bundle's arrays), and their ``new.*``
    outputs -- the unchanged inputs -- dropped. onnxruntime folds and pre-packs constants (a convolution with
    constant weights runs its fast packed kernel), and the device feeds only what the step changes."""
    frozen = tuple(n for n in spec.input_names if n in set(frozen))
    if not frozen:
        return spec
    gone = {f"new.{n.split('.', 1)[1]}" for n in frozen}
    keep = [i for i, n in enumerate(spec.output_names) if n not in gone]

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = spec.fn(*args)
        return tuple(out[i] for i in keep)

    return StepSpec(fn, spec.example, spec.input_names, [spec.output_names[i] for i in keep], spec.batch_inputs,
                    spec.embedded, referenced=(*spec.referenced, *frozen))  # (frozen: none left to freeze)


def referenced_values(spec: StepSpec) -> dict[str, np.ndarray]:
    """The arrays ``spec``'s referenced inputs refer to (its example weights: the bundle's), by graph name: what
    runs its exported graph outside a bundle (``edge_sdk._steps.load_session(path, initializers=...)``)."""
    values = dict(zip(spec.input_names, spec.example))
    return {n: values[n].detach().cpu().numpy() for n in spec.referenced}


def tent_frozen(algorithm: Tent, psi: State) -> list[str]:
    """The inputs TENT's step never changes: every weight but the normalisation layers' scale and shift under
    ``adapt="norm_affine"``, none under ``adapt="all"``."""
    if algorithm.hp.adapt != "norm_affine":
        return []
    moving = set(norm_affine_names(algorithm.model))
    return [f"psi.{n}" for n in psi if n not in moving]


def forward_spec(model: Classifier, params: State, batch: int = 4, stats: Stats | None = None) -> StepSpec:
    names = list(params)
    forward = make_forward(model)

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (forward(dict(zip(names, weights)), x),)

    spec = StepSpec(fn, [example_x(model, params, batch), *params.values()],
                    ["x", *(f"psi.{n}" for n in names)], ["logits"])
    return with_norm_statistics(spec, model, stats, return_stats=False)


def fedtta_step_spec(algorithm: FedTTA, psi: State, phi: State, batch: int = 4,
                     stats: Stats | None = None) -> StepSpec:
    names, phi_names = list(psi), list(phi)

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        new = algorithm.adapt_step(dict(zip(names, weights[:len(names)])), dict(zip(phi_names, weights[len(names):])), x)
        logits = algorithm.forward(new, x)
        return (*(new[n] for n in names), logits, entropy_from_logits(logits).mean())

    spec = StepSpec(fn, [example_x(algorithm.model, psi, batch), *psi.values(), *phi.values()],
                    ["x", *(f"psi.{n}" for n in names), *(f"phi.{n}" for n in phi_names)],
                    [*(f"new.{n}" for n in names), "logits", "entropy"])
    return with_norm_statistics(spec, algorithm.model, stats, momentum=1.0)


def tent_step_spec(algorithm: Tent, psi: State, batch: int = 4, stats: Stats | None = None) -> StepSpec:
    names = list(psi)

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        new = algorithm.entropy_step(dict(zip(names, weights)), x)
        logits = algorithm.forward(new, x)
        return (*(new[n] for n in names), logits, entropy_from_logits(logits).mean())

    spec = StepSpec(fn, [example_x(algorithm.model, psi, batch), *psi.values()],
                    ["x", *(f"psi.{n}" for n in names)], [*(f"new.{n}" for n in names), "logits", "entropy"])
    return with_norm_statistics(spec, algorithm.model, stats, momentum=1.0)


def encoder_spec(algorithm: ODPFLHN, gamma: State, batch: int = 4) -> StepSpec:
    """ODPFL-HN's set encoder on the device: the client's whole unlabeled set x [N, ...] -> e [E]; only e
    leaves the device (the server's hypernetwork turns it into weights). The DP encoder (``dp=True``) also
    outputs the pooled vector m [F] (e = psi(m)), where the device adds its noise (edge_sdk._dp.privatize_pooled)."""
    names = list(gamma)

    def fn(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        g = dict(zip(names, weights))
        if not algorithm.hp.dp:
            return (algorithm.enc_fn(g, x),)
        pooled = algorithm.pooled(g, x)
        return torch.nn.functional.linear(pooled, g["psi.weight"], g["psi.bias"]), pooled

    outputs = ["embedding", "pooled"] if algorithm.hp.dp else ["embedding"]
    return StepSpec(fn, [example_x(algorithm.model, gamma, batch), *gamma.values()],
                    ["x", *(f"gamma.{n}" for n in names)], outputs)


StepGraph = Callable[[Algorithm, State], StepSpec]
# a device step kind (``Algorithm.device_step``) -> its graph builder, from the method and its best state
# (:func:`register_step_graph`); a method that reuses a kind needs nothing here
STEP_GRAPHS: dict[str, StepGraph] = {}


def register_step_graph(kind: str, *, replace: bool = False) -> Callable[[StepGraph], StepGraph]:
    """Decorator: ``builder(algorithm, state) -> StepSpec`` traces the device step ``kind`` of any method whose
    ``device_step`` is ``kind``; ``state`` holds the method's ``device_weights`` (float32 tensors). The built-in
    kinds register here and in :mod:`fl_server.export.fedicon` (imported by the package); a method with a step of
    a new kind registers its builder in its own module, imported before export (a recipe file imports it; a coordinator imports the files its operator names in
    ``FL_SERVE_PLUGINS``). A kind already taken raises ``ValueError`` unless ``replace``.

    >>> @register_step_graph("scaled")
    ... def scaled(algorithm, state):
    ...     return forward_spec(algorithm.model, state["params"])
    >>> STEP_GRAPHS.pop("scaled") is scaled
    True
    """
    if not kind or not isinstance(kind, str):
        raise ValueError(f"a device step kind is a non-empty string, got {kind!r}")

    def add(builder: StepGraph) -> StepGraph:
        known = STEP_GRAPHS.get(kind)
        if known is not None and known is not builder and not replace:
            raise ValueError(f"device step {kind!r} already has a graph builder ({known.__module__}."
                             f"{known.__qualname__}); pick another kind or pass replace=True")
        STEP_GRAPHS[kind] = builder
        return builder

    return add


@register_step_graph("fedtta_step")
def _fedtta_step(algorithm: Algorithm, state: State) -> StepSpec:
    spec = fedtta_step_spec(algorithm, state["params"], state["phi"])  # type: ignore[arg-type]
    spec.frozen = tuple(f"phi.{n}" for n in state["phi"])  # the adaptation model g is fixed on the device
    return spec


@register_step_graph("tent_step")
def _tent_step(algorithm: Algorithm, state: State) -> StepSpec:
    spec = tent_step_spec(algorithm, state["params"])  # type: ignore[arg-type]
    spec.frozen = tuple(tent_frozen(algorithm, state["params"]))  # type: ignore[arg-type]
    return spec


@register_step_graph("encoder")
def _encoder(algorithm: Algorithm, state: State) -> StepSpec:
    return encoder_spec(algorithm, state["enc"])  # type: ignore[arg-type]


def device_specs(algorithm: Algorithm, state: State, freeze: bool = True) -> dict[str, StepSpec]:
    """The graphs of ``algorithm``'s bundle: ``forward`` and its device step (``algorithm.device_step``), by
    the step kind's registered builder (:func:`register_step_graph`). ``freeze`` (default): the weights the step
    never changes (``StepSpec.frozen``: FedTTA's adaptation model, all but the normalisation scale and shift under
    TENT's ``adapt="norm_affine"``) become constants of the step graph (:func:`frozen_spec`), stored once -- in the
    bundle's weights, to which the graph refers: a faster step (onnxruntime pre-packs constant convolutions; TENT
    on resnet8_bn / mobilenet_s, docs/benchmarks/edge-sdk.json) in a bundle no larger. ``freeze=False``: every
    weight a graph input.

    >>> from fl_server.algorithms import build_algorithm
    >>> from fl_server.models import build_model
    >>> tent = build_algorithm("TENT", build_model("mlp", (1, 8, 8), 4, seed=0), 1)
    >>> sorted(device_specs(tent, {"params": dict(tent.model.named_parameters())}))
    ['forward', 'tent_step']
    """
    specs = {"forward": forward_spec(algorithm.model, state["params"])}
    kind = algorithm.device_step
    if kind is not None:
        build = STEP_GRAPHS.get(kind)
        if build is None:
            raise ValueError(f"{algorithm.name}'s device step {kind!r} has no graph builder: register one with "
                             f"@fl_server.export.steps.register_step_graph({kind!r}) in a module imported before export "
                             f"(known: {', '.join(STEP_GRAPHS)})")
        specs[kind] = build(algorithm, state)
        if freeze:
            specs[kind] = frozen_spec(specs[kind], specs[kind].frozen)
    return specs
