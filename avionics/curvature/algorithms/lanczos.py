"""Extreme eigenpairs of a symmetric operator by Lanczos with full reorthogonalisation.

The Krylov basis V_j = [v_1, ..., v_j] is built from one product ``A @ v`` per step; every new
vector is orthogonalised against the whole basis by classical Gram-Schmidt, repeated when the
first pass cancels most of ``A v``, so the projected matrix T_j = V_j^T A V_j is computed, not
assumed tridiagonal, and the Ritz values never duplicate. With A V_j = V_j T_j + f_j e_j^T and
T_j = Y diag(theta) Y^T, the Ritz pair (theta_i, V_j y_i) has residual norm
r_i = ||A V_j y_i - theta_i V_j y_i|| = ||f_j|| |e_j^T y_i| (Golub & Van Loan, *Matrix
Computations*, 4th ed., section 10.1.4). ||f_j||^2 = ||A v_j||^2 - ||V_j^T A v_j||^2 comes with
the projections, so a product that meets the stopping rule is never orthogonalised.

Stopping rules (``criterion``):

* ``"residual"``: r_i <= tol |theta_i| for all k wanted pairs (ARPACK's rule, so ``tol`` means
  the same as in ``scipy.sparse.linalg.eigsh``); the eigenvalue error is then of the order
  r_i^2 / gap, usually far below ``tol``.
* ``"eigenvalue"``: ``tol`` is the relative accuracy of the eigenvalues. By Kato-Temple
  (Parlett, *The Symmetric Eigenvalue Problem*, section 11.7) the error of theta_i is at most
  r_i and about r_i^2 / gap_i, gap_i the distance to the nearest other Ritz value; the rule is
  min(r_i, GAP_SAFETY r_i^2 / gap_i) <= tol |theta_i|.

  The one-product check: a call warm-started from a :class:`LanczosState` with k = 1 knows,
  after its first product, only the Rayleigh quotient theta = v^T A v of the start vector and
  its residual r = ||A v - theta v||, and no other Ritz value to measure a gap from. It then
  takes ``gap`` from the state: the smallest Ritz gap of the extreme pair over the calls
  that warm-started from the state's own eigenvector since its last fresh start, an estimate
  of the distance theta - lambda_2 to the next eigenvalue. Justification (the Kato-Temple
  inequality: T. Kato, J. Phys. Soc. Japan 4, 1949; G. Temple, Proc. R. Soc. A 119, 1928;
  Parlett, as above): if the interval (lambda_2, +infinity) holds theta and no eigenvalue but
  lambda_1, then theta <= lambda_1 <= theta + r^2 / (theta - lambda_2) (mirrored for the
  smallest eigenvalue). A Ritz gap theta_1 - theta_2 over-estimates lambda_1 - lambda_2
  (Cauchy interlacing: theta_2 <= lambda_2), so the running minimum approaches it from
  above, and GAP_SAFETY covers what it still over-estimates; the rule is the same
  min(r, GAP_SAFETY r^2 / gap) <= tol |theta|. When it holds, the call stops after that one
  product and returns (theta, v); when not, that product is the first Lanczos step: the
  check costs no product.

When the basis reaches ``max_basis`` vectors the iteration is thick-restarted (Wu & Simon 2000,
"Thick-restart Lanczos method for large symmetric eigenvalue problems", SIAM J. Matrix Anal.
Appl. 22(2)): the best Ritz vectors are kept, with the last residual direction, and the
projected matrix becomes an arrowhead; Lanczos continues from there. If the Krylov space
becomes invariant (||f_j|| <= 10 eps max |theta|, rounding level), a random direction
orthogonal to the basis continues the search.

A :class:`LanczosState` keeps the basis storage and the last extreme eigenpair between calls
(a warm start: a start vector close to the wanted eigenvector needs about two products); a
:class:`BlockOperator` gives its product in parts (e.g. per parameter), which are projected
and orthogonalised where they are, without a flat copy.

A product with a NaN or infinite entry ends the iteration: the result's values are nan (not
converged), and a state keeps no eigenpair, so that its next call starts afresh, as it does
from a kept eigenvector that is not finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ._matmul import _as_matmul, _generator
from ._progress import check_progress, progress_bar

# Safety factor on the gap estimate r^2 / gap of the eigenvalue error ("eigenvalue" criterion).
GAP_SAFETY = 10.0
# ||f||^2 is taken from ||Av||^2 - ||V^T Av||^2 unless that difference is below this fraction
# of ||Av||^2, where float cancellation dominates it: then Av is orthogonalised to know ||f||.
LAZY_RESIDUAL_MIN = 1e-2
# Classical Gram-Schmidt is repeated when the first pass removed more than half of ||Av||^2.
REORTHOGONALISE_BELOW = 0.5
# Operators of at most this many entries (or off the CPU) copy each product into the storage
# and work on it there; larger ones are projected per block from the product's own tensors.
FLAT_BELOW = 1 << 18
# A unit start vector is divided by its norm again only when that norm is off by more.
UNIT_NORM_TOL = 1e-6


@dataclass
class EigenResult:
    """Eigenpairs found by Lanczos.

    values: [k], ordered from the most extreme (largest first for ``top_eigenpairs``, smallest
        first for ``bottom_eigenpairs``).
    vectors: [D, k], unit-norm columns matching ``values`` (with a ``state``: a view of its
        storage, overwritten by the next call).
    num_products: operator-vector products used (one per Lanczos step).
    converged: whether all k pairs met the stopping rule.
    residual_norms: [k], the estimated ||A x - theta x|| of each pair.
    """

    values: Tensor
    vectors: Tensor
    num_products: int
    converged: bool
    residual_norms: Tensor


@dataclass(frozen=True)
class BlockOperator:
    """A symmetric operator whose product comes in blocks: ``apply(v)`` returns the parts of
    A v, one per slice of ``slices`` (a part of any shape with that many entries, or None for
    a zero block), e.g. Hessian-vector products per parameter. Lanczos projects and
    orthogonalises the parts where they are, without concatenating them."""

    apply: Callable[[Tensor], list[Tensor | None]]
    slices: list[slice]
    dtype: torch.dtype
    device: torch.device

    @property
    def dim(self) -> int:
        return self.slices[-1].stop

    def __call__(self, v: Tensor) -> list[Tensor | None]:
        return self.apply(v)


class LanczosState:
    """Reusable storage for the Krylov basis and the last call's extreme eigenpair, for a
    sequence of eigenvalue problems of one size (e.g. one per training step).

    A call with this state starts from ``eigenvector`` (unless given ``v0``) and leaves its own
    extreme eigenpair here. ``storage`` [rows, D] holds the basis from row ``start`` on; the
    Ritz vectors go into the rows after the final basis, where the next call's basis starts (a
    call that stops after one product keeps its start row, already its Ritz vector), so a warm
    start copies no vector; when fewer than max_basis + k rows are left, the start vector
    moves back to row 0 (one copy), every ``spare_rows`` calls or so.
    """

    def __init__(self, spare_rows: int = 4):
        self.spare_rows = int(spare_rows)
        self.storage: Tensor | None = None
        self.start = 0
        self.eigenvalue: float | None = None  # float64 Ritz value of the last call
        # the smallest Ritz gap of the extreme pair since the last fresh start (the estimate
        # of the one-product check; module docstring)
        self.gap: float | None = None

    @classmethod
    def from_eigenpair(
        cls,
        eigenvector: Tensor,
        eigenvalue: float,
        spare_rows: int = 4,
        gap: float | None = None,
    ):
        """A state whose next call starts from ``eigenvector`` (e.g. a saved warm start), with
        the saved ``gap`` estimate of the one-product check (None: no check at that call)."""
        if gap is not None and not (math.isfinite(gap) and gap > 0):
            raise ValueError(
                "gap must be a positive finite Ritz gap (the 'gap' a state saved) or None, "
                f"got {gap!r}: pass the saved value, or None to start without it"
            )
        state = cls(spare_rows)
        state.storage = eigenvector.detach().reshape(1, -1).clone()
        state.eigenvalue = float(eigenvalue)
        state.gap = None if gap is None else float(gap)
        return state

    @property
    def eigenvector(self) -> Tensor | None:
        """The last call's unit eigenvector, flat [D] (a view of the storage), or None."""
        return None if self.eigenvalue is None else self.storage[self.start]

    def _rows_from_start(self, D: int, dtype, device, rows: int) -> bool:
        """Make ``rows`` rows available from ``start``; return whether ``storage[start]`` holds
        the previous eigenvector (same size, dtype and device) to start from."""
        s = self.storage
        warm = self.eigenvalue is not None and (s.shape[1], s.dtype, s.device) == (
            D,
            dtype,
            device,
        )
        self.eigenvalue = None
        if warm and self.start + rows <= s.shape[0]:
            return True
        if warm and rows <= s.shape[0]:
            s[0] = s[self.start]
        else:
            self.storage = torch.empty(rows + self.spare_rows, D, dtype=dtype, device=device)
            if warm:
                self.storage[0] = s[self.start]
        self.start = 0
        return warm


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
    criterion: str = "residual",
    state: LanczosState | None = None,
    progress: bool | str = "auto",
) -> EigenResult:
    """The k largest algebraic (not largest magnitude) eigenvalues of a symmetric A, with
    eigenvectors, by Lanczos with full reorthogonalisation and thick restarts.

    A: a dense symmetric tensor [D, D], any operator with ``.shape`` (D, D) and ``@``, or a
        :class:`BlockOperator`.
    tol: with ``criterion="residual"``, stop when every wanted Ritz pair has residual
        ||A x - theta x|| <= tol |theta| (ARPACK's rule; the eigenvalue error is typically
        ~ tol^2 |theta|^2 / gap); with ``"eigenvalue"``, when the Kato-Temple estimate of each
        eigenvalue's error, min(r, GAP_SAFETY r^2 / gap), is <= tol |theta|.
    max_products: budget of operator products (default 500); the result says whether it
        converged within it.
    v0: start vector [D] (a warm start, e.g. the previous step's top eigenvector); a [D, j]
        block is summed over its columns. If None: the state's eigenvector, else random
        Gaussian (from ``seed``/``generator``; a generator on another device than A's is used
        on its own device).
    max_basis: Krylov basis size before a thick restart (default max(50, 3k), at most D).
    state: a :class:`LanczosState` whose storage holds the basis and which keeps the top
        eigenpair for the next call's warm start, with the gap estimate that lets such a call
        (k = 1, ``criterion="eigenvalue"``, no ``v0``) stop after one product (the one-product
        check, module docstring).
    progress: a progress bar over the products on stderr: ``"auto"`` once the call has run
        :data:`~avionics.curvature.algorithms._progress.DELAY` seconds, True at once, False
        never.
    Values are returned largest first; all nan (``converged`` False, the state keeping no
    eigenpair) when a product is not finite.
    """
    return _lanczos_extreme(
        A, k, "LA", tol, max_products, v0, max_basis, seed, generator, criterion, state,
        progress,
    )  # fmt: skip


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
    criterion: str = "residual",
    state: LanczosState | None = None,
    progress: bool | str = "auto",
) -> EigenResult:
    """The k smallest algebraic eigenvalues (most negative first) of a symmetric A, with
    eigenvectors. Same algorithm and arguments as :func:`top_eigenpairs`; values are returned
    smallest first. Note that the stopping rules are relative to |theta|, so eigenvalues very
    close to zero need a small ``tol`` or a large budget."""
    return _lanczos_extreme(
        A, k, "SA", tol, max_products, v0, max_basis, seed, generator, criterion, state,
        progress,
    )  # fmt: skip


def _as_block_operator(A) -> BlockOperator:
    """A :class:`BlockOperator` as is; any other operator as one block."""
    if isinstance(A, BlockOperator):
        return A
    mm = _as_matmul(A)
    return BlockOperator(lambda v: [mm(v)], [slice(0, mm.dim)], mm.dtype, mm.device)


def _lanczos_extreme(
    A, k, which, tol, max_products, v0, max_basis, seed, generator, criterion, state, progress
):
    op = _as_block_operator(A)
    D, dtype, device = op.dim, op.dtype, op.device
    if not 1 <= k <= D:
        raise ValueError(f"k must be between 1 and D={D}, got {k}")
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    if criterion not in ("residual", "eigenvalue"):
        raise ValueError(f"criterion must be 'residual' or 'eigenvalue', got {criterion!r}")
    max_products = 500 if max_products is None else int(max_products)
    if max_products < 1:
        raise ValueError(f"max_products must be >= 1, got {max_products}")
    max_basis = min(D, max(50, 3 * k) if max_basis is None else int(max_basis))
    if max_basis < min(D, k + 2):
        raise ValueError(f"max_basis must be at least k + 2 = {k + 2} (or D), got {max_basis}")
    name = "top_eigenpairs" if which == "LA" else "bottom_eigenpairs"
    check_progress(name, progress)
    gen = None

    def random_unit_vector() -> Tensor:
        nonlocal gen
        if gen is None:
            gen = _generator(seed, generator, device)
        r = torch.randn(D, generator=gen, device=gen.device, dtype=dtype)
        return (r / r.norm()).to(device)

    scratch = state is None
    state = LanczosState(spare_rows=0) if scratch else state
    warm = state._rows_from_start(D, dtype, device, max_basis + k)
    storage, start = state.storage, state.start
    # the one-product check needs the gap of the operator whose eigenvector starts the call
    prior_gap = state.gap if warm and v0 is None and k == 1 else None
    state.gap = None  # (until this call ends with finite products)
    if v0 is not None:
        storage[start] = _unit_start_vector(v0, D, dtype, device)
    elif not warm:
        storage[start] = random_unit_vector()
    if not _renormalise(storage[start]):  # a kept eigenvector that is not finite
        storage[start] = random_unit_vector()

    lanczos = _Lanczos(op, storage, start, k, which, max_basis, random_unit_vector)
    with progress_bar(progress, max_products, name) as bar:
        found = lanczos.run(tol, criterion == "eigenvalue", max_products, bar, prior_gap)
    if found is None:
        return _not_finite(D, k, dtype, device, lanczos.products)
    theta, Y, nb, residuals, converged = found
    wanted = _wanted(nb, min(k, nb), which)
    if nb == 1:  # (the one-product check) the start vector is its Ritz vector: no copy
        X, state.start = storage[start : start + 1], start
    else:
        X = _ritz_vectors(storage[start : start + nb], Y, wanted, storage[start + nb :])
        state.start = start + nb
    state.eigenvalue = float(theta[wanted[0]])
    state.gap = _smallest_gap(prior_gap, _ritz_gap(theta, wanted[0]) if nb > 1 else None)
    values_and_residuals = torch.tensor(
        [[float(theta[i]) for i in wanted], residuals], dtype=dtype
    )
    return EigenResult(
        values=values_and_residuals[0].to(device),
        vectors=X.T.clone(memory_format=torch.contiguous_format) if scratch else X.T,
        num_products=lanczos.products,
        converged=converged,
        residual_norms=values_and_residuals[1],
    )


def _unit_start_vector(v0, D: int, dtype, device) -> Tensor:
    """v0 (a [D, j] block summed over its columns) normalised, after checking it."""
    v = torch.as_tensor(v0).to(device=device, dtype=dtype)
    if v.ndim == 2:
        v = v.sum(1)
    if v.shape != (D,):
        raise ValueError(f"v0 must have shape ({D},), got {tuple(v0.shape)}")
    if not torch.isfinite(v).all() or v.norm() == 0:
        raise ValueError("v0 must be finite and nonzero")
    return v / v.norm()


def _renormalise(v: Tensor) -> bool:
    """Divide the unit start vector by its norm again where float rounding (large D, or the
    previous call's Ritz vector) left that norm off by more than UNIT_NORM_TOL; False (and
    ``v`` untouched) when the norm is not finite."""
    norm = float(v.norm())
    if not math.isfinite(norm):
        return False
    if abs(norm - 1.0) > UNIT_NORM_TOL:
        v.div_(norm)
    return True


def _not_finite(D: int, k: int, dtype, device, products: int) -> EigenResult:
    """The result of an iteration that met a product that is not finite: nan throughout."""
    nan = torch.full((k,), torch.nan, dtype=dtype)
    return EigenResult(
        values=nan.to(device),
        vectors=torch.full((D, k), torch.nan, dtype=dtype, device=device),
        num_products=products,
        converged=False,
        residual_norms=nan,
    )


class _Lanczos:
    """The iteration on the basis rows ``storage[start : start + nb]`` (nb <= max_basis), whose
    last row awaits its product; the row after them receives A v_nb, then the next vector."""

    def __init__(self, op: BlockOperator, storage, start, k, which, max_basis, random_vector):
        self.op, self.storage, self.start = op, storage, start
        self.k, self.which, self.max_basis = k, which, max_basis
        self.random_vector = random_vector
        self.flat = op.dim <= FLAT_BELOW or op.device.type != "cpu"
        self.keep = min(max_basis - 1, max(k + 1, (max_basis + k) // 2))  # kept at a restart
        self.T = np.zeros((max_basis, max_basis))
        self.eps = float(torch.finfo(op.dtype).eps)
        self.products = 0

    def run(self, tol: float, eigenvalue_bound: bool, max_products: int, bar, prior_gap=None):
        """Lanczos steps until the stopping rule, the budget or an exhausted space (nb = D);
        returns (theta, Y, nb, residual norms of the wanted pairs, converged), or None at a
        product that is not finite. Each product advances the progress bar ``bar``.
        ``prior_gap`` (or None) is the gap of the one-product check (module docstring)."""
        T, storage, start, slices = self.T, self.storage, self.start, self.op.slices
        nb, anorm = 1, 0.0
        while True:
            Vw = storage[start : start + nb + 1]  # the basis V and the row w after it
            V, w = Vw[:-1], Vw[-1]
            hv = self.op(V[-1])
            self.products += 1
            bar.update()
            if self.flat:
                _place(hv, slices, w)
                hv = None
                numbers = Vw @ w  # V^T Av and ||Av||^2
            else:  # ||Av||^2 only where it can spare the orthogonalisation (nb = 1: Av ~ theta v)
                numbers = _project(hv, V, slices, squared=nb > 1)
            h = numbers[:-1]
            values = numbers.tolist()
            if not all(map(math.isfinite, values)):  # V^T Av and ||Av||^2 see any nan or inf
                return None
            T[:nb, nb - 1] = T[nb - 1, :nb] = values[:-1]
            squared = values[-1]
            beta2 = squared - float(T[:nb, nb - 1] @ T[:nb, nb - 1])  # ||Av - V V^T Av||^2
            # float cancellation (or nb = 1 per block): orthogonalise now to know beta
            exact = beta2 <= LAZY_RESIDUAL_MIN * squared or (nb == 1 and not self.flat)
            if exact:
                beta = _orthogonalise(hv, Vw, h, slices, T, nb - 1, True)
            else:
                beta = beta2**0.5
            theta, Y = np.linalg.eigh(T[:nb, :nb])
            anorm = max(anorm, abs(float(theta[0])), abs(float(theta[-1])))
            wanted = _wanted(nb, min(self.k, nb), self.which)
            residuals = [beta * abs(float(Y[nb - 1, i])) for i in wanted]
            floor = 10 * self.eps * anorm
            done = nb >= self.k and _converged(
                theta, wanted, residuals, tol, floor, eigenvalue_bound, prior_gap
            )
            invariant = nb == self.op.dim and beta <= 1e3 * floor
            if done or self.products >= max_products or invariant:
                return theta, Y, nb, residuals, done or nb == self.op.dim
            if not exact:
                again = beta2 < REORTHOGONALISE_BELOW * squared
                beta = _orthogonalise(hv, Vw, h, slices, T, nb - 1, again, beta)
                theta, Y = np.linalg.eigh(T[:nb, :nb])
            hv = None
            if beta <= floor:  # an invariant space: continue in a new direction
                _random_orthogonal_direction(w, V, self.random_vector())
            nb = self._thick_restart(theta, Y) if nb == self.max_basis else nb + 1

    def _thick_restart(self, theta, Y) -> int:
        """Basis <- [the ``keep`` best Ritz vectors, the unit residual w], T <- diag(theta
        of those) (the arrowhead's couplings to w come from w's product); returns keep + 1."""
        nb, keep, V = self.max_basis, self.keep, self.storage[self.start :]
        sel = _wanted(nb, keep, self.which)
        coefficients = torch.as_tensor(np.ascontiguousarray(Y[:, sel].T), dtype=V.dtype)
        X = coefficients.to(V.device) @ V[:nb]
        V[keep] = V[nb]
        V[:keep] = X
        self.T[:] = 0.0
        self.T[range(keep), range(keep)] = theta[sel]
        return keep + 1


def _wanted(m: int, n: int, which: str) -> range:
    """Indices of the n most extreme of m ascending Ritz values, most extreme first."""
    return range(m - 1, m - 1 - n, -1) if which == "LA" else range(n)


def _converged(
    theta, wanted, residuals, tol: float, floor: float, eigenvalue_bound: bool, prior_gap=None
):
    """Whether every wanted pair's error estimate (r, or with ``eigenvalue_bound`` the
    Kato-Temple min(r, GAP_SAFETY r^2 / gap)) is <= max(tol |theta|, floor)."""
    for i, r in zip(wanted, residuals, strict=True):
        error = _eigenvalue_error(theta, i, r, prior_gap) if eigenvalue_bound else r
        if error > max(tol * abs(theta[i]), floor):
            return False
    return True


def _eigenvalue_error(theta, i: int, r: float, prior_gap: float | None = None) -> float:
    """min(r, GAP_SAFETY r^2 / gap), gap the distance from theta[i] to its nearest neighbour
    among the ascending Ritz values, or ``prior_gap`` when theta has no other value (the
    one-product check); r alone without a positive gap."""
    gap = _ritz_gap(theta, i) if len(theta) > 1 else (prior_gap or 0.0)
    return min(r, GAP_SAFETY * r * r / gap) if gap > 0 else r


def _ritz_gap(theta, i: int) -> float:
    """The distance from theta[i] to its nearest neighbour among the ascending Ritz values."""
    return float(min(abs(theta[i] - theta[n]) for n in (i - 1, i + 1) if 0 <= n < len(theta)))


def _smallest_gap(*gaps: float | None) -> float | None:
    """The smallest of the known positive gaps (None when none is known: coincident Ritz
    values give no gap to bound an error by)."""
    known = [g for g in gaps if g is not None and g > 0]
    return min(known) if known else None


def _ritz_vectors(V: Tensor, Y: np.ndarray, wanted: range, rows: Tensor) -> Tensor:
    """x_i = V^T y_i for the wanted pairs, written into the first rows of ``rows`` [n, D]."""
    for n, i in enumerate(wanted):
        y = torch.as_tensor(np.ascontiguousarray(Y[:, i]), dtype=V.dtype).to(V.device)
        torch.mv(V.t(), y, out=rows[n])
    return rows[: len(wanted)]


def _random_orthogonal_direction(w: Tensor, V: Tensor, r: Tensor) -> None:
    """w <- r minus its projection on the rows of V (Gram-Schmidt twice), normalised."""
    for _ in range(2):
        r = r - V.T @ (V @ r)
    w.copy_(r / r.norm())


def _place(hv: list[Tensor | None], slices: list[slice], w: Tensor) -> None:
    """Copy the product into the row ``w`` (zeros for a block with None)."""
    for part, s in zip(hv, slices, strict=True):
        if part is None:
            w[s].zero_()
        else:
            w[s].copy_(part.reshape(-1))


def _project(hv: list[Tensor | None], V: Tensor, slices: list[slice], squared: bool) -> Tensor:
    """[V^T Av, ||Av||^2 (0 without ``squared``)], per block from the product's tensors (a
    block with None is 0)."""
    numbers = torch.zeros(V.shape[0] + 1, dtype=V.dtype, device=V.device)
    h, norm2 = numbers[:-1], numbers[-1:]
    for part, s in zip(hv, slices, strict=True):
        if part is not None:
            flat = part.reshape(-1)
            h.addmv_(V[:, s], flat)
            if squared:
                norm2 += torch.dot(flat, flat)
    return numbers


def _orthogonalise(
    hv, Vw: Tensor, h: Tensor, slices, T, j: int, again: bool, norm: float | None = None
) -> float:
    """w = Av - V V^T Av (``h`` = V^T Av; ``Vw`` = [V; w], rows of the storage) in the row w,
    normalised: from the product's parts ``hv``, per block, or, with ``hv`` None, in place
    (w holds Av). With ``again``, a second classical Gram-Schmidt pass, whose projections are
    added to column j of T; its projections and ||w||^2 come from one product [V; w] w, and
    the correction and the normalisation from one ``addmv_``. Without ``again``, ``norm``
    (if given) is ||w||, known from ||Av||^2 - ||V^T Av||^2 where that difference is at least
    half of ||Av||^2 (so within a few eps of the norm), and w is divided by it without reading
    its norm from the device. Returns ||w|| before the normalisation."""
    V, w = Vw[:-1], Vw[-1]
    if hv is None:
        w.addmv_(V.t(), h, alpha=-1)
    else:  # w = Av - h_0 v_0 in one elementwise pass (addmv with out= copies first), then
        h0 = float(h[0])  # the other rows in place
        for part, s in zip(hv, slices, strict=True):
            if part is None:
                torch.mul(V[0, s], -h0, out=w[s])
            else:
                torch.add(part.reshape(-1), V[0, s], alpha=-h0, out=w[s])
        if V.shape[0] > 1:
            w.addmv_(V[1:].t(), h[1:], alpha=-1)
    if not again:
        beta = float(w.norm()) if norm is None else norm
        if beta > 0:
            w.div_(beta)
        return beta
    numbers = torch.mv(Vw, w)
    values = numbers.tolist()
    T[: j + 1, j] += values[:-1]
    T[j, : j + 1] = T[: j + 1, j]
    beta = max(values[-1] - sum(x * x for x in values[:-1]), 0.0) ** 0.5
    if beta > 0:
        w.addmv_(V.t(), numbers[:-1], beta=1.0 / beta, alpha=-1.0 / beta)
    return beta
