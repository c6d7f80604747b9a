"""The operators on a CNN, a transformer (sequence output, attention) and a dict-input model."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import (
    dense_empirical_fisher,
    dense_ggn,
    dense_hessian,
    dense_jacobian,
    problem,
)

from avionics.curvature import (
    EFOperator,
    GGNOperator,
    HessianOperator,
    JacobianOperator,
    TransposedJacobianOperator,
)

CURVATURES = {
    "hessian": (HessianOperator, dense_hessian),
    "ggn": (GGNOperator, dense_ggn),
    "ef": (EFOperator, dense_empirical_fisher),
}


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


@pytest.mark.parametrize("name", ["cnn", "transformer", "dict"])
@pytest.mark.parametrize("curvature", CURVATURES)
def test_cnn_transformer_dict_input(curvature, name):
    model, loss_fn, data, batch_size_fn = problem(name, "ce" if name != "dict" else "mse")
    operator, reference = CURVATURES[curvature]
    A = operator(model, loss_fn, None, data, batch_size_fn=batch_size_fn)
    expected = reference(model, loss_fn, data)
    torch.testing.assert_close(dense(A), expected)
    assert expected.abs().max() > 1e-3  # the comparison is not vacuous


@pytest.mark.parametrize("name", ["mlp", "transformer", "dict"])
def test_jacobian_and_transpose(name):
    model, _, data, batch_size_fn = problem(name)
    J = JacobianOperator(model, None, data, batch_size_fn=batch_size_fn)
    JT = TransposedJacobianOperator(model, None, data, batch_size_fn=batch_size_fn)
    expected = dense_jacobian(model, data)
    torch.testing.assert_close(dense(J), expected)
    torch.testing.assert_close(dense(JT), expected.T)
    torch.testing.assert_close(dense(J.adjoint()), expected.T)
    assert isinstance(JT.adjoint(), JacobianOperator)
    # J^T J is a lazy product
    torch.testing.assert_close(dense(JT @ J), expected.T @ expected)
