"""Rewrites of exported ONNX graphs that keep every output bit for bit and cost less on onnxruntime's CPU kernels.

``pool_plane_offsets``. The exporter lowers ``max_pool2d_with_indices`` to ONNX MaxPool, whose indices count over
the whole [N, C, H, W] tensor, and turns them into torch's per-plane indices by subtracting each plane's first
flat index -- which it obtains from a second MaxPool, kernel 1x1 with indices, over the whole input, sliced to
[:, :, :1, :1]. That pass computes N*C*H*W indices to keep N*C of them: for a [64, 32, 28, 28] input it took
about as long as the 2x2 pooling itself. The plane offsets are (n * C + c) * H * W, so the pair
MaxPool(1x1) -> Slice is replaced by Range(0, N * C) * (H * W) reshaped to [N, C, 1, 1] (C, H, W static, N read
from the input's shape at run time).

``pow_to_mul``. ``Pow(x, 2)`` and ``Pow(x, 3)`` with a constant exponent (the derivatives of squares, of ``rsqrt``
and of powers, wherever autograd writes them) become ``x * x`` and ``x * x * x`` (bit for bit what the Pow kernel computes); ``Pow(x, 1)`` becomes ``x``.
onnxruntime's Pow kernel runs its generic path (a call per element); in batch-normalised step graphs the Pow
nodes took 16-32% of the step.

``cancel_transpose_pairs``. A Transpose of a Transpose whose permutations compose to the identity (the exporter
writes them around per-channel gradients and transposed weights: 25 pairs in resnet8_bn's TENT step) is its
input: its readers read that, and Transposes nobody reads any more go.

``recompute_late_reads``. A step graph keeps an activation-sized tensor alive from the forward, where it is made, to
the backward, where it is read again; when it is a cheap elementwise function of tensors that stay alive that long
anyway, recomputing it just before the late read frees it in between. The case it finds is batch normalisation's
centred input ``x - mean``: the forward reads it for the variance, the backward again, while ``x`` (the convolution's
output) is held for the scale's gradient; recomputed, resnet8_bn's FedTTA step (batch 64), run in the graph's order,
holds 36 MB at once instead of 50. The copy computes the same operation on the same inputs: the same bits.

``constant_transposed_convolutions``. The exporter writes a convolution's input gradient as a ConvTranspose of the
output gradient with the convolution's weights W. Where W is a constant of the graph (a step's frozen weights,
:mod:`fl_server.export.embed`) and the stride is 1, the ConvTranspose is the convolution with W' -- each group's W with
input and output channels swapped and its taps reversed -- padded by d (k - 1) - p; W' is computed by nodes from W
(Reshape, Transpose, Reshape, a reversing Slice) that onnxruntime folds into a constant, so the graph holds W once, and
the convolution with a constant kernel runs in onnxruntime's packed layout (mobilenet_s's frozen TENT step 19 -> 17 ms
CPU). Where W is fed, the ConvTranspose stays: as a Conv on a fed W' it ran slower (the ConvNet's 5x5 input gradient
7.6 -> 12.4 ms). The same sums in another order: equal up to float32 rounding.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference


def _ints(node: onnx.NodeProto, name: str) -> list[int] | None:
    for a in node.attribute:
        if a.name == name:
            return list(a.ints)
    return None


def _static_chw(model: onnx.ModelProto, name: str) -> tuple[int, int, int] | None:
    infos = [*model.graph.value_info, *model.graph.input]
    info = next((v for v in infos if v.name == name), None)
    if info is None:
        return None
    dims = info.type.tensor_type.shape.dim
    if len(dims) != 4 or not all(d.HasField("dim_value") for d in dims[1:]):
        return None
    return dims[1].dim_value, dims[2].dim_value, dims[3].dim_value


def pool_plane_offsets(model: onnx.ModelProto) -> int:
    """Apply the rewrite in place wherever the exact pattern occurs; returns how many were rewritten."""
    g = model.graph
    constants = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in g.output}
    rewritten = 0
    for pool in [n for n in g.node if n.op_type == "MaxPool"]:
        if (_ints(pool, "kernel_shape") != [1, 1] or _ints(pool, "strides") not in (None, [1, 1])
                or len(pool.output) != 2 or consumers.get(pool.output[0]) or pool.output[0] in graph_outputs):
            continue
        users = consumers.get(pool.output[1], [])
        if len(users) != 1 or users[0].op_type != "Slice" or len(users[0].input) != 4:
            continue
        cut = users[0]
        starts, ends, axes = (constants.get(name) for name in cut.input[1:4])
        if (starts is None or ends is None or axes is None or starts.tolist() != [0, 0] or ends.tolist() != [1, 1]
                or axes.tolist() != [2, 3]):
            continue
        chw = _static_chw(model, pool.input[0])
        if chw is None:
            continue
        c, h, w = chw
        p = f"{pool.name}_plane_offsets"
        g.initializer.extend([numpy_helper.from_array(np.array([c], np.int64), f"{p}_c"),
                              numpy_helper.from_array(np.array(0, np.int64), f"{p}_zero"),
                              numpy_helper.from_array(np.array(1, np.int64), f"{p}_one"),
                              numpy_helper.from_array(np.array(h * w, np.int64), f"{p}_hw"),
                              numpy_helper.from_array(np.array([-1, c, 1, 1], np.int64), f"{p}_shape")])
        nodes = [helper.make_node("Shape", [pool.input[0]], [f"{p}_n"], start=0, end=1, name=f"{p}_shape_of_x"),
                 helper.make_node("Mul", [f"{p}_n", f"{p}_c"], [f"{p}_nc"], name=f"{p}_times_c"),
                 helper.make_node("Squeeze", [f"{p}_nc"], [f"{p}_nc_scalar"], name=f"{p}_scalar"),
                 helper.make_node("Range", [f"{p}_zero", f"{p}_nc_scalar", f"{p}_one"], [f"{p}_planes"],
                                  name=f"{p}_range"),
                 helper.make_node("Mul", [f"{p}_planes", f"{p}_hw"], [f"{p}_flat"], name=f"{p}_times_hw"),
                 helper.make_node("Reshape", [f"{p}_flat", f"{p}_shape"], [cut.output[0]], name=f"{p}_reshape")]
        at = list(g.node).index(pool)
        g.node.remove(cut)
        g.node.remove(pool)
        for k, node in enumerate(nodes):
            g.node.insert(at + k, node)
        rewritten += 1
    if rewritten:  # the Slice's starts / ends / axes, unless something else reads them
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        for init in [i for i in g.initializer if i.name not in used]:
            g.initializer.remove(init)
    return rewritten


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            return next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), None)
    return None


def pow_to_mul(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every ``Pow`` whose exponent is a constant scalar 1, 2 or 3 (see the module's
    docstring); returns how many were rewritten."""
    g = model.graph
    rewritten = 0
    for node in [n for n in g.node if n.op_type == "Pow"]:
        e = _constant(model, node.input[1])
        if e is None or e.size != 1 or float(e.reshape(())) not in (1.0, 2.0, 3.0):
            continue
        x, y, p = node.input[0], node.output[0], node.name or f"pow{rewritten}"
        power = int(float(e.reshape(())))
        if power == 1 and y not in {o.name for o in g.output}:  # x^1: its readers read x
            for reader in g.node:
                reader.input[:] = [x if i == y else i for i in reader.input]
            g.node.remove(node)
            rewritten += 1
            continue
        nodes = {1: [helper.make_node("Identity", [x], [y], name=f"{p}_x")],
                 2: [helper.make_node("Mul", [x, x], [y], name=f"{p}_xx")],
                 3: [helper.make_node("Mul", [x, x], [f"{p}_xx"], name=f"{p}_xx"),
                     helper.make_node("Mul", [f"{p}_xx", x], [y], name=f"{p}_xxx")]}[power]
        at = list(g.node).index(node)
        g.node.remove(node)
        for k, new in enumerate(nodes):
            g.node.insert(at + k, new)
        rewritten += 1
    if rewritten:  # the exponents, unless something else reads them
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        for init in [i for i in g.initializer if i.name not in used]:
            g.initializer.remove(init)
        for node in [n for n in g.node if n.op_type == "Constant" and n.output[0] not in used]:
            g.node.remove(node)
    return rewritten


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def cancel_transpose_pairs(model: onnx.ModelProto) -> int:
    """Rewrite, in place, the readers of every Transpose(Transpose(x, p), q) with p[q[i]] == i to read ``x`` (see the
    module's docstring) and drop the Transposes no node or output reads then. Returns how many pairs it cancelled.
    Graphs with subgraphs (which may read outer names) are left alone."""
    g = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in g.node for a in n.attribute):
        return 0
    producer = {y: n for n in g.node for y in n.output}
    outputs = {o.name for o in g.output}
    alias: dict[str, str] = {}
    for node in g.node:
        node.input[:] = [alias.get(x, x) for x in node.input]
        first = producer.get(node.input[0]) if node.op_type == "Transpose" else None
        p, q = (_perm(first), _perm(node)) if first is not None and first.op_type == "Transpose" else (None, None)
        if p is None or q is None or node.output[0] in outputs or [p[i] for i in q] != list(range(len(p))):
            continue
        alias[node.output[0]] = first.input[0]
    while True:  # the Transposes nobody reads any more
        read = {x for n in g.node for x in n.input} | outputs
        dead = [n for n in g.node if n.op_type == "Transpose" and n.output[0] not in read]
        if not dead:
            return len(alias)
        for n in dead:
            g.node.remove(n)


NOMINAL_BATCH = 64  # the size a symbolic (batch) dimension counts as when recompute_late_reads weighs tensors
RECOMPUTED_OPS = ("Sub",)
MIN_GAP = 20  # nodes between two reads of a tensor before recomputing it for the later one is worth a node


def _elements(model: onnx.ModelProto) -> dict[str, int]:
    """Elements of every tensor whose shape inference knows the rank (symbolic dimensions count NOMINAL_BATCH)."""
    g = shape_inference.infer_shapes(model).graph
    out = {t.name: int(np.prod(t.dims)) for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.tensor_type.HasField("shape"):
            out[vi.name] = int(np.prod([d.dim_value or NOMINAL_BATCH for d in vi.type.tensor_type.shape.dim]))
    return out


def recompute_late_reads(model: onnx.ModelProto, ops: tuple[str, ...] = RECOMPUTED_OPS) -> int:
    """Rewrite, in place, the late reads of cheap elementwise results (see the module's docstring): a node of
    ``ops`` whose output is read again more than MIN_GAP nodes after its previous read gets a copy just before that
    read, which it and all later reads then use, when keeping the copy's inputs alive up to there costs less than a
    quarter of what freeing the output earlier saves. Returns how many copies were made."""
    g = model.graph
    size = _elements(model)
    nodes, outputs = list(g.node), {o.name for o in g.output}
    reads: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            reads.setdefault(name, []).append(i)
    copies: dict[int, list[onnx.NodeProto]] = {}
    for node in nodes:
        y = node.output[0] if node.op_type in ops and len(node.output) == 1 else ""
        at = sorted(set(reads.get(y, [])))
        if not y or y in outputs or y not in size or len(at) < 2:
            continue
        for prev, late in zip(at, at[1:]):
            held = sum(size.get(x, 0) * max(0, late - max(reads[x])) for x in node.input)
            if late - prev <= MIN_GAP or 4 * held >= size[y] * (late - prev) or any(x not in size for x in node.input):
                continue
            copy = helper.make_node(node.op_type, list(node.input), [f"{y}_late{len(copies)}"], name=f"{y}_late{len(copies)}")
            copy.attribute.extend(node.attribute)
            copies.setdefault(late, []).append(copy)
            for reader in {i for i in at if i >= late}:
                nodes[reader].input[:] = [copy.output[0] if x == y else x for x in nodes[reader].input]
            break  # the later reads read the copy
    if copies:
        order = [n for i, node in enumerate(nodes) for n in [*copies.get(i, []), node]]
        del g.node[:]
        g.node.extend(order)
    return sum(len(c) for c in copies.values())


def held_at_once(model: onnx.ModelProto) -> int:
    """The most tensor elements the graph's nodes hold at once when they run in the graph's order, each result freed
    after its last read (graph outputs kept; inputs and initializers not counted; symbolic dimensions count
    NOMINAL_BATCH): what onnxruntime's intermediates peak at in that order, in elements."""
    g = model.graph
    size, outputs = _elements(model), {o.name for o in g.output}
    made = {y for node in g.node for y in node.output}
    last = {name: i for i, node in enumerate(g.node) for name in node.input}
    held = peak = 0
    for i, node in enumerate(g.node):
        held += sum(size.get(y, 0) for y in node.output)
        peak = max(peak, held)
        held -= sum(size.get(x, 0) for x in set(node.input) if x in made and last[x] == i and x not in outputs)
    return peak


def constant_transposed_convolutions(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every stride-1 ConvTranspose whose weights are an initializer (and whose padding is at most
    d (k - 1), no output padding) into a Conv with the transposed, reversed kernel (see the module's docstring).
    Returns how many were rewritten."""
    g = model.graph
    constants = {i.name: tuple(i.dims) for i in g.initializer}
    rewritten = 0
    for node in [n for n in g.node if n.op_type == "ConvTranspose"]:
        dims = constants.get(node.input[1]) if len(node.input) > 1 else None
        attrs = {a.name: (list(a.ints) if a.ints else a.i) for a in node.attribute}
        padded_by_name = any(a.name == "auto_pad" and a.s not in (b"", b"NOTSET") for a in node.attribute)
        if dims is None or len(dims) != 4 or len(node.input) > 2 or padded_by_name:
            continue
        kernel, groups = list(dims[2:]), int(attrs.get("group", 1) or 1)
        dilation, pads = attrs.get("dilations", [1, 1]), attrs.get("pads", [0, 0, 0, 0])
        if (attrs.get("strides", [1, 1]) != [1, 1] or any(attrs.get("output_padding", [0, 0]))
                or attrs.get("output_shape") or pads[:2] != pads[2:]
                or any(pads[i] > dilation[i] * (kernel[i] - 1) for i in range(2))):
            continue
        c_in_t, per_group = dims[0], dims[1]  # ConvTranspose weights [C, C' / G, kh, kw]: C the gradient's channels
        p = f"{node.name or node.output[0]}_as_conv"
        flip = kernel != [1, 1]
        g.initializer.extend([
            numpy_helper.from_array(np.array([groups, c_in_t // groups, per_group, *kernel], np.int64), f"{p}_grouped"),
            numpy_helper.from_array(np.array([groups * per_group, c_in_t // groups, *kernel], np.int64), f"{p}_shape"),
            *([numpy_helper.from_array(np.array(v, np.int64), f"{p}_{k}") for k, v in
               (("starts", [-1, -1]), ("ends", [-(2 ** 63)] * 2), ("axes", [2, 3]), ("steps", [-1, -1]))] if flip else [])])
        w = node.input[1]
        nodes = [helper.make_node("Reshape", [w, f"{p}_grouped"], [f"{p}_w0"], name=f"{p}_w0"),
                 helper.make_node("Transpose", [f"{p}_w0"], [f"{p}_w1"], perm=[0, 2, 1, 3, 4], name=f"{p}_w1"),
                 helper.make_node("Reshape", [f"{p}_w1", f"{p}_shape"], [f"{p}_w2" if flip else f"{p}_w"],
                                  name=f"{p}_w2")]
        if flip:
            nodes.append(helper.make_node("Slice", [f"{p}_w2", f"{p}_starts", f"{p}_ends", f"{p}_axes", f"{p}_steps"],
                                          [f"{p}_w"], name=f"{p}_w"))
        conv_pads = [dilation[i] * (kernel[i] - 1) - pads[i] for i in range(2)] * 2
        nodes.append(helper.make_node("Conv", [node.input[0], f"{p}_w"], list(node.output), name=p, group=groups,
                                      dilations=dilation, pads=conv_pads, strides=[1, 1], kernel_shape=kernel))
        at = list(g.node).index(node)
        g.node.remove(node)
        for k, new in enumerate(nodes):
            g.node.insert(at + k, new)
        rewritten += 1
    return rewritten
