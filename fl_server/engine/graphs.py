"""CUDA-graph replay of a round's vmapped local steps.

A round of the vmapped engine is ``T`` local iterations, each one vmapped step over the K selected clients. On
a GPU each step of a small model is thousands of tiny kernels (FedTTA's second-order meta step on the UPFL
ConvNet: about 3,200), so an eager round is bound by the host launching them, not by the GPU running them.
:class:`GraphedLocalSteps` records the whole round (all ``T`` steps) once as a CUDA graph and afterwards replays
it: one launch per round. The replay runs the very kernels the eager round runs, on the same inputs, so results
agree with the eager engine to the last bit up to the GPU's own nondeterminism (atomics in some convolution
backward kernels); ``benchmarks/gpu_engine.py`` measures both and their parity.

What a graph freezes is everything that is not a tensor: step functions, Python numbers they read, tensor
shapes. So only methods that declare their local step a pure function of its tensor arguments and fixed
hyperparameters (``Algorithm.graph_safe``) are graphed, and a graph is keyed by the step functions, the
structure, shapes and dtypes of the states and the batch tensor, and the data tensors it reads.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
from torch.utils import _pytree as pytree

State = dict[str, Any]
StepFn = Callable[[State, State, torch.Tensor, torch.Tensor], State]


def vmapped_round(steps: tuple[StepFn, ...], states: State, server_state: State, x: torch.Tensor,
                  y: torch.Tensor, batches: torch.Tensor, chunk_size: int | None, seed_axis: bool = False) -> State:
    """``steps[t]`` vmapped over the clients (leading axis of ``states``) at iteration t, on batches [K, T, B].
    ``seed_axis``: several runs stepped together (:mod:`fl_server.engine.stacked`): ``states`` [S, K, ...],
    ``server_state`` [S, ...], ``batches`` [S, K, T, B]; a second vmap over the runs, so that each convolution
    is one grouped convolution over all S x K clients."""
    vmapped: dict[StepFn, StepFn] = {}  # one vmapped function per distinct step (phase)
    for t, fn in enumerate(steps):
        if fn not in vmapped:
            over_clients = torch.vmap(fn, in_dims=(0, None, 0, 0), chunk_size=chunk_size)
            vmapped[fn] = torch.vmap(over_clients, in_dims=(0, 0, 0, 0)) if seed_axis else over_clients
        idx = batches[..., t, :]
        states = vmapped[fn](states, server_state, x[idx], y[idx])
    return states


def _signature(tree: Any) -> Hashable | None:
    """Structure, shapes, dtypes and devices of a state's tensors, and the values of its other leaves; None when
    a non-tensor leaf is unhashable (the state then is not graphed)."""
    leaves, spec = pytree.tree_flatten(tree)
    sig: list[Hashable] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append((tuple(leaf.shape), leaf.dtype, str(leaf.device)))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None
            sig.append(("const", leaf))
    return tuple(sig)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static buffers the replay reads: state and server-state tensors, then batches
    output: State  # static buffers the replay writes


class GraphedLocalSteps:
    """Runs :func:`vmapped_round` as a captured CUDA graph, capturing at the first call with a new key and
    replaying afterwards. Holds at most ``max_graphs`` graphs (each keeps its own memory pool), least recently
    used dropped first.

    Example::

        graphed = GraphedLocalSteps()
        states = graphed((step,) * T, states, server_state, x, y, batches, chunk_size=None)  # captures
        states = graphed((step,) * T, states2, server_state2, x, y, batches2, chunk_size=None)  # replays
    """

    def __init__(self, max_graphs: int = 2) -> None:
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._refused: set[Hashable] = set()  # keys whose capture failed: those rounds run eagerly
        self.captures = 0  # how many graphs were recorded (a round that captures runs eagerly)
        self.replays = 0

    def __call__(self, steps: tuple[StepFn, ...], states: State, server_state: State, x: torch.Tensor,
                 y: torch.Tensor, batches: torch.Tensor, chunk_size: int | None, seed_axis: bool = False) -> State:
        state_sig, server_sig = _signature(states), _signature(server_state)
        if state_sig is None or server_sig is None or batches.device.type != "cuda":
            return vmapped_round(steps, states, server_state, x, y, batches, chunk_size, seed_axis)
        key = (steps, state_sig, server_sig, tuple(batches.shape), str(batches.device), id(x), id(y), chunk_size,
               seed_axis)
        if key in self._refused:
            return vmapped_round(steps, states, server_state, x, y, batches, chunk_size, seed_axis)
        entry = self._graphs.get(key)
        if entry is None:
            return self._capture(key, steps, states, server_state, x, y, batches, chunk_size, seed_axis)
        self._graphs.move_to_end(key)
        fresh = [leaf for leaf in pytree.tree_leaves((states, server_state)) if isinstance(leaf, torch.Tensor)]
        for dst, src in zip(entry.inputs, [*fresh, batches]):
            dst.copy_(src)
        entry.graph.replay()
        self.replays += 1
        # the output buffers are overwritten by the next replay: the caller gets its own copy
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.output)

    def _capture(self, key: Hashable, steps: tuple[StepFn, ...], states: State, server_state: State,
                 x: torch.Tensor, y: torch.Tensor, batches: torch.Tensor, chunk_size: int | None,
                 seed_axis: bool) -> State:
        static_states, static_server = pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (states, server_state))
        static_batches = batches.clone()

        def body() -> State:
            return vmapped_round(steps, static_states, static_server, x, y, static_batches, chunk_size, seed_axis)

        # the eager warm-up on a side stream creates the library handles and workspaces a capture cannot; its
        # result, computed from the same inputs, is this call's answer
        side = torch.cuda.Stream(device=batches.device)
        side.wait_stream(torch.cuda.current_stream(batches.device))
        with torch.cuda.stream(side):
            result = body()
        torch.cuda.current_stream(batches.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                output = body()
        except Exception as exc:  # an operation a graph cannot hold (a host sync): this step stays eager
            warnings.warn(f"CUDA graph capture of the local steps failed, running them eagerly: {exc}",
                          RuntimeWarning, stacklevel=3)
            self._refused.add(key)
            torch.cuda.synchronize(batches.device)
            return result
        inputs = [leaf for leaf in pytree.tree_leaves((static_states, static_server)) if isinstance(leaf, torch.Tensor)]
        self._graphs[key] = _Graph(graph, [*inputs, static_batches], output)
        self.captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return result
