"""Least squares A X ~ B with an operator of any shape: LSMR, all right-hand sides at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._matmul import _adjoint_matmul, _as_matmul


@dataclass
class LSMRResult:
    """Solution of min ||A x - b||^2 + damping^2 ||x||^2 by LSMR, per column of B.

    solution: [D] or [D, k].
    num_iterations: iterations run (each is one block product with A and one with A^T).
    num_products: operator-vector products (columns multiplied by A or A^T) in total.
    converged: [k] bool (0-d for a vector B), a stopping test of Fong & Saunders (section
        6.2) met: ||r|| <= btol ||b|| + atol ||A|| ||x|| (a consistent system) or
        ||A^T r|| <= atol ||A|| ||r|| (a least-squares solution), with the estimates of
        ||A||, ||r||, ||A^T r|| of the recurrence (A damped).
    residual_norms: [k] (or 0-d) the estimate of ||(b; 0) - (A; damping I) x||.
    """

    solution: Tensor
    num_iterations: int
    num_products: int
    converged: Tensor
    residual_norms: Tensor


def _rotation(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(c, s, r) with [c s; -s c] (a; b) = (r; 0), r = hypot(a, b) >= 0 (c = 1 where r = 0)."""
    r = torch.hypot(a, b)
    safe = torch.where(r > 0, r, torch.ones_like(r))
    return torch.where(r > 0, a / safe, torch.ones_like(r)), b / safe, r


def _normalised(X: Tensor) -> tuple[Tensor, Tensor]:
    norm = X.norm(dim=0)
    return X / torch.where(norm > 0, norm, torch.ones_like(norm)), norm


def lsmr(
    A,
    B: Tensor,
    *,
    damping: float = 0.0,
    atol: float = 1e-6,
    btol: float = 1e-6,
    maxiter: int | None = None,
) -> LSMRResult:
    """min_x ||A x - b||^2 + damping^2 ||x||^2 for every column b of B, by LSMR (Fong &
    Saunders, "LSMR: an iterative algorithm for sparse least-squares problems", SIAM J. Sci.
    Comput. 33(5), 2011, Algorithm 2 and section 6 for the norm estimates and stopping
    rules; the recurrence of SciPy's ``scipy.sparse.linalg.lsmr``).

    A: any operator of shape (M, D) with ``A.adjoint()`` (or a tensor): LSMR is MINRES on the
        normal equations (A^T A + damping^2 I) x = A^T b, through Golub-Kahan
        bidiagonalisation, so it needs products with A and A^T, and neither symmetry nor
        definiteness. For a square non-singular A it solves A x = b; for a singular one
        (and no damping) it converges to the least-squares solution of minimum norm.
    B: [M] or [M, k]. All columns run their own recurrence; each iteration multiplies A and
        A^T with all k columns in one block product each (columns that have converged keep
        their solution, while the others go on).
    maxiter: iteration cap (default min(M, D) * 10).

    Example:
        >>> import torch
        >>> from avionics.curvature.algorithms import lsmr
        >>> A = torch.tensor([[2.0, 1.0], [0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
        >>> b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
        >>> result = lsmr(A, b, atol=1e-12, btol=1e-12)
        >>> torch.allclose(result.solution, torch.linalg.lstsq(A, b).solution)
        True
    """
    mm = _as_matmul(A, square=False)
    adjoint = _adjoint_matmul(A, "lsmr")
    vector = B.ndim == 1
    B = B.to(dtype=mm.dtype, device=mm.device)
    if vector:
        B = B[:, None]
    if B.ndim != 2 or B.shape[0] != mm.out_dim:
        raise ValueError(f"B must have shape ({mm.out_dim},) or ({mm.out_dim}, k), got "
                         f"{tuple(B.shape)}")  # fmt: skip
    maxiter = 10 * min(mm.out_dim, mm.dim) if maxiter is None else int(maxiter)
    k = B.shape[1]
    U, beta = _normalised(B)
    norm_b = beta
    V, alpha = _normalised(adjoint(U))
    products = 2 * k
    X = torch.zeros(mm.dim, k, dtype=mm.dtype, device=mm.device)
    zeros, ones = torch.zeros_like(beta), torch.ones_like(beta)
    zetabar, alphabar, rho, rhobar, cbar, sbar = alpha * beta, alpha, ones, ones, ones, zeros
    H, Hbar = V.clone(), torch.zeros_like(V)
    # the estimates of ||r|| (section 6.1) and ||A|| (section 6.3)
    betadd, betad, rhodold, tautildeold, thetatilde, zeta, d = beta, zeros, ones, zeros, \
        zeros, zeros, zeros  # fmt: skip
    norm_A2 = alpha**2
    residual = beta.clone()
    converged = (norm_b == 0) | (alpha * beta == 0)  # b = 0, or A^T b = 0: x = 0 is optimal
    iteration = 0
    while not bool(converged.all()) and iteration < maxiter:
        iteration += 1
        U, beta = _normalised(mm(V) - alpha * U)
        V, alpha = _normalised(adjoint(U) - beta * V)
        products += 2 * k
        # the rotation that eliminates the damping, then Q_i turning B_i into R_i
        chat, shat, alphahat = _rotation(alphabar, torch.full_like(alphabar, damping))
        rhoold = rho
        c, s, rho = _rotation(alphahat, beta)
        thetanew, alphabar = s * alpha, c * alpha
        # Qbar_i turning R_i^T into Rbar_i
        rhobarold, zetaold = rhobar, zeta
        thetabar = sbar * rho
        cbar, sbar, rhobar = _rotation(cbar * rho, thetanew)
        zeta, zetabar = cbar * zetabar, -sbar * zetabar
        # h, hbar, x (the columns that have converged keep their x)
        active = ~converged
        Hbar = H - (thetabar * rho / (rhoold * rhobarold)) * Hbar
        X = torch.where(active, X + (zeta / (rho * rhobar)) * Hbar, X)
        H = V - (thetanew / rho) * H
        # ||r||
        betaacute, betacheck = chat * betadd, -shat * betadd
        betahat, betadd = c * betaacute, -s * betaacute
        thetatildeold = thetatilde
        ctildeold, stildeold, rhotildeold = _rotation(rhodold, thetabar)
        thetatilde, rhodold = stildeold * rhobar, ctildeold * rhobar
        betad = -stildeold * betad + ctildeold * betahat
        tautildeold = (zetaold - thetatildeold * tautildeold) / rhotildeold
        taud = (zeta - thetatilde * tautildeold) / rhodold
        d = d + betacheck**2
        norm_r = torch.sqrt(d + (betad - taud) ** 2 + betadd**2)
        # ||A|| (of the damped operator), ||A^T r||, ||x||
        norm_A2 = norm_A2 + beta**2
        norm_A = torch.sqrt(norm_A2 + damping**2)
        norm_A2 = norm_A2 + alpha**2
        norm_Ar, norm_x = zetabar.abs(), X.norm(dim=0)
        consistent = norm_r <= btol * norm_b + atol * norm_A * norm_x
        least_squares = norm_Ar <= atol * norm_A * norm_r
        residual = torch.where(active, norm_r, residual)
        converged = converged | consistent | least_squares
    if vector:
        return LSMRResult(X[:, 0], iteration, products, converged[0], residual[0])
    return LSMRResult(X, iteration, products, converged, residual)
