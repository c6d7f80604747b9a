"""One column of the Jacobian (plain forward-mode autograd) against the dense autograd Jacobian."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import problem
from torch.autograd.functional import jacobian
from torch.func import functional_call

from avionics.curvature import JacobianOperator


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_one_column_against_the_dense_jacobian(name):
    model, _, data, _ = problem(name)
    J = JacobianOperator(model, None, data)
    names = J.param_names
    params = dict(model.named_parameters())
    flat = torch.cat([params[n].detach().flatten() for n in names])

    def outputs(theta):
        tensors, start = {}, 0
        for n in names:
            tensors[n] = theta[start : start + params[n].numel()].view_as(params[n])
            start += params[n].numel()
        return torch.cat([functional_call(model, tensors, (X,)) for X, _ in data]).flatten()

    dense = jacobian(outputs, flat)
    v = torch.randn(J.shape[1], dtype=J.dtype, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(J @ v, dense @ v)
