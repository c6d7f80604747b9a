"""Lanczos eigenpairs against torch.linalg.eigh, and SLQ against the exact smoothed density."""

from __future__ import annotations

import math

import pytest
import scipy.sparse.linalg
import torch

from avionics.curvature.algorithms import bottom_eigenpairs, spectral_density, top_eigenpairs
from avionics.curvature.algorithms.lanczos import BlockOperator, LanczosState

DT = torch.float64


class Op:
    """Exposes only what an operator must: shape, dtype, device and @ (counts columns)."""

    def __init__(self, A):
        self._A, self.shape, self.dtype, self.device = A, A.shape, A.dtype, A.device
        self.products = 0

    def __matmul__(self, X):
        self.products += 1 if X.ndim == 1 else X.shape[1]
        return self._A @ X


def symmetric(eigenvalues, seed=0):
    D = len(eigenvalues)
    Q, _ = torch.linalg.qr(
        torch.randn(D, D, generator=torch.Generator().manual_seed(seed), dtype=DT)
    )
    return Q @ torch.diag(torch.as_tensor(eigenvalues, dtype=DT)) @ Q.T


def indefinite(D=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(D, D, generator=g, dtype=DT)
    return (M + M.T) / 2


@pytest.mark.parametrize("k", [1, 4])
def test_top_and_bottom_match_eigvalsh(k):
    A = indefinite()
    exact = torch.linalg.eigvalsh(A)
    op = Op(A)
    top = top_eigenpairs(op, k, tol=1e-10, seed=0, max_products=2000)
    assert top.converged and op.products == top.num_products
    torch.testing.assert_close(top.values, exact.flip(0)[:k], rtol=1e-9, atol=1e-9)
    bottom = bottom_eigenpairs(Op(A), k, tol=1e-10, seed=0, max_products=2000)
    assert bottom.converged
    torch.testing.assert_close(bottom.values, exact[:k], rtol=1e-9, atol=1e-9)
    for r in (top, bottom):
        V = r.vectors
        torch.testing.assert_close(V.T @ V, torch.eye(k, dtype=DT), atol=1e-9, rtol=0)
        residual = (A @ V - V * r.values).norm(dim=0)
        assert (residual <= 1e-9 * r.values.abs()).all()
        assert (r.residual_norms <= 1e-10 * r.values.abs()).all()


def test_largest_algebraic_not_magnitude():
    A = symmetric([-10.0, -5.0, 0.5, 1.0, 2.0] + [0.1] * 20)
    r = top_eigenpairs(A, 2, tol=1e-10)
    torch.testing.assert_close(r.values, torch.tensor([2.0, 1.0], dtype=DT))
    r = bottom_eigenpairs(A, 2, tol=1e-10)
    torch.testing.assert_close(r.values, torch.tensor([-10.0, -5.0], dtype=DT))


def test_thick_restart_with_small_basis():
    """A basis of 12 vectors must restart many times and still find the top 3."""
    ev = torch.linspace(0, 1, 200, dtype=DT) ** 2
    A = symmetric(ev, seed=1)
    r = top_eigenpairs(Op(A), 3, tol=1e-8, max_basis=12, max_products=3000, seed=0)
    assert r.converged and r.num_products > 12
    torch.testing.assert_close(r.values, ev.flip(0)[:3], rtol=1e-10, atol=1e-12)


def test_budget_and_warm_start():
    A = indefinite(D=150, seed=3)
    exact = float(torch.linalg.eigvalsh(A)[-1])
    r = top_eigenpairs(A, tol=1e-10, max_products=5, seed=0)
    assert not r.converged and r.num_products == 5
    cold = top_eigenpairs(A, tol=1e-6, seed=0)
    assert cold.converged and abs(float(cold.values[0]) - exact) < 1e-8 * abs(exact)
    # Warm start from a slightly perturbed eigenvector: far fewer products.
    noise = torch.randn(150, generator=torch.Generator().manual_seed(1), dtype=DT)
    warm = top_eigenpairs(A, tol=1e-6, v0=cold.vectors[:, 0] + 1e-4 * noise)
    assert warm.converged and warm.num_products < cold.num_products / 2
    torch.testing.assert_close(warm.values, cold.values, rtol=1e-9, atol=0)
    # Seeds: reproducible.
    assert (
        top_eigenpairs(A, tol=1e-3, seed=4).num_products
        == top_eigenpairs(A, tol=1e-3, seed=4).num_products
    )


@pytest.mark.parametrize("criterion", ["residual", "eigenvalue"])
def test_warm_start_from_a_state(criterion):
    """A second call starts from the first one's eigenvector, kept in the state."""
    A = indefinite(D=150, seed=3)
    exact = float(torch.linalg.eigvalsh(A)[-1])
    state = LanczosState()
    first = top_eigenpairs(Op(A), tol=1e-10, seed=0, criterion=criterion, state=state)
    assert first.converged and abs(float(first.values[0]) - exact) < 1e-10 * abs(exact)
    assert state.eigenvalue == pytest.approx(exact, rel=1e-10)
    torch.testing.assert_close(state.eigenvector, first.vectors[:, 0], rtol=0, atol=0)
    second = top_eigenpairs(Op(A), tol=1e-10, criterion=criterion, state=state)
    assert second.converged and abs(float(second.values[0]) - exact) < 1e-10 * abs(exact)
    assert second.num_products < first.num_products


def test_state_storage_rows_are_reused_and_wrap_around():
    """Calls move the start row through the spare rows, back to row 0, and reallocate for
    another size; results stay those of a fresh call."""
    A = symmetric(torch.linspace(-1, 3, 60, dtype=DT), seed=5)
    state = LanczosState(spare_rows=3)
    starts = []
    for _ in range(8):
        r = top_eigenpairs(A, tol=1e-10, max_basis=10, max_products=2000, state=state)
        starts.append(state.start)
        torch.testing.assert_close(r.values, torch.tensor([3.0], dtype=DT))
    assert state.storage.shape == (14, 60)
    assert any(b < a for a, b in zip(starts, starts[1:], strict=False))  # back to row 0
    r = top_eigenpairs(A[:30, :30], tol=1e-10, state=state)
    assert state.storage.shape[1] == 30 and r.converged
    torch.testing.assert_close(r.values, torch.linalg.eigvalsh(A[:30, :30])[-1:])


def test_block_operator_matches_dense():
    """Parts per block (one None, a zero block) as for per-parameter Hessian products."""
    A = indefinite(D=40, seed=7)
    A[30:] = A[:, 30:] = 0
    slices = [slice(0, 10), slice(10, 30), slice(30, 40)]

    def apply(v):
        Av = A @ v
        return [Av[:10].reshape(2, 5), Av[10:30], None]

    op = BlockOperator(apply, slices, DT, torch.device("cpu"))
    r = bottom_eigenpairs(op, 2, tol=1e-10, max_products=2000, seed=1)
    torch.testing.assert_close(r.values, torch.linalg.eigvalsh(A)[:2])
    with pytest.raises(ValueError, match="criterion"):
        top_eigenpairs(op, criterion="gap")


def test_small_and_degenerate():
    A = torch.diag(torch.tensor([3.0, 1.0, 2.0, 4.0], dtype=DT))
    r = top_eigenpairs(A, 4)
    assert r.converged
    torch.testing.assert_close(r.values, torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=DT))
    # A start vector in an invariant subspace: the search continues in a random direction.
    r = top_eigenpairs(A, 2, v0=torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=DT), tol=1e-10)
    torch.testing.assert_close(r.values, torch.tensor([4.0, 3.0], dtype=DT))
    # Identity: every Ritz value is exact after one product.
    r = top_eigenpairs(torch.eye(30, dtype=DT), 1)
    assert r.converged and r.num_products == 1
    torch.testing.assert_close(r.values, torch.ones(1, dtype=DT))
    with pytest.raises(ValueError, match="k must be"):
        top_eigenpairs(A, 5)


def test_fewer_products_than_eigsh():
    """Top eigenvalue to 1e-4 with fewer products than ARPACK at the same tolerance."""
    ev = torch.cat(
        [
            torch.tensor([5.0, 4.6, 4.3]),
            torch.rand(297, generator=torch.Generator().manual_seed(0)),
        ]
    )
    A = symmetric(ev.to(DT), seed=2)
    v0 = torch.randn(300, generator=torch.Generator().manual_seed(3), dtype=DT)
    ours = top_eigenpairs(Op(A), tol=1e-4, v0=v0)
    count = [0]

    def matvec(x):
        count[0] += 1
        return (A @ torch.from_numpy(x.reshape(-1))).numpy()

    lin = scipy.sparse.linalg.LinearOperator((300, 300), matvec=matvec, dtype="float64")
    theirs = scipy.sparse.linalg.eigsh(lin, k=1, which="LA", tol=1e-4, v0=v0.numpy())[0][0]
    assert abs(theirs - 5.0) < 1e-4 * 5
    assert abs(float(ours.values[0]) - 5.0) < 1e-4 * 5
    assert ours.num_products < count[0]


def test_float32_operator():
    A = indefinite(D=80, seed=5)
    r = top_eigenpairs(A.float(), 2, tol=1e-4, seed=0)
    assert r.values.dtype == torch.float32 and r.vectors.dtype == torch.float32
    torch.testing.assert_close(
        r.values.double(), torch.linalg.eigvalsh(A).flip(0)[:2], rtol=1e-5, atol=1e-5
    )


def exact_density(eigenvalues, grid, sigma):
    z = (grid[:, None] - eigenvalues[None]) / sigma
    return torch.exp(-0.5 * z**2).sum(1) / (len(eigenvalues) * sigma * math.sqrt(2 * math.pi))


def test_spectral_density_matches_smoothed_spectrum():
    ev = torch.cat([torch.linspace(0, 1, 150), torch.tensor([3.0, 5.0])]).to(DT)
    A = symmetric(ev, seed=3)
    op = Op(A)
    res = spectral_density(op, num_probes=40, num_steps=40, bandwidth=0.02, seed=0)
    grid, density = res
    assert op.products == 40 * 40
    # Boundaries: the extreme Ritz values, close to the true extremes; the grid covers them.
    assert abs(res.lower - 0.0) < 1e-3 and abs(res.upper - 5.0) < 1e-8
    assert grid[0] < 0 and grid[-1] > 5
    dx = float(grid[1] - grid[0])
    assert abs(float(density.sum()) * dx - 1) < 1e-3
    torch.testing.assert_close(res.weights.sum(1), torch.ones(40, dtype=DT))
    exact = exact_density(ev, grid, res.sigma)
    assert float((density - exact).abs().sum() * dx) < 0.1  # L1 distance of two densities
    # Mass of the bulk [0, 1] vs the two outliers.
    bulk = float(density[(grid > -0.3) & (grid < 1.3)].sum() * dx)
    assert abs(bulk - 150 / 152) < 0.03
    # Without reorthogonalisation (two vectors per probe in memory): still close.
    plain = spectral_density(
        A, num_probes=40, num_steps=40, bandwidth=0.02, seed=0, reorthogonalize=False
    )
    assert abs(plain.upper - 5.0) < 1e-8
    exact = exact_density(ev, plain.grid, plain.sigma)
    assert float((plain.density - exact).abs().sum() * (plain.grid[1] - plain.grid[0])) < 0.1


def test_spectral_density_exact_quadrature_with_full_lanczos():
    """With as many steps as D, each probe's quadrature is exact: v^T f(A) v / ||v||^2."""
    ev = torch.tensor([-2.0, -1.0, 0.0, 0.5, 1.0, 4.0], dtype=DT)
    A = symmetric(ev, seed=4)
    res = spectral_density(A, num_probes=3, num_steps=10, seed=1, num_points=200)
    g = torch.Generator().manual_seed(1)
    V = (2 * torch.randint(0, 2, (6, 3), generator=g) - 1).to(DT)
    evals, U = torch.linalg.eigh(A)
    w = ((U.T @ V) ** 2 / 6).T  # [probes, D] exact quadrature weights
    z = (res.grid[:, None, None] - evals[None, None]) / res.sigma
    ref = (torch.exp(-0.5 * z**2) * w[None]).sum((1, 2)) / (3 * res.sigma * math.sqrt(2 * math.pi))
    torch.testing.assert_close(res.density, ref, rtol=1e-8, atol=1e-10)
    assert res.lower == pytest.approx(-2.0) and res.upper == pytest.approx(4.0)


def test_spectral_density_identity():
    res = spectral_density(2.0 * torch.eye(20, dtype=DT), num_probes=2, num_steps=5)
    assert res.lower == pytest.approx(2.0) and res.upper == pytest.approx(2.0)
    i = int(res.density.argmax())
    assert float(res.grid[i]) == pytest.approx(2.0, abs=0.01)


def test_operator_with_autograd_graph_is_detached():
    A = indefinite(D=20, seed=6).requires_grad_()
    r = top_eigenpairs(A * 1.0, 1, tol=1e-8)
    assert not r.values.requires_grad and not r.vectors.requires_grad
    torch.testing.assert_close(r.values, torch.linalg.eigvalsh(A.detach())[-1:])


def _gapped(seed=2):
    """D = 60, lambda_1 = 4, lambda_2 = 3, the rest in [-1, 2]; a unit symmetric E."""
    A = symmetric([4.0, 3.0, *torch.linspace(-1.0, 2.0, 58).tolist()], seed=seed)
    M = torch.randn(60, 60, generator=torch.Generator().manual_seed(seed + 1), dtype=DT)
    E = (M + M.T) / 2
    return A, E / torch.linalg.matrix_norm(E, ord=2)


EXTREME = {"top": (top_eigenpairs, 1.0), "bottom": (bottom_eigenpairs, -1.0)}


@pytest.mark.parametrize("which", ["top", "bottom"])
def test_one_product_check_accepts_a_rayleigh_quotient_within_tol(which):
    """A slowly changing operator (a training step): one product, its Rayleigh quotient
    within the Kato-Temple bound r^2 / (theta - lambda_2) of the exact eigenvalue."""
    eigenpairs, sign = EXTREME[which]
    A, E = _gapped()
    state = LanczosState()
    first = eigenpairs(sign * A, tol=1e-10, seed=0, criterion="eigenvalue", state=state)
    assert first.converged and state.gap >= 1.0 - 1e-9  # a Ritz gap over-estimates 4 - 3
    start, gap = first.vectors[:, 0].clone(), state.gap
    B = sign * (A + 0.02 * E)
    second = eigenpairs(B, tol=1e-3, criterion="eigenvalue", state=state)
    assert second.converged and second.num_products == 1 and state.gap == gap
    torch.testing.assert_close(second.vectors[:, 0], start, rtol=0, atol=1e-15)
    theta, r = float(second.values[0]), float(second.residual_norms[0])
    assert theta == pytest.approx(float(start @ B @ start), rel=1e-12)
    assert r == pytest.approx(float((B @ start - theta * start).norm()), rel=1e-6)
    exact = torch.linalg.eigvalsh(B)
    exact = exact.flip(0) if which == "top" else exact  # (the wanted one first)
    lam, lam2 = float(exact[0]), float(exact[1])
    assert r > 1e-3 * abs(theta)  # the plain bound |theta - lambda| <= r would not do
    assert 0 <= sign * (lam - theta) <= r * r / abs(theta - lam2) <= 1e-3 * abs(lam)


def test_a_failed_one_product_check_is_the_first_lanczos_step():
    """A larger change: the check fails, and the call goes on exactly like one from the same
    start vector without the check (no product lost)."""
    A, E = _gapped()
    state = LanczosState()
    start = top_eigenpairs(A, tol=1e-10, seed=0, criterion="eigenvalue", state=state)
    v0 = start.vectors[:, 0].clone()
    B = A + 0.1 * E
    checked = top_eigenpairs(B, tol=1e-3, criterion="eigenvalue", state=state)
    plain = top_eigenpairs(B, tol=1e-3, criterion="eigenvalue", v0=v0)
    assert checked.converged and checked.num_products == plain.num_products >= 2
    torch.testing.assert_close(checked.values, plain.values, rtol=1e-12, atol=0)
    lam = float(torch.linalg.eigvalsh(B)[-1])
    assert float(checked.values[0]) == pytest.approx(lam, rel=1e-3)
    assert state.gap <= 1.0 + 0.2  # the running minimum of the Ritz gaps (near 4 - 3)


def test_a_saved_gap_restores_the_one_product_check():
    A, E = _gapped()
    state = LanczosState()
    top_eigenpairs(A, tol=1e-10, seed=0, criterion="eigenvalue", state=state)
    vector, value, gap = state.eigenvector.clone(), state.eigenvalue, state.gap
    B = A + 0.02 * E
    with_gap = LanczosState.from_eigenpair(vector, value, gap=gap)
    without = LanczosState.from_eigenpair(vector, value)
    assert top_eigenpairs(B, tol=1e-3, criterion="eigenvalue", state=with_gap).num_products == 1
    assert top_eigenpairs(B, tol=1e-3, criterion="eigenvalue", state=without).num_products >= 2
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"gap must be a positive finite .* got "):
            LanczosState.from_eigenpair(vector, value, gap=bad)
