"""HessMaxEV: the largest algebraic eigenvalue of the mini-batch loss Hessian (SPEC section 2).

Lanczos on Hessian-vector products through the graph of the step's backward, so it sets
``create_graph = True``: pass ``loss.backward(create_graph=cockpit.create_graph(step))``.
Warm-started from the previous tracked step's eigenvector; ``tol`` is the relative accuracy
of the eigenvalue. It does not touch the global random number generator.

Cost (see :func:`top_hessian_eigenpair`): besides the products, a warm-started step of two
products reads or writes about 19 D-vectors, all in preallocated storage: no
flat copy (``cat``) of a product on large operators, the last product of a step is not
orthogonalised, the second Gram-Schmidt pass is fused with the normalisation.
"""

from __future__ import annotations

import warnings
from itertools import accumulate

import numpy as np
import torch
from torch import Tensor

from avionics.persample.second_order import NO_SECOND_DERIVATIVE
from avionics.quantities.base import Quantity, StepData
from avionics.quantities.curvature import _graph_grads
from avionics.schedules import Schedule

# Ritz vectors kept before an explicit restart of the Lanczos basis.
MAX_BASIS = 20
# Safety factor on the gap estimate r^2 / (theta_1 - theta_2) of the eigenvalue error.
GAP_SAFETY = 10.0
# Storage rows beyond the basis: each converged step writes its Ritz vector into the row
# after its basis, where the next step's basis starts; the start moves back to row 0 (one
# copy) when fewer than MAX_BASIS + 1 rows are left.
SPARE_ROWS = 4
# The residual norm of the last product of a step comes from ||Hv||^2 - ||V^T Hv||^2, without
# forming Hv - V V^T Hv, unless that difference is below this fraction of ||Hv||^2 (float32
# dot products over ~1e6 entries err by ~1e-5 relative: below it, cancellation would dominate
# the difference, and the vector is orthogonalised explicitly).
LAZY_RESIDUAL_MIN = 1e-2
# Operators of at most this many entries (on the CPU) copy each product into the storage and
# work on it there: fewer calls; larger ones work per leaf on the product's own tensors.
FLAT_BELOW = 1 << 18
# Classical Gram-Schmidt is repeated when the first pass removed more than half of ||Hv||^2.
# Measured (float32, D ~ 1e6): near convergence (||w|| ~ 0.02 ||Hv||) one pass leaves w at a
# cosine ~5e-4 with the basis, above sqrt(eps) ~ 2.4e-4 (Simon's semi-orthogonality), so the
# second pass is needed; with ||w|| > 0.7 ||Hv|| one pass leaves ~1.5e-5, well below it.
REORTHOGONALISE_BELOW = 0.5


class HessMaxEV(Quantity):
    """The largest algebraic eigenvalue of the mini-batch (mean) loss Hessian: note, the most
    positive eigenvalue, not the eigenvalue of largest magnitude (a Hessian with a large
    negative eigenvalue still reports its most positive one).

    Lanczos (:func:`top_hessian_eigenpair`) on Hessian-vector products through the gradient
    graph kept by ``create_graph=True``; each tracked step starts from the previous one's
    eigenvector, so a steady training run needs about two products per step. ``tol`` is the
    relative accuracy of the eigenvalue; when ``max_products`` products do not reach it, the
    current estimate is stored and a warning is given (once). The start vector of the first
    step comes from a private seeded generator: the global RNG is untouched.

    A warm start follows the previous step's top eigenvector: if another eigenvector overtakes
    it within one step (the top two eigenvalues cross), a few products may not notice, and
    that step reports the one followed (within tol of an eigenvalue, not of the largest).
    """

    create_graph = True

    def __init__(
        self,
        schedule: Schedule | None = None,
        tol: float = 1e-3,
        max_products: int = 100,
        seed: int = 0,
    ):
        super().__init__(schedule)
        self.tol, self.max_products, self.seed = float(tol), int(max_products), int(seed)
        self._storage: Tensor | None = None  # [basis rows + 1 + SPARE_ROWS, D]
        self._start = 0  # the row of _storage that holds the previous eigenvector
        self._warned = False
        self.num_products: dict[int, int] = {}

    def compute(self, data: StepData):
        grads = _graph_grads(self, data)
        hvp = _HessianProduct(grads, _leaves(data))
        storage = self._storage
        fresh = storage is None or storage.shape[1] != hvp.dim
        if fresh or storage.dtype != hvp.dtype or storage.device != hvp.device:
            rows = min(MAX_BASIS, hvp.dim) + 1 + SPARE_ROWS
            storage = torch.empty(rows, hvp.dim, dtype=hvp.dtype, device=hvp.device)
            gen = torch.Generator(device="cpu").manual_seed(self.seed)
            v0 = torch.randn(hvp.dim, generator=gen, dtype=hvp.dtype)
            storage[0] = v0.div_(v0.norm())
            self._storage, self._start = storage, 0
        elif self._start + min(MAX_BASIS, hvp.dim) + 1 > storage.shape[0]:
            storage[0] = storage[self._start]
            self._start = 0
        value, row, products, converged = top_hessian_eigenpair(
            hvp, storage, self._start, self.tol, self.max_products
        )
        self._start = row
        if data.reduction == "sum":  # the graph is that of the sum: H_mean = H_sum / N
            value = value / data.batch_size
        self.num_products[data.step] = products
        if not converged and not self._warned:
            self._warned = True
            warnings.warn(
                f"HessMaxEV: Lanczos did not reach tol={self.tol} within max_products="
                f"{self.max_products} at step {data.step}; the current estimate is stored. "
                "Raise max_products or tol (warned once).",
                stacklevel=2,
            )
        return {data.step: value}

    @property
    def eigenvector(self) -> Tensor | None:
        """The last step's (unit) eigenvector estimate, flat [D] (a view of the storage)."""
        return None if self._storage is None else self._storage[self._start]


def _leaves(data: StepData):
    """The tracked parameters themselves (with requires_grad), to differentiate against."""
    return data.extra["tracked"]


class _HessianProduct:
    """Row of the storage -> H v, per leaf (a list; None for a leaf H v does not reach), for
    the loss whose graph-carrying gradients are given. The tangents are views of the row."""

    def __init__(self, grads: list[Tensor], leaves: list[Tensor]):
        kept = [k for k, g in enumerate(grads) if g.grad_fn is not None]
        self.grads = [grads[k] for k in kept]
        self.leaves = list(leaves)
        offsets = [0, *accumulate(p.numel() for p in self.leaves)]
        self.slices = [slice(a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        self.shapes = [p.shape for p in self.leaves]
        self.kept = kept
        self.dim = int(offsets[-1])
        self.dtype, self.device = self.leaves[0].dtype, self.leaves[0].device

    def __call__(self, v: Tensor) -> list[Tensor | None]:
        tangents = [v[self.slices[k]].view(self.shapes[k]) for k in self.kept]
        try:
            return list(
                torch.autograd.grad(
                    self.grads, self.leaves, tangents, retain_graph=True, allow_unused=True
                )
            )
        except RuntimeError as error:
            if "is not implemented" in str(error) and "derivative for" in str(error):
                raise RuntimeError(NO_SECOND_DERIVATIVE.format(error=error)) from error
            raise


def top_hessian_eigenpair(
    hvp: _HessianProduct, storage: Tensor, start: int, tol: float, max_products: int
) -> tuple[float, int, int, bool]:
    """The largest algebraic eigenvalue of a symmetric operator, warm-started from the vector
    ``storage[start]``: (value, row of ``storage`` that holds the unit eigenvector, products
    used, converged).

    Lanczos with full reorthogonalisation (classical Gram-Schmidt, repeated when the first
    pass cancels) on the basis V_j = storage[start : start + j + 1], one product per step,
    T_j = V_j^T H V_j = Y diag(theta) Y^T. The top Ritz pair (theta_1, V_j y_1) has residual
    norm r = beta_j |e_j^T y_1|, and (Kato-Temple, Parlett, *The Symmetric Eigenvalue
    Problem*, section 11.7) the eigenvalue error is at most r and about r^2 / gap, gap =
    theta_1 - theta_2 estimated from the Ritz values. The iteration stops when
    min(r, GAP_SAFETY r^2 / gap) <= tol |theta_1|. A start vector close to the top eigenvector
    (the previous step's) needs about two products. After ``m = min(MAX_BASIS, D)`` products
    the basis restarts from the current Ritz vector. ``storage`` needs rows
    ``start .. start + m``; the eigenvector is written into the row after the final basis.

    Memory traffic, the cost besides the products: beta_j^2 = ||Hv||^2 - ||V_j^T Hv||^2 comes
    with the projections, so that a product that meets the stopping rule is never
    orthogonalised (unless float cancellation makes that difference meaningless). For
    D > FLAT_BELOW (on the CPU) the projections are taken per leaf from the product's own
    tensors and Hv - V_j V_j^T Hv is written straight into the next row, per leaf: no flat copy
    of Hv. Smaller operators copy Hv into the next row and work on it there (fewer calls).
    """
    size = min(MAX_BASIS, storage.shape[1])
    flat = storage.shape[1] <= FLAT_BELOW or storage.device.type != "cpu"
    v0 = storage[start]
    norm = float(v0.norm())
    if abs(norm - 1.0) > 1e-6:
        v0.div_(norm)
    T = np.zeros((size, size))
    floor = float(torch.finfo(storage.dtype).eps)
    j, products = 0, 0
    while True:
        Vw = storage[start : start + j + 2]  # the basis V and the row w after it
        V, w = Vw[:-1], Vw[-1]
        hv = hvp(storage[start + j])
        products += 1
        if flat:
            _place(hv, hvp.slices, w)
            del hv
            numbers = Vw @ w  # V^T Hv and ||Hv||^2
        else:  # ||Hv||^2 only where it can spare the orthogonalisation (j = 0: Hv ~ theta v)
            numbers = _project(hv, V, hvp.slices, squared=j > 0)
        h = numbers[:-1]
        values = numbers.tolist()
        T[: j + 1, j] = T[j, : j + 1] = values[:-1]
        squared = values[-1]
        beta2 = squared - float(T[: j + 1, j] @ T[: j + 1, j])  # ||Hv - V V^T Hv||^2
        # float cancellation (or j = 0 per leaf): orthogonalise now to know beta
        exact = beta2 <= LAZY_RESIDUAL_MIN * squared or (j == 0 and not flat)
        if exact:
            beta = _orthogonalise(None if flat else hv, Vw, h, hvp.slices, T, j, True)
        else:
            beta = beta2**0.5
        theta, Y = np.linalg.eigh(T[: j + 1, : j + 1])
        top = float(theta[-1])
        r = beta * abs(float(Y[j, -1]))
        err = r
        if j > 0 and float(theta[-1] - theta[-2]) > 0:
            err = min(r, GAP_SAFETY * r * r / float(theta[-1] - theta[-2]))
        converged = err <= tol * abs(top)
        if converged or products >= max_products:
            break
        if not exact:
            again = beta2 < REORTHOGONALISE_BELOW * squared
            beta = _orthogonalise(None if flat else hv, Vw, h, hvp.slices, T, j, again)
            theta, Y = np.linalg.eigh(T[: j + 1, : j + 1])
        hv = None
        if j + 1 == size or beta <= floor * max(abs(top), 1e-30):
            # restart from the Ritz vector (or leave an invariant space): it goes into the
            # row after the basis (free now), then into the first row
            torch.mv(V.t(), _column(Y, storage), out=w)
            storage[start] = w.div_(w.norm())
            T[:] = 0.0
            j = 0
            continue
        j += 1
    # The Ritz vector goes into the row after the basis (which holds Hv, no longer needed).
    x = storage[start + j + 1]
    torch.mv(storage[start : start + j + 1].t(), _column(Y, storage), out=x)
    return top, start + j + 1, products, converged


def _column(Y: np.ndarray, like: Tensor) -> Tensor:
    """The top Ritz vector's coefficients, on the storage's device and dtype."""
    return torch.as_tensor(np.ascontiguousarray(Y[:, -1]), dtype=like.dtype).to(like.device)


def _place(hv: list[Tensor | None], slices: list[slice], w: Tensor) -> None:
    """Copy the product into the row ``w`` (zeros for a leaf with None)."""
    for part, s in zip(hv, slices, strict=True):
        if part is None:
            w[s].zero_()
        else:
            w[s].copy_(part.reshape(-1))


def _project(hv: list[Tensor | None], V: Tensor, slices: list[slice], squared: bool) -> Tensor:
    """[V^T Hv, ||Hv||^2 (0 without ``squared``)], per leaf from the product's tensors (a
    leaf with None is 0)."""
    numbers = torch.zeros(V.shape[0] + 1, dtype=V.dtype, device=V.device)
    h, norm2 = numbers[:-1], numbers[-1:]
    for part, s in zip(hv, slices, strict=True):
        if part is not None:
            flat = part.reshape(-1)
            h.addmv_(V[:, s], flat)
            if squared:
                norm2 += torch.dot(flat, flat)
    return numbers


def _orthogonalise(hv, Vw: Tensor, h: Tensor, slices, T, j: int, again: bool) -> float:
    """w = Hv - V V^T Hv (``h`` = V^T Hv; ``Vw`` = [V; w], rows of the storage) in the row w,
    normalised: from the product's tensors ``hv``, per leaf, or, with ``hv`` None, in place
    (w holds Hv). With ``again``, a second classical Gram-Schmidt pass, whose projections are
    added to column j of T; its projections and ||w||^2 come from one product [V; w] w, and
    the correction and the normalisation from one ``addmv_``. Returns ||w|| before the
    normalisation."""
    V, w = Vw[:-1], Vw[-1]
    if hv is None:
        w.addmv_(V.t(), h, alpha=-1)
    else:  # w = Hv - h_0 v_0 in one elementwise pass (addmv with out= copies first), then
        h0 = float(h[0])  # the other rows in place
        for part, s in zip(hv, slices, strict=True):
            if part is None:
                torch.mul(V[0, s], -h0, out=w[s])
            else:
                torch.add(part.reshape(-1), V[0, s], alpha=-h0, out=w[s])
        if V.shape[0] > 1:
            w.addmv_(V[1:].t(), h[1:], alpha=-1)
    if not again:
        beta = float(w.norm())
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
