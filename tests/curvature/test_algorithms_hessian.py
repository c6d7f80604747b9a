"""The algorithms on a real curvature operator: the Hessian of a tiny MLP (dense reference by
double backward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from avionics.curvature.algorithms import (
    conjugate_gradient,
    frobenius_norm_squared,
    hutchinson_diagonal,
    spectral_density,
    top_eigenpairs,
    xdiag,
    xtrace,
)

curvature = pytest.importorskip("avionics.curvature")
DT = torch.float64


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    data = [(torch.randn(7, 5, dtype=DT), torch.randint(0, 3, (7,))) for _ in range(2)]
    loss_fn = nn.CrossEntropyLoss()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat):
        ps, i = {}, 0
        for n, s in zip(names, shapes, strict=True):
            ps[n] = flat[i : i + s.numel()].reshape(s)
            i += s.numel()
        X = torch.cat([x for x, _ in data])
        y = torch.cat([t for _, t in data])
        return loss_fn(functional_call(model, ps, (X,)), y)

    H = torch.autograd.functional.hessian(loss, theta)
    op = curvature.HessianOperator(model, loss_fn, None, data, check_deterministic=False)
    return op, H


def test_on_hessian_operator(problem):
    op, H = problem
    assert op.shape == H.shape
    evals = torch.linalg.eigvalsh(H)
    top = top_eigenpairs(op, 2, tol=1e-4, seed=0)
    assert top.converged
    torch.testing.assert_close(top.values, evals.flip(0)[:2], rtol=1e-6, atol=1e-9)
    D = H.shape[0]
    torch.testing.assert_close(xtrace(op, 2 * D, seed=0), torch.trace(H), rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(xdiag(op, 2 * D, seed=0), torch.diagonal(H), rtol=1e-6, atol=1e-8)
    # Same probes through the operator and through the dense Hessian.
    Z = 2 * torch.randint(0, 2, (64, D), generator=torch.Generator().manual_seed(0)).T.to(DT) - 1
    ref = (Z * (H @ Z)).mean(1)
    torch.testing.assert_close(hutchinson_diagonal(op, 64, seed=0), ref, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(frobenius_norm_squared(op), (H**2).sum())
    res = spectral_density(op, num_probes=4, num_steps=10, seed=0)
    assert evals[0] - 1e-10 <= res.lower < evals[0] + 0.05 * (evals[-1] - evals[0])
    assert res.upper == pytest.approx(float(evals[-1]), rel=1e-6)
    # Damped solve with the colleague's identity: (H + lambda I) x = b.
    damping = 2 * float(evals.abs().max())  # positive definite, condition number <= 3
    A = op + damping * curvature.IdentityOperator(op)
    B = torch.randn(D, 3, generator=torch.Generator().manual_seed(0), dtype=DT)
    sol = conjugate_gradient(A, B, tol=1e-10)
    assert sol.converged.all()
    exact = torch.linalg.solve(H + damping * torch.eye(D, dtype=DT), B)
    torch.testing.assert_close(sol.solution, exact, rtol=1e-7, atol=1e-9)
