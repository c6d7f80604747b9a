"""The Monte-Carlo Fisher: converges to the GGN, repeats its sample, is seedable."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import dense_ggn, problem

from avionics.curvature import MCFisherOperator


def dense(A) -> torch.Tensor:
    return A @ torch.eye(A.shape[1], dtype=A.dtype)


def test_mc_fisher_converges_to_ggn_and_repeats_its_sample():
    model, loss_fn, data, _ = problem("mlp", "ce")
    ggn = dense_ggn(model, loss_fn, data)
    errors = []
    for samples in (1, 100, 10_000):
        F = MCFisherOperator(model, loss_fn, None, data, mc_samples=samples, seed=1)
        errors.append(((dense(F) - ggn).norm() / ggn.norm()).item())
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.03
    F = MCFisherOperator(model, loss_fn, None, data, mc_samples=3, seed=1)
    torch.testing.assert_close(dense(F), dense(F), rtol=0, atol=0)
    other_seed = MCFisherOperator(model, loss_fn, None, data, mc_samples=3, seed=2)
    assert not torch.allclose(dense(F), dense(other_seed))


@pytest.mark.parametrize("loss_name", ["mse", "bce"])
def test_mc_fisher_converges_for_mse_and_bce(loss_name):
    model, loss_fn, data, _ = problem("mlp", loss_name, "sum")
    F = MCFisherOperator(model, loss_fn, None, data, mc_samples=20_000)
    ggn = dense_ggn(model, loss_fn, data)
    assert (dense(F) - ggn).norm() / ggn.norm() < 0.03


def test_mc_fisher_sequence_cross_entropy():
    model, loss_fn, data, _ = problem("transformer", "ce")
    for p in model.parameters():  # the curvature of the LM head only: a small dense matrix
        p.requires_grad_(False)
    model.head.requires_grad_(True)
    F = MCFisherOperator(model, loss_fn, None, data, mc_samples=5000)
    ggn = dense_ggn(model, loss_fn, data)
    assert F.shape == ggn.shape == (25, 25)
    assert (dense(F) - ggn).norm() / ggn.norm() < 0.05
