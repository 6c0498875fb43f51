"""StatBatchNorm2d (fl_server/models/norm.py) against torch's BatchNorm2d, and the btfl_cnn_bn model in the
functional engine's ways of calling it (vmap over clients, grad)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fl_server.functional import get_params, make_forward
from fl_server.models import build_model
from fl_server.models.norm import StatBatchNorm2d, calibrate, norm_mode


def test_batch_mode_is_batchnorm_in_train_mode() -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 3, 5, 5) * 2 + 1
    ours, ref = StatBatchNorm2d(3), torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 2), ours.bias.uniform_(-1, 1)
        ref.weight.copy_(ours.weight), ref.bias.copy_(ours.bias)
    torch.testing.assert_close(ours(x), ref.train()(x))


def test_population_mode_uses_the_calibrated_statistics() -> None:
    """calibrate over several batches = the mean and biased variance of all their samples; population mode then
    normalises as BatchNorm2d in eval mode with those statistics."""
    torch.manual_seed(1)
    batches = [torch.randn(n, 2, 4, 4) * 3 - 1 for n in (7, 5, 9)]
    norm = StatBatchNorm2d(2)
    calibrate(norm, norm, batches)
    everything = torch.cat(batches)
    torch.testing.assert_close(norm.mean, everything.mean(dim=(0, 2, 3)))
    torch.testing.assert_close(norm.var, everything.var(dim=(0, 2, 3), unbiased=False))
    x = torch.randn(3, 2, 4, 4)
    with norm_mode(norm, "population"):
        got = norm(x)
    assert norm.mode == "batch"  # restored
    torch.testing.assert_close(got, F.batch_norm(x, norm.mean, norm.var, norm.weight, norm.bias, training=False))
    fresh = StatBatchNorm2d(2)
    with norm_mode(fresh, "population"), pytest.raises(RuntimeError, match="run fl_server.models.norm.calibrate"):
        fresh(x)
    with pytest.raises(ValueError, match="unknown normalisation mode 'eval'"):
        with norm_mode(fresh, "eval"):
            pass


def test_bn_cnn_runs_under_vmap_and_grad() -> None:
    """No buffers (get_params accepts it); a vmapped per-client gradient in batch mode equals the per-client
    loop's."""
    model = build_model("btfl_cnn_bn", (1, 28, 28), 10, seed=0)
    params, forward = get_params(model), make_forward(model)
    x = torch.randn(3, 6, 1, 28, 28)

    def grad(p: dict, xb: torch.Tensor) -> dict:
        return torch.func.grad(lambda q: forward(q, xb).logsumexp(-1).mean())(p)

    vmapped = torch.func.vmap(grad, in_dims=(None, 0))(params, x)
    for k in range(3):
        one = grad(params, x[k])
        for name in params:
            torch.testing.assert_close(vmapped[name][k], one[name], rtol=1e-4, atol=1e-6)
