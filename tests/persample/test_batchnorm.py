"""BatchNorm in train mode: the engine's per-sample gradients of its weight and bias are each
sample's share of the batch gradient, against a brute force that gives every sample its own
copy of the affine parameters (float64).

With y_n = x_hat_n * w_n + b_n and every w_n = w (b_n = b), the gradient of the mean loss with
respect to w_n is sample n's share of grad w; the engine's g_n is N times it. x_hat comes from
the layer's own kernel (``F.batch_norm`` on the batch), so the reference shares no formula
with the rule.
"""

from __future__ import annotations

import models
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics.persample import Request


def _shares(model, bn, X, y, loss_fn) -> list[torch.Tensor]:
    """N times d(mean loss) / d(w_n), d(mean loss) / d(b_n): [N, C] each."""
    n = len(X)
    w = bn.weight.detach().expand(n, -1).clone().requires_grad_()
    b = bn.bias.detach().expand(n, -1).clone().requires_grad_()

    def affine_per_sample(module, args, output):
        x_hat = F.batch_norm(args[0], None, None, training=True, eps=module.eps)
        shape = (n, -1) + (1,) * (x_hat.dim() - 2)
        return x_hat * w.reshape(shape) + b.reshape(shape)

    handle = bn.register_forward_hook(affine_per_sample)
    try:
        loss = loss_fn(model(X), y).mean()
    finally:
        handle.remove()
    return [n * g for g in torch.autograd.grad(loss, [w, b])]


@pytest.mark.parametrize(
    ("bn", "shape"),
    [
        (nn.BatchNorm1d(3), (3,)),
        (nn.BatchNorm1d(3), (3, 5)),
        (nn.BatchNorm2d(3), (3, 4, 5)),
        (nn.BatchNorm3d(3), (3, 2, 3, 2)),
    ],
)
def test_train_mode_shares_equal_per_sample_affine_parameters(bn, shape):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Tanh(), bn, nn.Tanh(), nn.Flatten(), nn.LazyLinear(4)).double()
    X = torch.randn(5, *shape, dtype=torch.float64) * 2 + 3  # (a mean far from 0)
    y = torch.randint(0, 4, (5,))
    model(X)  # materialise the lazy layer
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    model.train()

    def loss_fn(out, y):
        return F.cross_entropy(out, y, reduction="none")

    reference = _shares(model, bn, X, y, loss_fn)
    with pytest.warns(UserWarning, match="share of the batch gradient"):
        engine, step, mean_grad, params = models.captured_engine_step(model, X, y, loss_fn)
    other = [torch.randn_like(p) for p in params]
    request = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad", "other"}))
    stats = step.statistics(request, {"grad": mean_grad, "other": other}, sample_mean="grad")
    for p, ref in zip((bn.weight, bn.bias), reference, strict=True):
        k = next(i for i, q in enumerate(params) if q is p)
        torch.testing.assert_close(stats.sq_norms[k], ref.square().sum(1), rtol=1e-10, atol=0)
        torch.testing.assert_close(stats.sum_sq[k], ref.square().sum(0), rtol=1e-10, atol=0)
        for name, v in (("grad", mean_grad[k]), ("other", other[k])):
            torch.testing.assert_close(stats.projections[name][k], ref @ v, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ref.mean(0), mean_grad[k], rtol=1e-10, atol=1e-12)
