"""A recipe's model: a zoo name or the user's own ``torch.nn.Module`` (:class:`ModelSpec`), as a
:class:`~fl_server.models.Classifier` (``features`` then a linear ``head``), which every method builds on.

>>> from torch import nn
>>> from fl_server.recipes import ModelSpec
>>> class Net(nn.Module):
...     def __init__(self, input_shape, num_classes):
...         super().__init__()
...         self.body = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0] * input_shape[1] * input_shape[2], 32),
...                                   nn.ReLU())
...         self.fc = nn.Linear(32, num_classes)
...     def forward(self, x):
...         return self.fc(self.body(x))
>>> ModelSpec(Net, head="fc").build((1, 8, 8), 10, seed=0).feature_dim
32
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Union

import torch
from torch import nn

from fl_server.models import MODELS, Classifier, build_model
from fl_server.models.norm import convert_batchnorm
from fl_server.recipes.errors import RecipeError

InputShape = tuple[int, int, int]
HeadSplit = Callable[[nn.Module], tuple[nn.Module, nn.Module]]


@dataclass(frozen=True)
class ModelSpec:
    """The user's model: ``factory(input_shape (C, H, W), num_classes) -> nn.Module`` and where its linear head is:
    ``head`` is the attribute name of the last ``nn.Linear`` (dotted for nested ones: ``"classifier.2"``), which
    ``forward`` applies last, or a callable ``model -> (features, head)``. ``name`` labels runs and bundles."""

    factory: Callable[[InputShape, int], nn.Module]
    head: Union[str, HeadSplit] = "fc"
    name: str = ""

    def __post_init__(self) -> None:
        if not callable(self.factory):
            raise RecipeError(f"model: ModelSpec factory must be callable (input_shape, num_classes) -> nn.Module, "
                              f"got {type(self.factory).__name__}")
        if not (isinstance(self.head, str) and self.head) and not callable(self.head):
            raise RecipeError("model: ModelSpec head must name the linear head attribute (e.g. 'fc') or be a "
                              "callable model -> (features, head)")

    @property
    def label(self) -> str:
        return self.name or getattr(self.factory, "__name__", "custom")

    def build(self, input_shape: InputShape, num_classes: int, seed: int | None = None) -> Classifier:
        """A fresh classifier (weights seeded by ``seed``, the global torch RNG untouched)."""
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            net = self.factory(tuple(input_shape), num_classes)  # type: ignore[arg-type]
        if not isinstance(net, nn.Module):
            raise RecipeError(f"model: the factory returned {type(net).__name__}, not a torch.nn.Module")
        # nn.BatchNorm2d -> StatBatchNorm2d: its statistics live outside the functional state (federated after
        # training, applied on the device by the bundle's batch_norm rule; docs/edge-architectures.md)
        net = convert_batchnorm(net)
        x, whole = _probe(net, input_shape)  # before the split: the head is cut out of the net in place
        features, head = self._split(net)
        if not isinstance(head, nn.Linear):
            raise RecipeError(f"model: the head ({_where(self.head)}) is {type(head).__name__}, not torch.nn.Linear; "
                              f"the methods need a linear head on the features: name the model's last nn.Linear "
                              f"(ModelSpec(head='fc')) or split it with head=callable(model) -> (features, linear)")
        if head.out_features != num_classes:
            raise RecipeError(f"model: the head has {head.out_features} outputs but the data has {num_classes} "
                              f"classes; build the head with num_classes outputs (the factory receives it)")
        clf = Classifier(features, head.in_features, num_classes, tuple(input_shape), None,  # type: ignore[arg-type]
                         head=head)
        if whole is not None and not _same_output(clf, x, whole):
            raise RecipeError(f"model: {type(net).__name__}.forward does not return its head's output (it differs "
                              f"from head(features(x)) on a random batch: a softmax, log_softmax or other function "
                              f"after the head?); return the head's logits; the methods apply softmax themselves")
        return clf

    def _split(self, net: nn.Module) -> tuple[nn.Module, nn.Module]:
        if callable(self.head):
            parts = self.head(net)
            if not (isinstance(parts, tuple) and len(parts) == 2 and isinstance(parts[0], nn.Module)):
                raise RecipeError("model: the head callable must return (features module, head module)")
            return parts
        try:
            head = net.get_submodule(self.head)
        except AttributeError:
            raise RecipeError(f"model: {type(net).__name__} has no submodule {self.head!r}; name its linear head "
                              f"(ModelSpec(head='classifier')) or pass head=callable(model) -> (features, head)") from None
        parent, _, leaf = self.head.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, leaf, nn.Identity())  # net(x) now gives the features
        return net, head


def _probe(net: nn.Module, input_shape: InputShape) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a small random batch, the user's whole ``forward`` on it in eval mode), or None for the output when the
    forward fails on it (:func:`check_classifier` reports that). The global torch RNG is untouched."""
    x = torch.rand((2, *input_shape), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), _eval(net), _same_draws():
            return x, net(x)
    except Exception:  # noqa: BLE001 - any failure of the user's forward is reported by check_classifier
        return x, None


def _same_output(clf: Classifier, x: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``head(features(x))`` is what the user's forward gave: the engine trains and serves the former."""
    try:
        with torch.no_grad(), _eval(clf), _same_draws():
            split = clf(x)
    except Exception:  # noqa: BLE001 - a split that fails is reported by check_classifier
        return True
    return isinstance(whole, torch.Tensor) and whole.shape == split.shape and bool(
        torch.allclose(whole, split, rtol=1e-4, atol=1e-5))


@contextlib.contextmanager
def _same_draws() -> Iterator[None]:
    """The global torch RNG at a fixed seed inside the block and as it was after: a forward that draws random
    numbers draws the same ones in the whole model and in its split (:func:`_check_deterministic` refuses it)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


class _eval:
    """Eval mode (dropout off, no running-statistics updates) inside the block; the modes are restored after."""

    training = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.modes = [m.training for m in module.modules()]

    def __enter__(self) -> None:
        self.module.train(self.training)

    def __exit__(self, *exc: object) -> None:
        for m, mode in zip(self.module.modules(), self.modes):
            m.training = mode


class _train(_eval):
    """Training mode inside the block; the modes are restored after."""

    training = True


def _where(head: Union[str, HeadSplit]) -> str:
    return f"attribute {head!r}" if isinstance(head, str) else "returned by the head callable"


def build_classifier(model: Union[str, ModelSpec], input_shape: InputShape, num_classes: int,
                     seed: int | None = None) -> Classifier:
    """A zoo model by name or the user's :class:`ModelSpec`, for inputs ``[N, *input_shape]``."""
    if isinstance(model, ModelSpec):
        return model.build(input_shape, num_classes, seed)
    if model not in MODELS:
        raise RecipeError(f"model: unknown zoo model {model!r}; choose one of {', '.join(MODELS)} or pass "
                          f"ModelSpec(factory, head) for your own nn.Module")
    return build_model(model, input_shape, num_classes, seed=seed)


def check_classifier(clf: Classifier, input_shape: InputShape) -> None:
    """Raise :class:`RecipeError` unless ``clf`` reads a batch of ``input_shape`` and its features are
    ``[N, D]`` with D the head's input width, and it keeps no buffers (the engine's state is parameters only) and no
    layer that is random in training mode (dropout), and that its forward is deterministic and the same in training
    and eval mode."""
    for name, buf in clf.named_buffers():
        owner = clf.get_submodule(name.rpartition(".")[0]) if "." in name else clf
        fix = ("use nn.LayerNorm for features of shape [N, C] (nn.BatchNorm2d is converted, BatchNorm1d/3d are not)"
               if isinstance(owner, (nn.BatchNorm1d, nn.BatchNorm3d)) else
               "use nn.BatchNorm2d (converted), fl_server.models.norm.StatBatchNorm2d or nn.GroupNorm")
        raise RecipeError(f"model: {type(owner).__name__} at {name.rpartition('.')[0] or 'the top'} keeps buffer "
                          f"{name.rpartition('.')[2]!r} (e.g. BatchNorm running statistics), which the functional "
                          f"engine cannot carry; {fix}")
    for name, module in clf.named_modules():
        if isinstance(module, (nn.modules.dropout._DropoutNd, nn.RReLU)):  # random in training mode only
            raise RecipeError(f"model: {type(module).__name__} at {name or 'the top'} draws random numbers in "
                              f"training mode, where the engine validates and tests the model, and a device runs it "
                              f"in eval mode: the accuracy training reports would not be the device's; remove it")
    shape = [2, *input_shape]
    try:
        with torch.no_grad():
            z = clf.features(torch.zeros(shape))
    except Exception as exc:  # noqa: BLE001 - any failure of the user's forward is the same mistake
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(f"model: a batch of the data's shape {shape} fails in the model's forward ({first}); "
                          f"build the model for input_shape (the factory receives it) or resize the images "
                          f"(Preprocess(size=(H, W)))") from None
    if z.ndim != 2 or z.shape[1] != clf.feature_dim:
        raise RecipeError(f"model: the features (everything before the head) give shape {list(z.shape)} but the head "
                          f"reads {clf.feature_dim} values per sample; flatten the features to [N, "
                          f"{clf.feature_dim}] before the head")
    _check_deterministic(clf, input_shape)


def _check_deterministic(clf: Classifier, input_shape: InputShape) -> None:
    """RecipeError unless the forward gives the same batch the same logits twice in training mode and once in eval
    mode: the engine validates and tests in training mode, the device runs the exported eval-mode graph, so
    randomness in ``forward`` (``F.dropout``, added noise) or a branch on ``self.training`` would make the accuracy
    training reports not the device's. Batch normalisation does not depend on the mode here (StatBatchNorm2d)."""
    x = torch.rand((4, *input_shape), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        with _train(clf):
            first, second = clf(x), clf(x)
        with _eval(clf):
            evaluated = clf(x)
    if not torch.allclose(first, second, rtol=1e-5, atol=1e-6):
        raise RecipeError("model: the forward gives one batch other logits each time in training mode (it draws "
                          "random numbers: F.dropout, added noise?), where the engine validates and tests the model, "
                          "while a device runs it in eval mode: the accuracy training reports would not be the "
                          "device's; make forward deterministic")
    if not torch.allclose(first, evaluated, rtol=1e-5, atol=1e-6):
        raise RecipeError("model: the forward computes otherwise in training and in eval mode (a branch on "
                          "self.training, F.dropout(training=self.training)?): the engine validates and tests the "
                          "model in training mode, a device runs it in eval mode, so the accuracy training reports "
                          "would not be the device's; compute the same in both modes")
