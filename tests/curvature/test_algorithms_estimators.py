"""Trace, diagonal and squared Frobenius norm estimators against exact dense values."""

from __future__ import annotations

import pytest
import torch

from avionics.curvature.algorithms import (
    frobenius_norm_squared,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    xdiag,
    xtrace,
)

DT = torch.float64


class Op:
    """Exposes only what an operator must: shape, dtype, device, @ and adjoint() (counts the
    columns multiplied by A and by its adjoint together)."""

    def __init__(self, A, counter: list[int] | None = None):
        self._A, self.shape, self.dtype, self.device = A, A.shape, A.dtype, A.device
        self._counter = [0] if counter is None else counter

    @property
    def products(self) -> int:
        return self._counter[0]

    def __matmul__(self, X):
        self._counter[0] += 1 if X.ndim == 1 else X.shape[1]
        return self._A @ X

    def adjoint(self) -> Op:
        return Op(self._A.mT, self._counter)


def spd(D=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(D, D, generator=g, dtype=DT)
    return M @ M.T / D + 0.1 * torch.eye(D, dtype=DT)


def low_rank_plus_noise(D=200, rank=10, noise=0.05, seed=0):
    """Fast-decaying top eigenvalues plus a small dense symmetric perturbation."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(D, rank, generator=g, dtype=DT))
    top = 100.0 * 0.7 ** torch.arange(rank, dtype=DT)
    E = torch.randn(D, D, generator=g, dtype=DT)
    return U @ torch.diag(top) @ U.T + noise * (E + E.T) / 2 + torch.eye(D, dtype=DT)


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_hutchinson_trace_converges(distribution):
    A = spd()
    exact = torch.trace(A)
    est = hutchinson_trace(Op(A), 4000, distribution=distribution, seed=1, chunk_size=1000)
    assert abs(est - exact) / exact < 0.02
    # Reproducible, and a different seed gives a different value.
    assert hutchinson_trace(A, 50, seed=3) == hutchinson_trace(A, 50, seed=3)
    assert hutchinson_trace(A, 50, seed=3) != hutchinson_trace(A, 50, seed=4)
    g = torch.Generator().manual_seed(3)
    assert hutchinson_trace(A, 50, generator=g) == hutchinson_trace(A, 50, seed=3)
    # Chunking changes neither the probes nor the result.
    for f in (hutchinson_trace, hutchinson_diagonal, frobenius_norm_squared):
        torch.testing.assert_close(f(A, 50, seed=3, chunk_size=7), f(A, 50, seed=3))


def test_trace_estimators_unbiased():
    """Means over independent repetitions lie within 4 standard errors of the exact trace."""
    A = low_rank_plus_noise(D=80, rank=5)
    exact = float(torch.trace(A))
    for f in (hutchinson_trace, hutchpp_trace, xtrace):
        ests = torch.stack([f(A, 12, seed=s) for s in range(300)])
        se = float(ests.std()) / 300**0.5
        assert abs(float(ests.mean()) - exact) < 4 * se + 1e-9, f.__name__


def test_product_counts():
    A = spd(D=40)
    for f, m in ((hutchinson_trace, 30), (hutchpp_trace, 30), (xtrace, 30), (xdiag, 30)):
        op = Op(A)
        f(op, m, seed=0)
        assert op.products == m, f.__name__
    op = Op(A)
    hutchinson_diagonal(op, 17, seed=0)
    assert op.products == 17


def test_xtrace_matches_its_definition():
    """The downdated-QR implementation equals the definition with an explicit Q_(i) per i."""
    A = low_rank_plus_noise(D=50, rank=4, seed=2)
    A = A + 0.3 * torch.randn(50, 50, generator=torch.Generator().manual_seed(9), dtype=DT)
    N, m = A.shape[0], 6  # nonsymmetric on purpose: XTrace does not need symmetry
    Om = torch.randn(N, m, generator=torch.Generator().manual_seed(5), dtype=DT)
    plain, improved = [], []
    for i in range(m):
        Qi, _ = torch.linalg.qr(A @ torch.cat([Om[:, :i], Om[:, i + 1 :]], 1))
        u = Om[:, i] - Qi @ (Qi.T @ Om[:, i])
        first = torch.trace(Qi.T @ A @ Qi)
        plain.append(first + u @ A @ u)
        improved.append(first + (N - m + 1) * (u @ A @ u) / (u @ u))
    ref_plain, ref_improved = torch.stack(plain), torch.stack(improved)
    est, err = xtrace(A, 2 * m, improved=False, return_error=True, seed=5)
    torch.testing.assert_close(est, ref_plain.mean())
    torch.testing.assert_close(err, ref_plain.std() / m**0.5)
    torch.testing.assert_close(xtrace(A, 2 * m, seed=5), ref_improved.mean())


def test_xdiag_matches_its_definition():
    A = low_rank_plus_noise(D=40, rank=4, seed=3)
    N, m = A.shape[0], 5
    g = torch.Generator().manual_seed(7)
    Om = 2 * torch.randint(0, 2, (N, m), generator=g).to(DT) - 1
    ds = []
    for i in range(m):
        Qi, _ = torch.linalg.qr(A @ torch.cat([Om[:, :i], Om[:, i + 1 :]], 1))
        P = Qi @ Qi.T
        ds.append(torch.diagonal(P @ A) + Om[:, i] * ((torch.eye(N, dtype=DT) - P) @ A @ Om[:, i]))
    torch.testing.assert_close(xdiag(Op(A), 2 * m, seed=7), torch.stack(ds).mean(0))


def test_exact_on_low_rank():
    """A rank-r matrix with more than r sketch vectors: the sketch holds range(A), exact."""
    g = torch.Generator().manual_seed(0)
    U = torch.randn(30, 3, generator=g, dtype=DT)
    A = U @ U.T
    torch.testing.assert_close(xtrace(A, 12, seed=1), torch.trace(A))
    torch.testing.assert_close(xdiag(A, 12, seed=1), torch.diagonal(A))
    torch.testing.assert_close(hutchpp_trace(A, 12, seed=1), torch.trace(A))
    # More sketch vectors than D: Hutch++'s sketch is the whole space; XTrace's leave-one-out
    # sketches miss one direction, which the improved scaling then gets exactly. Any matrix.
    B = torch.randn(6, 6, generator=g, dtype=DT)
    torch.testing.assert_close(hutchpp_trace(B, 40, seed=0), torch.trace(B))
    torch.testing.assert_close(xtrace(B, 40, seed=0), torch.trace(B))


def test_sketching_beats_hutchinson_on_low_rank_plus_noise():
    """Equal products: mean squared error of Hutch++ and XTrace (and XDiag) far below
    Hutchinson's on a matrix whose trace is dominated by a few eigenvalues."""
    A = low_rank_plus_noise()
    exact, dexact = torch.trace(A), torch.diagonal(A)
    m, reps = 40, 40

    def mse(f, target):
        return float(
            torch.stack([(f(A, m, seed=s) - target).square().mean() for s in range(reps)]).mean()
        )

    hutch = mse(hutchinson_trace, exact)
    hpp = mse(hutchpp_trace, exact)
    xt = mse(xtrace, exact)
    assert xt < hpp < hutch / 10
    assert mse(xdiag, dexact) < mse(hutchinson_diagonal, dexact) / 10


def test_hutchinson_diagonal_converges():
    A = spd(D=40)
    est = hutchinson_diagonal(Op(A), 3000, seed=0, chunk_size=512)
    exact = torch.diagonal(A)
    assert ((est - exact).norm() / exact.norm()) < 0.05
    # Rademacher vectors recover a diagonal matrix exactly from one product.
    Dg = torch.diag(torch.arange(1.0, 11.0, dtype=DT))
    torch.testing.assert_close(hutchinson_diagonal(Dg, 1, seed=2), torch.diagonal(Dg))


def test_xdiag_converges_and_is_unbiased():
    A = low_rank_plus_noise(D=60, rank=5, seed=1)
    exact = torch.diagonal(A)
    ests = torch.stack([xdiag(A, 16, seed=s) for s in range(200)])
    se = ests.std(0) / 200**0.5
    assert ((ests.mean(0) - exact).abs() <= 4.5 * se + 1e-9).all()
    errors = [float((xdiag(A, m, seed=0) - exact).norm() / exact.norm()) for m in (8, 40, 100)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.02


def test_frobenius_norm_squared():
    A = spd(D=70)
    exact = (A**2).sum()
    op = Op(A)
    torch.testing.assert_close(frobenius_norm_squared(op, chunk_size=32), exact)
    assert op.products == 70
    est = frobenius_norm_squared(Op(A), 3000, seed=0)
    assert abs(est - exact) / exact < 0.03
    assert frobenius_norm_squared(A, 20, seed=1) == frobenius_norm_squared(A, 20, seed=1)


def test_bad_input():
    with pytest.raises(ValueError, match="square"):
        hutchinson_trace(torch.zeros(3, 4), 5)
    with pytest.raises(TypeError, match="operator"):
        hutchinson_trace([[1.0]], 5)
    with pytest.raises(ValueError, match="distribution"):
        hutchinson_trace(spd(5), 5, distribution="uniform")
    with pytest.raises(ValueError, match="seed or generator"):
        hutchinson_trace(spd(5), 5, seed=1, generator=torch.Generator())
