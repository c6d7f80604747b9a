"""Extreme eigenpairs of a symmetric operator by Lanczos with full reorthogonalisation.

The Krylov basis V_j = [v_1, ..., v_j] is built from one product ``A @ v`` per step; every new
vector is orthogonalised against the whole basis twice (classical Gram-Schmidt, twice is
enough), so the projected matrix T_j = V_j^T A V_j is computed, not assumed tridiagonal, and
the Ritz values never duplicate. With A V_j = V_j T_j + f_j e_j^T and T_j = Y diag(theta) Y^T,
the Ritz pair (theta_i, V_j y_i) has residual norm ||A V_j y_i - theta_i V_j y_i|| =
||f_j|| |e_j^T y_i| (Golub & Van Loan, *Matrix Computations*, 4th ed., section 10.1.4), which is
the stopping rule: stop when it is <= tol |theta_i| for all k wanted pairs (the same rule as
ARPACK's, so ``tol`` means the same as in ``scipy.sparse.linalg.eigsh``). The eigenvalue error
is then of the order residual^2 / gap, usually far below ``tol``.

When the basis reaches ``max_basis`` vectors the iteration is thick-restarted (Wu & Simon 2000,
"Thick-restart Lanczos method for large symmetric eigenvalue problems", SIAM J. Matrix Anal.
Appl. 22(2)): the best Ritz vectors are kept, with the last residual direction, and the
projected matrix becomes an arrowhead; Lanczos continues from there. If the Krylov space
becomes invariant, a random direction orthogonal to the basis continues the search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._matmul import MatMul, _as_matmul, _generator


@dataclass
class EigenResult:
    """Eigenpairs found by Lanczos.

    values: [k], ordered from the most extreme (largest first for ``top_eigenpairs``, smallest
        first for ``bottom_eigenpairs``).
    vectors: [D, k], unit-norm columns matching ``values``.
    num_products: operator-vector products used (one per Lanczos step).
    converged: whether all k pairs met the residual tolerance.
    residual_norms: [k], the estimated ||A x - theta x|| of each pair.
    """

    values: Tensor
    vectors: Tensor
    num_products: int
    converged: bool
    residual_norms: Tensor


def top_eigenpairs(
    A,
    k: int = 1,
    *,
    tol: float = 1e-4,
    max_products: int | None = None,
    v0: Tensor | None = None,
    max_basis: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> EigenResult:
    """The k largest algebraic (not largest magnitude) eigenvalues of a symmetric A, with
    eigenvectors, by Lanczos with full reorthogonalisation and thick restarts.

    A: a dense symmetric tensor [D, D] or any operator with ``.shape`` (D, D) and ``@``.
    tol: stop when every wanted Ritz pair has residual ||A x - theta x|| <= tol |theta|
        (ARPACK's rule; the eigenvalue error is typically ~ tol^2 |theta|^2 / gap).
    max_products: budget of operator products (default 500); the result says whether it
        converged within it.
    v0: start vector [D] (a warm start, e.g. the previous step's top eigenvector); a [D, j]
        block is summed over its columns. Random Gaussian (from ``seed``/``generator``) if None.
    max_basis: Krylov basis size before a thick restart (default max(50, 3k), at most D).
    Values are returned largest first.
    """
    return _lanczos_extreme(A, k, "LA", tol, max_products, v0, max_basis, seed, generator)


def bottom_eigenpairs(
    A,
    k: int = 1,
    *,
    tol: float = 1e-4,
    max_products: int | None = None,
    v0: Tensor | None = None,
    max_basis: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> EigenResult:
    """The k smallest algebraic eigenvalues (most negative first) of a symmetric A, with
    eigenvectors. Same algorithm and arguments as :func:`top_eigenpairs`; values are returned
    smallest first. Note that the residual rule is relative to |theta|, so eigenvalues very
    close to zero need a small ``tol`` or a large budget."""
    return _lanczos_extreme(A, k, "SA", tol, max_products, v0, max_basis, seed, generator)


def _orthogonalise(w: Tensor, V: Tensor) -> tuple[Tensor, Tensor]:
    """w minus its projection on the orthonormal rows of V [n, D] (Gram-Schmidt twice);
    returns the new w and the coefficients V w."""
    h = V @ w
    w = w - V.T @ h
    h2 = V @ w
    return w - V.T @ h2, h + h2


def _lanczos_orthogonalise(w: Tensor, V: Tensor, known: Tensor) -> tuple[Tensor, Tensor]:
    """Orthogonalise w = A v_last against the basis rows V; return it and the new column of
    T = V^T A V (float64, CPU). (Never in place: an operator may return its input.)

    ``known`` holds the couplings T[:-1, last] fixed when v_last was added (one beta in a plain
    step, the arrowhead after a thick restart). Subtracting them and alpha v_last (the Lanczos
    recurrence) leaves only rounding-level components along the older vectors, which one
    Gram-Schmidt pass over the basis removes (full reorthogonalisation, Parlett, *The
    Symmetric Eigenvalue Problem*, section 13.8); a second pass runs only if the first one
    removed a large part of w (the Daniel-Gragg-Kaufman-Stewart criterion). This reads the basis
    twice per step instead of four times.
    """
    n = V.shape[0]
    column = torch.zeros(n, dtype=torch.float64)
    nz = torch.nonzero(known).flatten()
    if len(nz):
        c = known[nz]
        w = w - V[nz].T @ c.to(dtype=w.dtype, device=w.device)
        column[nz] += c
    alpha = torch.dot(V[n - 1], w)
    w = w - alpha * V[n - 1]
    column[n - 1] += float(alpha)
    before = float(w.norm())
    for _ in range(2):
        h = V @ w
        w = w - V.T @ h
        column += h.to(torch.float64).cpu()
        if float(w.norm()) > 0.7071 * before:
            break
        before = float(w.norm())
    return w, column


def _lanczos_extreme(A, k, which, tol, max_products, v0, max_basis, seed, generator):
    mm: MatMul = _as_matmul(A)
    D, dtype, device = mm.dim, mm.dtype, mm.device
    if not 1 <= k <= D:
        raise ValueError(f"k must be between 1 and D={D}, got {k}")
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    max_products = 500 if max_products is None else int(max_products)
    if max_products < 1:
        raise ValueError(f"max_products must be >= 1, got {max_products}")
    max_basis = min(D, max(50, 3 * k) if max_basis is None else int(max_basis))
    if max_basis < min(D, k + 2):
        raise ValueError(f"max_basis must be at least k + 2 = {k + 2} (or D), got {max_basis}")
    # Ritz vectors kept at a restart: the k wanted and as many again as room allows.
    keep = min(max_basis - 1, max(k + 1, (max_basis + k) // 2))
    gen = None

    def random_vector():
        nonlocal gen
        if gen is None:
            gen = _generator(seed, generator, device)
        return torch.randn(D, generator=gen, device=device, dtype=dtype)

    if v0 is None:
        v = random_vector()
    else:
        v = torch.as_tensor(v0).to(device=device, dtype=dtype)
        if v.ndim == 2:
            v = v.sum(1)
        if v.shape != (D,):
            raise ValueError(f"v0 must have shape ({D},), got {tuple(v0.shape)}")
        if not torch.isfinite(v).all() or v.norm() == 0:
            raise ValueError("v0 must be finite and nonzero")
    eps = torch.finfo(dtype).eps

    V = torch.empty(max_basis, D, dtype=dtype, device=device)  # basis vectors as rows
    T = torch.zeros(max_basis, max_basis, dtype=torch.float64)
    V[0] = v / v.norm()
    nb = 1  # basis vectors in V; the last one still awaits its product
    products = 0
    anorm = 0.0
    while True:
        w = mm(V[nb - 1])
        products += 1
        w, h = _lanczos_orthogonalise(w, V[:nb], T[: nb - 1, nb - 1])
        T[:nb, nb - 1] = h
        T[nb - 1, :nb] = h
        beta = float(w.norm())
        theta, Y = torch.linalg.eigh(T[:nb, :nb])
        anorm = max(anorm, float(theta.abs().max()))
        wanted = _wanted(theta, min(k, nb), which)
        res = beta * Y[nb - 1, wanted].abs()
        floor = 10 * eps * anorm
        done = nb >= k and bool((res <= torch.clamp(tol * theta[wanted].abs(), min=floor)).all())
        if done or products >= max_products or (nb == D and beta <= 1e3 * floor):
            converged = done or nb == D
            break

        # Next basis vector: the residual direction, or a fresh random one on breakdown.
        if beta > 1e3 * floor:
            vnext, coupling = w / beta, beta
        else:
            r, _ = _orthogonalise(random_vector(), V[:nb])
            vnext, coupling = r / r.norm(), 0.0

        if nb == max_basis:  # thick restart: keep the best Ritz vectors and the residual.
            sel = _wanted(theta, keep, which)
            X = Y[:, sel].T.to(dtype=dtype, device=device) @ V[:nb]
            b = coupling * Y[nb - 1, sel]
            V[:keep] = X
            V[keep] = vnext
            T.zero_()
            T[range(keep), range(keep)] = theta[sel]
            T[keep, :keep] = b
            T[:keep, keep] = b
            nb = keep + 1
        else:
            V[nb] = vnext
            T[nb, nb - 1] = T[nb - 1, nb] = coupling
            nb += 1

    vectors = V[:nb].T @ Y[:, wanted].to(dtype=dtype, device=device)
    return EigenResult(
        values=theta[wanted].to(dtype=dtype, device=device),
        vectors=vectors,
        num_products=products,
        converged=converged,
        residual_norms=res.to(dtype=dtype),
    )


def _wanted(theta: Tensor, n: int, which: str) -> Tensor:
    """Indices of the n most extreme of the ascending Ritz values, most extreme first."""
    m = theta.numel()
    if which == "LA":
        return torch.arange(m - 1, m - 1 - n, -1)
    return torch.arange(n)
