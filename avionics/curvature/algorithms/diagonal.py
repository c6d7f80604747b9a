"""Stochastic diagonal estimators: Hutchinson (Bekas et al.) and XDiag."""

from __future__ import annotations

import torch
from torch import Tensor

from ._matmul import _as_matmul, _generator, _probe_blocks
from ._progress import check_progress, progress_bar
from ._sketch import exchangeable_sketch


def hutchinson_diagonal(
    A,
    num_products: int = 100,
    *,
    distribution: str = "rademacher",
    chunk_size: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | str = "auto",
) -> Tensor:
    """diag(A) ~ (1/m) sum_i z_i * (A z_i) (elementwise), m = ``num_products`` i.i.d. test
    vectors with E[z z^T] = I (Bekas, Kokiopoulou, Saad 2007, "An estimator for the diagonal of
    a matrix", eq. (2.1)). Unbiased. With Rademacher vectors (the default) the variance of entry
    j is sum_{l != j} A_jl^2 / m, so a diagonal matrix is recovered exactly. Probes are drawn
    and multiplied ``chunk_size`` at a time (all at once by default); the result does not
    depend on ``chunk_size``.
    progress: a progress bar over the products on stderr: ``"auto"`` once the call has run
        :data:`~avionics.curvature.algorithms._progress.DELAY` seconds, True at once, False
        never; it advances once per block of ``chunk_size`` probes.
    """
    mm = _as_matmul(A)
    if num_products < 1:
        raise ValueError(f"num_products must be >= 1, got {num_products}")
    check_progress("hutchinson_diagonal", progress)
    gen = _generator(seed, generator, mm.device)
    total = torch.zeros(mm.dim, dtype=mm.dtype, device=mm.device)
    blocks = _probe_blocks(
        mm.dim, num_products, chunk_size, distribution, gen, mm.dtype, mm.device
    )
    with progress_bar(progress, num_products, "hutchinson_diagonal") as bar:
        for Z in blocks:
            total = total + (Z * mm(Z)).sum(1)
            bar.update(Z.shape[1])
    return total / num_products


def xdiag(
    A,
    num_products: int = 100,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | str = "auto",
) -> Tensor:
    """XDiag, the exchangeable diagonal estimator of Epperly, Tropp & Webber 2024 ("XTrace:
    making the most of every sample in stochastic trace estimation", SIAM J. Matrix Anal. Appl.
    45(1), section 2.4 / the ``xdiag`` algorithm).

    With m = ``num_products // 2`` Rademacher test vectors w_i and P_i = Q_(i) Q_(i)^T the
    projector on range(A Omega_{-i}) (the sketch without column i),

        d_i = diag(P_i A) + w_i * ((I - P_i) A w_i),      XDiag = (1/m) sum_i d_i,

    i.e. the exact diagonal of the low-rank part plus a one-vector Hutchinson diagonal of the
    rest, each unbiased since w_i is independent of P_i. From one QR A Omega = Q R,
    P_i = Q Q^T - q_i q_i^T with q_i = Q s_i, s_i the normalised i-th column of R^{-T}; with
    Z = A^T Q (by ``A.adjoint()``: A Q itself for a self-adjoint operator, so A need not be
    symmetric; an operator without ``adjoint()`` is refused) and T = Z^T Omega,

        diag(P_i A) = diag(Q Z^T) - (Q s_i) * (Z s_i),
        (I - P_i) A w_i = y_i - Q t_i + Q s_i (s_i^T t_i).

    Uses 2m products (A Omega and A^T Q; m is capped at D). If A Omega is rank deficient,
    diag(Q Z^T) is exact.
    progress: a progress bar over the products on stderr: ``"auto"`` once the call has run
        :data:`~avionics.curvature.algorithms._progress.DELAY` seconds, True at once, False
        never.

    Example:
        >>> import torch
        >>> from avionics.curvature.algorithms import xdiag
        >>> g = torch.Generator().manual_seed(0)
        >>> U = torch.randn(40, 3, generator=g, dtype=torch.float64)
        >>> A = U @ torch.randn(3, 40, generator=g, dtype=torch.float64)  # not symmetric
        >>> torch.allclose(xdiag(A, 10), torch.diagonal(A))  # rank 3: exact
        True
    """
    sketch = exchangeable_sketch(
        A, num_products, "rademacher", "xdiag", seed, generator, progress, transpose=True
    )
    Om, Y, Q, Z, m = sketch.omega, sketch.Y, sketch.Q, sketch.Z, sketch.m
    exact_part = (Q * Z).sum(1)
    if sketch.rank_deficient:
        return exact_part
    S = sketch.S
    T = Z.T @ Om
    QS, ZS = Q @ S, Z @ S
    st = (S * T).sum(0)  # s_i^T t_i
    residual = Y - Q @ T + QS * st  # columns (I - P_i) A w_i
    return exact_part + ((Om * residual).sum(1) - (QS * ZS).sum(1)) / m
