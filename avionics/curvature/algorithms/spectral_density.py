"""Spectral density by stochastic Lanczos quadrature (SLQ).

For a symmetric A with eigenpairs (lambda_i, u_i), the smoothed spectral density is

    phi_sigma(t) = (1/D) sum_i g_sigma(t - lambda_i) = (1/D) tr g_sigma(t I - A),

g_sigma the Gaussian kernel of width sigma. For a test vector v with E[v v^T] = I and
||v||^2 = D (Rademacher), v^T f(A) v / D is an unbiased estimate of tr f(A) / D, and m steps
of Lanczos from v / ||v|| give the Gauss quadrature v^T f(A) v / ||v||^2 ~ sum_j tau_j
f(theta_j), with theta_j the eigenvalues of the tridiagonal T_m and tau_j the squared first
components of its eigenvectors (Golub & Meurant; Lin, Saad, Yang 2016 "Approximating spectral
densities of large matrices", SIAM Review 58(1), section 3.2; Ghorbani, Krishnan, Xiao 2019,
"An investigation into neural net optimization via Hessian eigenvalue density", eq. (5)-(6)).
The estimate averages over the probes:

    phi(t) ~ (1/n_v) sum_l sum_j tau_j^(l) g_sigma(t - theta_j^(l)).

All probes run their Lanczos recurrences together: one block product ``A @ [v_1 ... v_nv]``
per step; each probe is fully reorthogonalised against its own basis (memory: num_steps *
num_probes vectors of size D; ``reorthogonalize=False`` keeps only the last two per probe, at
the price of spurious copies of converged Ritz values, whose weights are small).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._matmul import MatMul, _as_matmul, _generator, _random
from ._progress import check_progress, progress_bar


@dataclass
class SpectralDensity:
    """A smoothed spectral density on a grid; unpacks as ``grid, density = ...``.

    grid, density: [num_points]; ``density`` is a probability density (integrates to ~1 over
        the grid), the fraction of eigenvalues per unit length.
    nodes, weights: [num_probes, m] quadrature nodes (Ritz values) and weights (each row sums
        to 1; zero-weight padding after a breakdown).
    lower, upper: the estimated spectrum boundaries, the extreme Ritz values over all probes.
    sigma: the Gaussian kernel width used.
    """

    grid: Tensor
    density: Tensor
    nodes: Tensor
    weights: Tensor
    lower: float
    upper: float
    sigma: float

    def __iter__(self):
        return iter((self.grid, self.density))


def spectral_density(
    A,
    num_probes: int = 10,
    num_steps: int = 80,
    *,
    num_points: int = 1024,
    bandwidth: float = 0.01,
    margin: float = 0.05,
    reorthogonalize: bool = True,
    boundaries: tuple[float, float] | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | str = "auto",
) -> SpectralDensity:
    """Gaussian-smoothed spectral density of a symmetric A by stochastic Lanczos quadrature.

    num_probes: Rademacher probe vectors (their Lanczos runs share block products).
    num_steps: Lanczos steps per probe (products = num_steps block products of num_probes
        columns); at most D.
    Boundaries: the spectrum is estimated to lie in [lower, upper], the smallest and largest
        Ritz values over all probes (extreme Ritz values converge first and from inside, so
        they slightly underestimate the true range). With spread = upper - lower, the kernel
        width is sigma = ``bandwidth`` * spread, and the grid has ``num_points`` points on
        [lower - margin * spread, upper + margin * spread] (margin >= 3 * bandwidth keeps the
        kernels' mass on the grid). A zero spread (A = c I) uses spread = max(|c|, 1).
        ``boundaries`` (lower, upper), e.g. from :func:`approximate_boundaries`, replaces the
        extreme Ritz values (an interval that holds the whole spectrum puts the kernels of
        the extreme eigenvalues on the grid).
    reorthogonalize: full reorthogonalisation per probe (default; see the module docstring).
    progress: a progress bar over the products on stderr: ``"auto"`` once the call has run
        :data:`~avionics.curvature.algorithms._progress.DELAY` seconds, True at once, False
        never.
    """
    mm = _as_matmul(A)
    D = mm.dim
    if num_probes < 1 or num_steps < 1:
        raise ValueError("num_probes and num_steps must be >= 1")
    if boundaries is not None:
        _check_boundaries(boundaries)
    check_progress("spectral_density", progress)
    m = min(num_steps, D)
    gen = _generator(seed, generator, mm.device)
    V0 = _random((D, num_probes), "rademacher", gen, mm.dtype, mm.device)
    with progress_bar(progress, m * num_probes, "spectral_density") as bar:
        alphas, betas, lengths = _batched_lanczos(mm, V0, m, reorthogonalize, bar)

    nodes = torch.zeros(num_probes, m, dtype=torch.float64)
    weights = torch.zeros(num_probes, m, dtype=torch.float64)
    for p in range(num_probes):
        n = int(lengths[p])
        Tm = torch.diag(alphas[p, :n]) + torch.diag(betas[p, : n - 1], 1)
        Tm = Tm + torch.diag(betas[p, : n - 1], -1)
        theta, Y = torch.linalg.eigh(Tm)
        nodes[p, :n] = theta
        weights[p, :n] = Y[0] ** 2
    active = weights > 0
    lower, upper = float(nodes[active].min()), float(nodes[active].max())
    if boundaries is not None:
        lower, upper = (float(b) for b in boundaries)
    spread = upper - lower
    if spread <= 1e-12 * max(abs(lower), abs(upper), 1e-300):
        spread = max(abs(upper), 1.0)
    sigma = bandwidth * spread
    grid = torch.linspace(
        lower - margin * spread, upper + margin * spread, num_points, dtype=torch.float64
    )
    kernel = torch.exp(-0.5 * ((grid[:, None, None] - nodes[None]) / sigma) ** 2)
    kernel = kernel / (sigma * math.sqrt(2 * math.pi))
    density = (kernel * weights[None]).sum((1, 2)) / num_probes
    return SpectralDensity(
        grid=grid.to(mm.dtype),
        density=density.to(mm.dtype),
        nodes=nodes,
        weights=weights,
        lower=lower,
        upper=upper,
        sigma=sigma,
    )


def approximate_boundaries(
    A,
    num_steps: int = 20,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[float, float]:
    """An interval [lower, upper] that holds the spectrum of a symmetric A, from
    ``num_steps`` products (one Lanczos run from a Rademacher vector, fully reorthogonalised).

    With theta_min, theta_max the extreme Ritz values of the m-step Lanczos tridiagonal and
    beta_m the norm of its last residual f_m = A v_m - alpha_m v_m - beta_{m-1} v_{m-1},

        lower = theta_min - beta_m,   upper = theta_max + beta_m

    (Zhou & Li, "Bounding the spectrum of large Hermitian matrices", Linear Algebra Appl. 435,
    2011; the bounds Lin, Saad & Yang 2016, section 3.1, use for spectral densities). The
    Ritz values lie inside the spectrum and every Ritz value is within beta_m of an
    eigenvalue, so the widened interval holds the extreme eigenvalues in practice (a start
    vector nearly orthogonal to an extreme eigenvector can miss it; no bound from products
    alone is certain). After an invariant subspace (beta = 0) the Ritz values are eigenvalues
    and the interval is exact. ``num_steps`` is capped at D.

    Example:
        >>> import torch
        >>> from avionics.curvature.algorithms import approximate_boundaries
        >>> A = torch.diag(torch.linspace(-1.0, 3.0, 100, dtype=torch.float64))
        >>> lower, upper = approximate_boundaries(A, 20)
        >>> lower <= -1.0 and 3.0 <= upper
        True
    """
    mm = _as_matmul(A)
    if num_steps < 1:
        raise ValueError(f"approximate_boundaries needs num_steps >= 1, got {num_steps}")
    m = min(num_steps, mm.dim)
    gen = _generator(seed, generator, mm.device)
    v0 = _random((mm.dim, 1), "rademacher", gen, mm.dtype, mm.device)
    with progress_bar(False, m, "approximate_boundaries") as bar:
        alphas, betas, lengths = _batched_lanczos(mm, v0, m, True, bar)
    n = int(lengths[0])
    T = (
        torch.diag(alphas[0, :n])
        + torch.diag(betas[0, : n - 1], 1)
        + torch.diag(betas[0, : n - 1], -1)
    )
    theta = torch.linalg.eigvalsh(T)
    residual = float(betas[0, m - 1]) if n == m else 0.0
    return float(theta[0]) - residual, float(theta[-1]) + residual


def _check_boundaries(boundaries) -> None:
    if (
        not isinstance(boundaries, (tuple, list))
        or len(boundaries) != 2
        or not all(isinstance(b, (int, float)) and math.isfinite(b) for b in boundaries)
        or boundaries[0] > boundaries[1]
    ):
        raise ValueError(
            f"spectral_density: boundaries must be (lower, upper), finite, lower <= upper, got "
            f"{boundaries!r}; pass e.g. approximate_boundaries(A), or None."
        )


def _batched_lanczos(mm: MatMul, V0: Tensor, m: int, reorthogonalize: bool, bar):
    """m Lanczos steps from each column of V0 at once, fully reorthogonalised per column
    (or plain three-term Lanczos if not ``reorthogonalize``); each block product advances the
    progress bar ``bar`` by its columns.

    Returns alphas [b, m], betas [b, m] (float64, CPU; betas[:, j] couples steps j and j+1,
    betas[:, m - 1] is the norm of the last residual) and the per-column length (number of
    valid steps; shorter after an invariant subspace, whose last residual is 0).
    """
    D, b = V0.shape
    eps = torch.finfo(V0.dtype).eps
    basis = torch.zeros(m if reorthogonalize else 2, D, b, dtype=V0.dtype, device=V0.device)
    alphas = torch.zeros(b, m, dtype=torch.float64)
    betas = torch.zeros(b, m, dtype=torch.float64)
    lengths = torch.full((b,), m, dtype=torch.long)
    alive = torch.ones(b, dtype=torch.bool, device=V0.device)
    v = V0 / V0.norm(dim=0, keepdim=True)
    scale = torch.zeros(b, dtype=V0.dtype, device=V0.device)
    for j in range(m):
        basis[j if reorthogonalize else j % 2] = v
        w = mm(v)
        bar.update(b)
        alpha = (v * w).sum(0)
        alphas[:, j] = alpha.double().cpu()
        scale = torch.maximum(scale, alpha.abs())
        if reorthogonalize:
            for _ in range(2):  # full reorthogonalisation against each column's own basis
                coef = torch.einsum("jdb,db->jb", basis[: j + 1], w)
                w = w - torch.einsum("jdb,jb->db", basis[: j + 1], coef)
        else:
            w = w - alpha * v
            if j > 0:
                w = (
                    w
                    - torch.as_tensor(betas[:, j - 1], dtype=w.dtype, device=w.device)
                    * basis[(j - 1) % 2]
                )
        beta = w.norm(dim=0)
        if j + 1 == m:  # the last residual norm, for approximate_boundaries
            betas[:, j] = torch.where(alive, beta, torch.zeros_like(beta)).double().cpu()
            break
        ended = alive & (beta <= 1e3 * eps * torch.clamp(scale, min=1e-300))
        for p in torch.nonzero(ended).flatten().tolist():
            lengths[p] = j + 1
        alive = alive & ~ended
        beta = torch.where(alive, beta, torch.zeros_like(beta))
        betas[:, j] = beta.double().cpu()
        v = torch.where(alive, w / torch.where(alive, beta, torch.ones_like(beta)), 0.0)
        if not alive.any():
            break
    return alphas, betas, lengths
