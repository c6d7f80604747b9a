"""HessMaxEV's Lanczos: both memory layouts (per leaf, flat), restarts, the storage's rows,
leaves the Hessian does not reach, sum reduction (the Hessian of the sum: N times the mean's),
the one-product check over steady training and its saved gap; against eigvalsh of the dense
Hessian."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import avionics.curvature.algorithms.lanczos as lanczos
import avionics.quantities.hess_max_ev as hme
from avionics.curvature.algorithms.lanczos import BlockOperator, LanczosState, top_eigenpairs
from avionics.quantities import HessMaxEV
from tests.models import ARCHITECTURES
from tests.quantities.test_curvature_instruments import _run, dense_hessian


def _top(model, X, y, loss_fn) -> float:
    return float(torch.linalg.eigvalsh(dense_hessian(model, X, y, loss_fn))[-1])


@pytest.fixture(params=["flat", "per_leaf"])
def layout(request, monkeypatch):
    """FLAT_BELOW decides the layout by the operator's size: force each."""
    monkeypatch.setattr(lanczos, "FLAT_BELOW", 1 << 40 if request.param == "flat" else 0)
    return request.param


@pytest.mark.parametrize("arch", ["mlp", "cnn", "custom"])
def test_both_layouts_match_eigvalsh_over_many_warm_steps(arch, layout):
    """Eight steps: the start row moves through the storage's spare rows and back to row 0."""
    model, X, y, loss_fn = ARCHITECTURES[arch]()
    q = HessMaxEV(max_products=400)
    checked = []

    def check(step, out):
        assert out["HessMaxEV"] == pytest.approx(_top(model, X, y, loss_fn), rel=1e-3)
        checked.append(step)

    _run(model, X, y, loss_fn, [q], steps=8, lr=0.05, before_update=check)
    assert checked == list(range(8))
    assert max(q.num_products[s] for s in range(1, 8)) < q.num_products[0]
    v = q.eigenvector
    assert v is not None and float(v.norm()) == pytest.approx(1.0, abs=1e-5)


def test_restarts_with_a_small_basis(layout, monkeypatch):
    monkeypatch.setattr(hme, "MAX_BASIS", 3)
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    q = HessMaxEV(tol=1e-5, max_products=2000)
    (out,) = _run(model, X, y, loss_fn, [q])
    assert q.num_products[0] > 3  # it restarted
    assert out["HessMaxEV"] == pytest.approx(_top(model, X, y, loss_fn), rel=1e-5)


class _WithUnused(nn.Module):
    """A linear model with a parameter the loss never reaches (its Hessian block is 0)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x):
        return self.lin(x)


def test_a_parameter_outside_the_graph(layout):
    torch.manual_seed(0)
    model = _WithUnused()
    X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))

    def loss_fn(out, t):
        return nn.functional.cross_entropy(out, t, reduction="none")

    q = HessMaxEV(max_products=400)
    outs = _run(model, X, y, loss_fn, [q], steps=2)
    lam = float(torch.linalg.eigvalsh(_dense_with_unused(model, X, y, loss_fn))[-1])
    assert [o["HessMaxEV"] for o in outs] == [pytest.approx(lam, rel=1e-3)] * 2


def _dense_with_unused(model, X, y, loss_fn):
    W, b = model.lin.weight.detach(), model.lin.bias.detach()
    flat = torch.cat([W.reshape(-1), b]).requires_grad_(True)

    def f(z):
        return loss_fn(X @ z[:12].reshape(3, 4).T + z[12:], y).mean()

    H = torch.autograd.functional.hessian(f, flat)
    dense = torch.zeros(20, 20)
    dense[:15, :15] = H
    return dense


def test_sum_reduction_reports_the_sum_loss_hessian(layout):
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    q = HessMaxEV(max_products=400)
    (out,) = _run(model, X, y, loss_fn, [q], reduction="sum")
    assert out["HessMaxEV"] == pytest.approx(len(X) * _top(model, X, y, loss_fn), rel=1e-3)


def test_float64_and_a_negative_definite_operator(layout):
    """The largest algebraic eigenvalue of -A (A positive definite) is -lambda_min(A)."""
    torch.manual_seed(1)
    D = 40
    Q, _ = torch.linalg.qr(torch.randn(D, D, dtype=torch.float64))
    eig = torch.linspace(1.0, 5.0, D, dtype=torch.float64)
    A = -(Q * eig) @ Q.T
    x = torch.zeros(D, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(0.5 * x @ A @ x, x, create_graph=True)
    hvp = hme._HessianProduct([g], [x])
    state = LanczosState()
    result = top_eigenpairs(
        BlockOperator(hvp, hvp.slices, hvp.dtype, hvp.device),
        tol=1e-8,
        max_products=500,
        max_basis=hme.MAX_BASIS,
        v0=torch.randn(D, dtype=torch.float64),
        criterion="eigenvalue",
        state=state,
    )
    value, x = state.eigenvalue, state.eigenvector
    assert result.converged and value == pytest.approx(-1.0, rel=1e-8)
    assert float((A @ x - value * x).norm()) < 1e-3


# Learning rates at which each test model's Hessian moves slowly enough for one-product steps.
STEADY_LR = {"mlp": 0.003, "cnn": 0.003, "transformer": 3e-4}


@pytest.mark.parametrize("arch", ["mlp", "cnn", "transformer"])
def test_steady_training_with_one_product_steps_stays_within_tol(arch):
    """Each step's value is a Rayleigh quotient (at most lambda_max) within tol = 1e-3 of
    eigvalsh of the dense Hessian, on steps of one product as on the others."""
    model, X, y, loss_fn = ARCHITECTURES[arch]()
    q = HessMaxEV()
    errors = {}

    def check(step, out):
        lam = _top(model, X, y, loss_fn)
        errors[step] = (lam - out["HessMaxEV"]) / abs(lam)

    with sdpa_kernel(SDPBackend.MATH):  # (the transformer's attention, twice differentiable)
        _run(model, X, y, loss_fn, [q], steps=8, lr=STEADY_LR[arch], before_update=check)
    assert all(-1e-12 <= e <= 1e-3 for e in errors.values()), errors
    assert 1 in q.num_products.values() and q.num_products[0] > 1, q.num_products


def test_the_saved_warm_start_keeps_the_gap():
    """A quantity resumed from state_dict() takes the same products and value as the one that
    saved it; a saved gap that is not a gap is refused before anything changes."""
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    q = HessMaxEV()
    _run(model, X, y, loss_fn, [q], steps=2, lr=STEADY_LR["mlp"])
    state = q.state_dict()
    assert state["gap"] == q._lanczos.gap > 0
    resumed = HessMaxEV()
    resumed.load_state_dict(state)
    twin = copy.deepcopy(model)
    (ours,) = _run(model, X, y, loss_fn, [q])
    (theirs,) = _run(twin, X, y, loss_fn, [resumed])
    assert theirs == ours and resumed.num_products[0] == q.num_products[0] == 1
    fresh = HessMaxEV()
    with pytest.raises(ValueError, match=r"gap must be a positive finite .* got -1.0"):
        fresh.load_state_dict({**state, "gap": -1.0, "warned": True})
    assert fresh.state_dict() == {"warned": False}
