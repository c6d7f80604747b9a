"""Linear solves A X = B with an operator: conjugate gradients and the Neumann series."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ._matmul import _apply_preconditioner, _as_matmul


@dataclass
class CGResult:
    """Solution of A X = B by conjugate gradients.

    solution: same shape as B ([D] or [D, k]).
    num_iterations: iterations run (each is one block product with the unconverged columns).
    num_products: operator-vector products (columns multiplied) in total.
    converged: [k] bool (a 0-d bool for a vector B), ||b_j - A x_j|| <= max(tol ||b_j||, atol).
    residual_norms: [k] (or 0-d) the final residual norms of the recurrence.
    """

    solution: Tensor
    num_iterations: int
    num_products: int
    converged: Tensor
    residual_norms: Tensor


def conjugate_gradient(
    A,
    B: Tensor,
    *,
    x0: Tensor | None = None,
    preconditioner=None,
    tol: float = 1e-6,
    atol: float = 0.0,
    maxiter: int | None = None,
) -> CGResult:
    """Solve A X = B for a symmetric positive definite A by (preconditioned) conjugate gradients
    (Hestenes & Stiefel 1952; Saad, *Iterative Methods for Sparse Linear Systems*, 2nd ed.,
    Algorithm 9.1), all right-hand sides at once.

    B: [D] or [D, k]; each column runs its own CG (its own alpha_j, beta_j), and each iteration
        multiplies A with all still-unconverged columns in one block product.
    preconditioner: M ~ A^{-1}, symmetric positive definite: a tensor, an operator (``M @ R``)
        or a callable (``M(R)``), applied to [D, k] blocks. For a damped curvature A + lambda I
        pass that sum as A.
    tol, atol: column j stops once ||b_j - A x_j|| <= max(tol ||b_j||, atol).
    A column meeting p^T A p <= 0 (A not positive definite) is stopped with a warning and
    reported as not converged.
    maxiter: iteration cap (default 10 D).
    """
    mm = _as_matmul(A)
    D = mm.dim
    vector = B.ndim == 1
    B = B.to(dtype=mm.dtype, device=mm.device)
    if vector:
        B = B[:, None]
    if B.ndim != 2 or B.shape[0] != D:
        raise ValueError(f"B must have shape ({D},) or ({D}, k), got {tuple(B.shape)}")
    maxiter = 10 * D if maxiter is None else int(maxiter)

    def precond(R):
        return R if preconditioner is None else _apply_preconditioner(preconditioner, R)

    products = 0
    if x0 is None:
        X = torch.zeros_like(B)
        Rr = B.clone()
    else:
        X = x0.to(dtype=mm.dtype, device=mm.device).reshape(B.shape).clone()
        Rr = B - mm(X)
        products += B.shape[1]
    threshold = torch.clamp(tol * B.norm(dim=0), min=atol)
    rnorm = Rr.norm(dim=0)
    active = rnorm > threshold
    Zp = precond(Rr)
    P = Zp.clone()
    rz = (Rr * Zp).sum(0)
    it = 0
    warned = False
    stopped = torch.zeros_like(active)
    while bool(active.any()) and it < maxiter:
        idx = torch.nonzero(active).flatten()
        Pa = P[:, idx]
        APa = mm(Pa)
        products += len(idx)
        curvature = (Pa * APa).sum(0)
        bad = curvature <= 0
        if bool(bad.any()):  # p^T A p <= 0: A is not positive definite along p
            if not warned:
                warnings.warn(
                    f"conjugate_gradient: p^T A p <= 0 in column(s) {idx[bad].tolist()} at "
                    f"iteration {it}: A is not positive definite (damp it, e.g. A + lambda I); "
                    "those columns are stopped and reported as not converged.",
                    stacklevel=2,
                )
                warned = True
            active[idx[bad]] = False
            stopped[idx[bad]] = True
            keep = ~bad
            idx, Pa, APa, curvature = idx[keep], Pa[:, keep], APa[:, keep], curvature[keep]
            if len(idx) == 0:
                break
        alpha = rz[idx] / curvature
        X[:, idx] += alpha * Pa
        Rr[:, idx] -= alpha * APa
        rnorm[idx] = Rr[:, idx].norm(dim=0)
        Za = precond(Rr[:, idx])
        rz_new = (Rr[:, idx] * Za).sum(0)
        beta = rz_new / rz[idx]
        P[:, idx] = Za + beta * Pa
        rz[idx] = rz_new
        active[idx] = rnorm[idx] > threshold[idx]
        it += 1
    converged = (rnorm <= threshold) & ~stopped
    if vector:
        return CGResult(X[:, 0], it, products, converged[0], rnorm[0])
    return CGResult(X, it, products, converged, rnorm)


def neumann_inverse(
    A,
    B: Tensor,
    *,
    scale: float | None = None,
    num_terms: int = 100,
    tol: float | None = None,
) -> Tensor:
    """A^{-1} B by the truncated Neumann series

        A^{-1} = scale * sum_{k>=0} (I - scale A)^k,   X_K = scale * sum_{k<K} (I - scale A)^k B.

    Convergence: the series converges iff the spectral radius of I - scale A is < 1; for a
    symmetric A that means A positive definite and 0 < scale < 2 / lambda_max(A). The error after
    K terms is (I - scale A)^K A^{-1} B, shrinking like (1 - scale lambda_min)^K for
    scale <= 1 / lambda_max (so slowly for ill-conditioned A: prefer CG for accuracy; the
    series is a smooth, fixed-cost approximation, e.g. for implicit differentiation).

    scale: default 1 / lambda_max, estimated by Lanczos (tol 1e-3, products not counted in
        ``num_terms``); a Ritz value underestimates lambda_max slightly, still well below 2.
    num_terms: K, the number of series terms (K - 1 products with B's columns).
    tol: optional early stop once the newest term's norm is <= tol * the sum's norm.
    B: [D] or [D, k] (columns in one block product per term).
    """
    mm = _as_matmul(A)
    B = B.to(dtype=mm.dtype, device=mm.device)
    if num_terms < 1:
        raise ValueError(f"num_terms must be >= 1, got {num_terms}")
    if scale is None:
        from .lanczos import top_eigenpairs

        lam = float(top_eigenpairs(mm, 1, tol=1e-3, max_products=200).values[0])
        if lam <= 0:
            raise ValueError(
                f"the largest eigenvalue of A is {lam:.3g} <= 0: the Neumann series diverges "
                "(A must be positive definite); damp A or use conjugate_gradient"
            )
        scale = 1.0 / lam
    term = scale * B
    X = term.clone()
    first = float(term.norm())
    for _ in range(num_terms - 1):
        term = term - scale * mm(term)
        X = X + term
        if tol is not None and float(term.norm()) <= tol * float(X.norm()):
            break
    if float(term.norm()) > first:
        warnings.warn(
            f"neumann_inverse: the terms grow (||last|| / ||first|| = "
            f"{float(term.norm()) / max(first, 1e-300):.3g}): the series diverges; A must be "
            "positive definite and scale < 2 / lambda_max(A).",
            stacklevel=2,
        )
    return X
