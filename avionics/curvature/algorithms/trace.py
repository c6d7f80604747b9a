"""Stochastic trace estimators: Hutchinson, Hutch++ and XTrace.

All of them use block products ``A @ Omega`` (many test vectors per product call) and take a
budget ``num_products`` of operator-vector products, so they can be compared at equal cost.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._matmul import _as_matmul, _generator, _probe_blocks, _random
from ._progress import check_progress, progress_bar
from ._sketch import exchangeable_sketch


def hutchinson_trace(
    A,
    num_products: int = 100,
    *,
    distribution: str = "rademacher",
    chunk_size: int | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | str = "auto",
) -> Tensor:
    """Hutchinson's estimator tr(A) ~ (1/m) sum_i z_i^T A z_i with m = ``num_products`` i.i.d.
    test vectors, E[z z^T] = I (Hutchinson 1989, "A stochastic estimator of the trace of the
    influence matrix for Laplacian smoothing splines"). Unbiased; variance 2 ||A||_F^2 / m minus
    2 sum_i A_ii^2 / m for Rademacher vectors (the default), 2 ||A||_F^2 / m for Gaussian ones.

    The probes are drawn and multiplied ``chunk_size`` at a time (all at once by default); the
    result does not depend on ``chunk_size``.
    progress: a progress bar over the products on stderr: ``"auto"`` once the call has run
        :data:`~avionics.curvature.algorithms._progress.DELAY` seconds, True at once, False
        never; it advances once per block of ``chunk_size`` probes.
    """
    mm = _as_matmul(A)
    if num_products < 1:
        raise ValueError(f"num_products must be >= 1, got {num_products}")
    check_progress("hutchinson_trace", progress)
    gen = _generator(seed, generator, mm.device)
    total = torch.zeros((), dtype=mm.dtype, device=mm.device)
    blocks = _probe_blocks(
        mm.dim, num_products, chunk_size, distribution, gen, mm.dtype, mm.device
    )
    with progress_bar(progress, num_products, "hutchinson_trace") as bar:
        for Z in blocks:
            total = total + (Z * mm(Z)).sum()
            bar.update(Z.shape[1])
    return total / num_products


def hutchpp_trace(
    A,
    num_products: int = 99,
    *,
    distribution: str = "rademacher",
    seed: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | str = "auto",
) -> Tensor:
    """Hutch++ (Meyer, Musco, Musco, Woodruff 2021, "Hutch++: Optimal stochastic trace
    estimation", Algorithm 1): with m = ``num_products``, s = m // 3 sketch vectors S and
    g = m - 2 s test vectors G,

        Q = orth(A S),   tr(A) ~ tr(Q^T A Q) + (1/g) tr(G^T (I - QQ^T) A (I - QQ^T) G).

    Exact on the top of the spectrum captured by Q, Hutchinson on the rest; unbiased. The
    products A Q and A (I - QQ^T) G are done as one block. Falls back to Hutchinson for m < 3.
    progress: a progress bar over the products on stderr: ``"auto"`` once the call has run
        :data:`~avionics.curvature.algorithms._progress.DELAY` seconds, True at once, False
        never.
    """
    mm = _as_matmul(A)
    if num_products < 3:
        return hutchinson_trace(
            A,
            num_products,
            distribution=distribution,
            seed=seed,
            generator=generator,
            progress=progress,
        )
    check_progress("hutchpp_trace", progress)
    gen = _generator(seed, generator, mm.device)
    s = num_products // 3
    g = num_products - 2 * s
    S = _random((mm.dim, s), distribution, gen, mm.dtype, mm.device)
    G = _random((mm.dim, g), distribution, gen, mm.dtype, mm.device)
    with progress_bar(progress, s + min(mm.dim, s) + g, "hutchpp_trace") as bar:
        Q, _ = torch.linalg.qr(mm(S))  # [D, min(D, s)]
        bar.update(s)
        q = Q.shape[1]
        G = G - Q @ (Q.T @ G)
        AB = mm(torch.cat([Q, G], 1))
        bar.update(q + g)
    return (Q * AB[:, :q]).sum() + (G * AB[:, q:]).sum() / g


def xtrace(
    A,
    num_products: int = 100,
    *,
    distribution: str = "gaussian",
    improved: bool | None = None,
    return_error: bool = False,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | str = "auto",
):
    """XTrace, the exchangeable trace estimator of Epperly, Tropp & Webber 2024 ("XTrace: making
    the most of every sample in stochastic trace estimation", SIAM J. Matrix Anal. Appl.
    45(1), eq. (1.4)-(1.5) and Algorithm 2).

    With m = ``num_products // 2`` test vectors Omega = [w_1 ... w_m] (``distribution``:
    ``"gaussian"``, the default, or ``"rademacher"``; any i.i.d. vectors with E[w w^T] = I) and,
    for each i,
    Q_(i) an orthonormal basis of range(A Omega_{-i}) (the sketch without column i),

        tr_i = tr(Q_(i)^T A Q_(i)) + w_i^T (I - Q_(i) Q_(i)^T) A (I - Q_(i) Q_(i)^T) w_i,
        XTrace = (1/m) sum_i tr_i.

    Each tr_i is unbiased (w_i is independent of Q_(i)), so XTrace is unbiased; every vector
    serves both as a sketch vector and as a Hutchinson test vector. All m downdated bases come
    from one QR A Omega = Q R: Q_(i) Q_(i)^T = Q Q^T - q_i q_i^T with q_i = Q s_i, s_i the
    normalised i-th column of R^{-T}. Only A Omega and A Q are needed: 2m products (m is capped
    at D).

    improved: the paper's variance reduction (section 2.2): replace u_i = (I - P_i) w_i by
        u_i * sqrt(N - m + 1) / ||u_i||, which keeps E[u_i u_i^T] = I - P_i (u_i is isotropic in
        the (N - m + 1)-dimensional complement) and removes the fluctuation of ||u_i||. It
        needs rotation-invariant (Gaussian) test vectors: a projected Rademacher vector is not
        isotropic, and the rescaling would bias the estimate. None (default): True for
        Gaussian vectors, False for Rademacher ones (True with Rademacher is refused).
    return_error: also return the error estimate std(tr_i) / sqrt(m) of the paper's eq. (2.8).
    progress: a progress bar over the products on stderr: ``"auto"`` once the call has run
        :data:`~avionics.curvature.algorithms._progress.DELAY` seconds, True at once, False
        never.

    A need not be symmetric. If A Omega is rank deficient (A of rank < m), range(A Omega)
    contains range(A) and tr(Q^T A Q) is the exact trace, which is returned.

    Example:
        >>> import torch
        >>> from avionics.curvature.algorithms import xtrace
        >>> U = torch.randn(50, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        >>> A = U @ U.T  # rank 3: 8 products hold its range, the estimate is exact
        >>> bool(torch.isclose(xtrace(A, 8, distribution="rademacher"), torch.trace(A)))
        True
    """
    if improved is None:
        improved = distribution in ("gaussian", "normal")
    elif improved and distribution not in ("gaussian", "normal"):
        raise ValueError(
            f"xtrace: improved=True rescales the projected test vectors, which is unbiased only "
            f"for Gaussian ones, got distribution={distribution!r}; pass improved=False (or "
            "leave it None) with Rademacher vectors, or distribution='gaussian'."
        )
    sketch = exchangeable_sketch(
        A, num_products, distribution, "xtrace", seed, generator, progress
    )
    Om, Q, R, Z, m = sketch.omega, sketch.Q, sketch.R, sketch.Z, sketch.m
    N = Om.shape[0]
    H = Q.T @ Z
    trH = torch.diagonal(H).sum()
    if sketch.rank_deficient:
        return (trH, torch.zeros_like(trH)) if return_error else trH

    # S = column-normalised R^{-T}: Q S e_i is the direction removed from Q_(i).
    S = sketch.S
    W = Q.T @ Om  # w_i projected: columns Q^T w_i
    Tm = Z.T @ Om  # columns Z^T w_i = Q^T A^T w_i
    c = (S * W).sum(0)  # s_i^T Q^T w_i
    # tr(P_i A P_i) = tr(H) - s_i^T H s_i
    first = trH - (S * (H @ S)).sum(0)
    # u_i = (I - P_i) w_i = w_i - Q v_i with v_i = Q^T w_i - s_i c_i;  A u_i = Q r_i - Z v_i
    Vv = W - S * c
    second = (W * R).sum(0) - (Tm * Vv).sum(0) - (Vv * R).sum(0) + (Vv * (H @ Vv)).sum(0)
    if improved:
        unorm2 = (Om * Om).sum(0) - (W * W).sum(0) + c**2
        second = second * (N - m + 1) / unorm2
    ests = first + second
    estimate = ests.mean()
    if return_error:
        return estimate, ests.std() / math.sqrt(m)
    return estimate
