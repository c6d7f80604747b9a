"""approximate_boundaries: an interval that holds the spectrum, from a few Lanczos products;
the spectral density on given boundaries."""

from __future__ import annotations

import pytest
import torch
from curvature_problems import dense_hessian, problem
from test_algorithms_estimators import Op

from avionics.curvature import GGNOperator, HessianOperator
from avionics.curvature.algorithms import approximate_boundaries, spectral_density

DT = torch.float64


def indefinite(D=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=DT))
    eigenvalues = torch.cat([torch.linspace(-2, 1, D - 3, dtype=DT),
                             torch.tensor([5.0, 9.0, 40.0], dtype=DT)])  # fmt: skip
    return Q @ torch.diag(eigenvalues) @ Q.T


def test_the_interval_holds_the_spectrum_of_a_dense_matrix():
    A = indefinite()
    exact = torch.linalg.eigvalsh(A)
    operator = Op(A)
    lower, upper = approximate_boundaries(operator, 20, seed=1)
    assert operator.products == 20
    assert lower <= float(exact[0]) and float(exact[-1]) <= upper
    spread = float(exact[-1] - exact[0])
    assert upper - lower < 1.2 * spread  # and not much wider than it
    # an invariant subspace: a diagonal matrix with 3 distinct eigenvalues is exact
    A = torch.diag(torch.tensor([1.0, 1.0, 3.0, 7.0, 7.0], dtype=DT))
    lower, upper = approximate_boundaries(A, 5, seed=0)
    assert lower == pytest.approx(1.0, abs=1e-12) and upper == pytest.approx(7.0, abs=1e-12)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "tied"])
def test_the_interval_holds_the_hessian_spectrum(name):
    model, loss_fn, data, _ = problem(name)
    H = HessianOperator(model, loss_fn, None, data)
    exact = torch.linalg.eigvalsh(dense_hessian(model, loss_fn, data))
    lower, upper = approximate_boundaries(H, 15, seed=0)
    assert lower <= float(exact[0]) and float(exact[-1]) <= upper
    assert upper - lower < 1.5 * float(exact[-1] - exact[0])


def test_spectral_density_on_given_boundaries():
    model, loss_fn, data, _ = problem("mlp")
    G = GGNOperator(model, loss_fn, None, data)
    boundaries = approximate_boundaries(G, 15, seed=0)
    density = spectral_density(G, 4, 20, boundaries=boundaries, seed=0)
    assert (density.lower, density.upper) == boundaries
    spread = boundaries[1] - boundaries[0]
    assert density.sigma == pytest.approx(0.01 * spread)
    assert float(density.grid[0]) == pytest.approx(boundaries[0] - 0.05 * spread)
    # the nodes are those of the default call: only the grid and the kernel width differ
    default = spectral_density(G, 4, 20, seed=0)
    torch.testing.assert_close(density.nodes, default.nodes, rtol=0, atol=0)
    integral = torch.trapezoid(density.density, density.grid)
    assert float(integral) == pytest.approx(1.0, abs=1e-3)
    for bad in [(1.0, 0.0), (0.0, float("inf")), (0.0,), "wide"]:
        with pytest.raises(ValueError, match=r"boundaries must be \(lower, upper\), finite"):
            spectral_density(G, 2, 5, boundaries=bad)
