"""Lowerings of the ConvNet's TENT step to ONNX, timed on onnxruntime against torch eager (one core, same run).

Each variant is a decomposition table for the trace (:mod:`fl_server.export.decompositions`); all four export the same
step (parity against torch is printed) and are timed with the calls interleaved:
- ``exporter``: only ``convolution_backward`` decomposed (the exporter's lowerings: ReLU's backward a Where,
  max pooling with indices and a scatter backward);
- ``+ ReLU backward as mask``: a 0/1 mask multiply;
- ``product``: ``fl_server.export.decompositions.DECOMPOSITIONS`` (also the max-pool backward without indices);
- ``+ weight gradient as patch products``: dL/dW of an ungrouped convolution as one MatMul per kernel offset,
  dL/dy [C_out, N*Ho*Wo] @ x_ij [N*Ho*Wo, C_in] (patch extraction by strided slices of the channels-last input).

    python lab/research/probe_conv_step.py [--batch 64] [--repeats 20] [--data-dir DIR] [--out FILE]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fl_server.export.graphs as graphs  # noqa: E402
from edge_sdk._steps import load_session  # noqa: E402
from fl_server.export import export_spec, tent_step_spec  # noqa: E402
from fl_server.export.decompositions import DECOMPOSITIONS, _grad_weight, convolution_backward  # noqa: E402
from fl_server.algorithms import build_algorithm  # noqa: E402
from fl_server.data import load_dataset  # noqa: E402
from fl_server.models import build_model  # noqa: E402
from timing import interleaved_median_ms  # noqa: E402

aten = torch.ops.aten


def grad_weight_patches(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, stride: list[int],
                        padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    if groups != 1:
        return _grad_weight(grad_output, input, weight, stride, padding, dilation, groups)
    ho, wo = grad_output.shape[2], grad_output.shape[3]
    x = F.pad(input, (padding[1], padding[1], padding[0], padding[0])).permute(0, 2, 3, 1)  # [N, Hp, Wp, C_in]
    g = grad_output.transpose(0, 1).reshape(grad_output.shape[1], -1)  # [C_out, N*Ho*Wo]
    taps = []
    for i in range(weight.shape[2]):
        for j in range(weight.shape[3]):
            a, b = i * dilation[0], j * dilation[1]
            tap = x[:, a:a + (ho - 1) * stride[0] + 1:stride[0], b:b + (wo - 1) * stride[1] + 1:stride[1], :]
            taps.append(g @ tap.reshape(-1, input.shape[1]))
    return torch.stack(taps, dim=2).view(weight.shape)


def patches_convolution_backward(*args: Any) -> Any:
    grad_output, input, weight, _, stride, padding, dilation, _, _, groups, mask = args
    grad_input, _, grad_bias = convolution_backward(*args[:-1], [mask[0], False, mask[2]])
    grad_weight = grad_weight_patches(grad_output, input, weight, stride, padding, dilation, groups) if mask[1] else None
    return grad_input, grad_weight, grad_bias


VARIANTS: dict[str, dict[Any, Callable[..., Any]]] = {
    "exporter": {aten.convolution_backward.default: convolution_backward},
    "+ ReLU backward as mask": {k: v for k, v in DECOMPOSITIONS.items()
                                if k != aten.max_pool2d_with_indices_backward.default},
    "product (+ max-pool without indices)": dict(DECOMPOSITIONS),
    "+ weight gradient as patch products": {**DECOMPOSITIONS,
                                            aten.convolution_backward.default: patches_convolution_backward},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    x = torch.from_numpy(load_dataset("mnist", root=args.data_dir, split="test").x[:args.batch])
    tent = build_algorithm("TENT", build_model("convnet", (1, 28, 28), 10, seed=0), 1, lr=0.1)
    spec = tent_step_spec(tent, tent.init_state(torch.float32, torch.device("cpu"))["params"])
    feeds = dict(zip(spec.input_names, [x.numpy(), *(w.detach().numpy() for w in spec.example[1:])]))
    want = [t.detach().numpy() for t in spec.fn(x, *spec.example[1:])]
    runs, diffs = {}, {}
    saved = dict(graphs.DECOMPOSITIONS)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for k, (name, table) in enumerate(VARIANTS.items()):
                graphs.DECOMPOSITIONS.clear()
                graphs.DECOMPOSITIONS.update(table)
                session = load_session(export_spec(spec, Path(tmp) / f"v{k}.onnx"), threads=1)
                diffs[name] = max(float(np.abs(g - w).max()) for g, w in zip(session.run(None, feeds), want))
                runs[name] = lambda session=session: session.run(None, feeds)
        finally:
            graphs.DECOMPOSITIONS.clear()
            graphs.DECOMPOSITIONS.update(saved)
        runs["torch eager"] = lambda: spec.fn(x, *spec.example[1:])
        ms = interleaved_median_ms(runs, args.repeats)
    lines = [f"ConvNet TENT step, batch {args.batch}, MNIST, cpu:1 thread, {args.repeats} interleaved repeats, "
             f"load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}",
             f"{'lowering':<40} {'ms':>9} {'torch/this':>10} {'max |ort - torch|':>18}"]
    for name, t in ms.items():
        diff = f"{diffs[name]:.1e}" if name in diffs else ""
        lines.append(f"{name:<40} {t:>9.2f} {ms['torch eager'] / t:>10.3f} {diff:>18}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
