"""The squared Frobenius norm ||A||_F^2 = tr(A^T A) = sum_j ||A e_j||^2, of any (M, D) A."""

from __future__ import annotations

import torch
from torch import Tensor

from ._matmul import _adjoint_matmul, _as_matmul, _generator, _probe_blocks


def frobenius_norm_squared(
    A,
    num_products: int | None = None,
    *,
    chunk_size: int = 256,
    distribution: str = "rademacher",
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """||A||_F^2 = sum_jl A_jl^2 for an operator of any shape (M, D), e.g. a Jacobian.

    num_products None (default): exact, sum_j ||A e_j||^2 from the identity's columns,
        ``chunk_size`` at a time (D products: for small D).
    num_products m: the unbiased estimate (1/m) sum_i ||A z_i||^2 with E[z z^T] = I, since
        E||A z||^2 = E[z^T A^T A z] = tr(A^T A) (Hutchinson on A^T A).

    A wide operator (M < D) is multiplied through its transpose (``A.adjoint()``, with
    ||A||_F = ||A^T||_F) when it has one, so that the exact norm takes M products and the
    estimate draws vectors of the smaller size; a square or tall one through A itself.

    Example:
        >>> import torch
        >>> from avionics.curvature.algorithms import frobenius_norm_squared
        >>> A = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)  # wide: 3 products
        >>> float(frobenius_norm_squared(A)), float(A.square().sum())
        (506.0, 506.0)
    """
    mm = _as_matmul(A, square=False)
    if mm.out_dim < mm.dim and (isinstance(A, Tensor) or callable(getattr(A, "adjoint", None))):
        mm = _adjoint_matmul(A, "frobenius_norm_squared")
    D = mm.dim
    if num_products is None:
        total = torch.zeros((), dtype=mm.dtype, device=mm.device)
        for i in range(0, D, chunk_size):
            cols = torch.arange(i, min(i + chunk_size, D), device=mm.device)
            E = torch.zeros(D, len(cols), dtype=mm.dtype, device=mm.device)
            E[cols, torch.arange(len(cols), device=mm.device)] = 1
            total = total + mm(E).square().sum()
        return total
    if num_products < 1:
        raise ValueError(f"num_products must be >= 1 or None, got {num_products}")
    gen = _generator(seed, generator, mm.device)
    total = torch.zeros((), dtype=mm.dtype, device=mm.device)
    for Z in _probe_blocks(D, num_products, chunk_size, distribution, gen, mm.dtype, mm.device):
        total = total + mm(Z).square().sum()
    return total / num_products
