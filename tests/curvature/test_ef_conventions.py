"""The empirical Fisher's two conventions: avionics' (the default) and curvlinops' (a datum per
output row, the loss of a datum summed over its outputs), against a brute-force reference of
the stated formula and against curvlinops itself where it is installed."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import Flat, _weights, problem
from torch import nn

from avionics.curvature import EFOperator
from avionics.curvature._data import MathAttention

CASES = [("mlp", "mse"), ("mlp", "bce"), ("mlp", "ce"), ("cnn", "ce"), ("transformer", "ce"),
         ("transformer", "mse"), ("tied", "ce")]  # fmt: skip


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


def dense_curvlinops_ef(model, loss_fn, data):
    """sum_b w_b rho_b sum_r g_r g_r^T, g_r = grad_theta (G_r . f_r(theta)), by a loop over
    the output rows r (the class axis split off) of every batch."""
    flat = Flat(model)
    class_axis = 1 if isinstance(loss_fn, nn.CrossEntropyLoss) else -1
    total = 0
    for w, (X, y) in zip(_weights(loss_fn, data), data):
        output = flat.output(flat.theta, X).detach().requires_grad_()
        (G,) = torch.autograd.grad(loss_fn(output, y), output)
        G_rows = G.movedim(class_axis, -1).reshape(-1, G.shape[class_axis])
        C = G.shape[class_axis]
        rho = 1.0
        if loss_fn.reduction == "mean":
            rho = len(G_rows) * (1 if isinstance(loss_fn, nn.CrossEntropyLoss) else C)
        theta = flat.theta.clone().requires_grad_()
        f_rows = flat.output(theta, X).movedim(class_axis, -1).reshape(-1, C)
        for r in range(len(G_rows)):
            (g,) = torch.autograd.grad(f_rows[r] @ G_rows[r], theta, retain_graph=True)
            total = total + w * rho * torch.outer(g, g)
    return total


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("name", "loss_name"), CASES)
def test_curvlinops_convention_is_its_formula(name, loss_name, reduction):
    model, loss_fn, data, _ = problem(name, loss_name, reduction)
    with MathAttention():
        expected = dense_curvlinops_ef(model, loss_fn, data)
    F = EFOperator(model, loss_fn, None, data, convention="curvlinops")
    torch.testing.assert_close(dense(F), expected)


def test_the_conventions_side_by_side():
    """No positions: equal for CrossEntropyLoss, C times for MSE / BCE with "mean"; with
    positions (the transformer), different."""
    for loss_name, factor in (("ce", 1.0), ("mse", 3.0), ("bce", 3.0)):
        model, loss_fn, data, _ = problem("mlp", loss_name)
        ours = dense(EFOperator(model, loss_fn, None, data))
        theirs = dense(EFOperator(model, loss_fn, None, data, convention="curvlinops"))
        torch.testing.assert_close(theirs, factor * ours)
    model, loss_fn, data, _ = problem("transformer")
    ours = dense(EFOperator(model, loss_fn, None, data))
    theirs = dense(EFOperator(model, loss_fn, None, data, convention="curvlinops"))
    assert (theirs - ours).abs().max() > 1e-3


@pytest.mark.parametrize(("name", "loss_name"), CASES)
def test_curvlinops_convention_equals_curvlinops(name, loss_name):
    curvlinops = pytest.importorskip("curvlinops")
    model, loss_fn, data, _ = problem(name, loss_name)
    params = [p for p in model.parameters() if p.requires_grad]
    with MathAttention():
        reference = curvlinops.EFLinearOperator(model, loss_fn, params, data)
        expected = reference @ torch.eye(reference.shape[1], dtype=torch.float64)
    F = EFOperator(model, loss_fn, None, data, convention="curvlinops")
    torch.testing.assert_close(dense(F), expected)
