"""HessMaxEV: the largest algebraic eigenvalue of the mini-batch loss Hessian (SPEC section 2).

Lanczos on Hessian-vector products through the graph of the step's backward, so it sets
``create_graph = True``: pass ``loss.backward(create_graph=cockpit.create_graph(step))``.
Warm-started from the previous tracked step's eigenvector; ``tol`` is the relative accuracy
of the eigenvalue. It does not touch the global random number generator.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from avionics.persample.second_order import NO_SECOND_DERIVATIVE
from avionics.quantities.base import Quantity, StepData
from avionics.quantities.curvature import _graph_grads
from avionics.schedules import Schedule


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
        self._previous: Tensor | None = None
        self._basis: Tensor | None = None
        self._warned = False
        self.num_products: dict[int, int] = {}

    def compute(self, data: StepData):
        grads = _graph_grads(self, data)
        leaves = _leaves(data)
        scale = 1.0 / data.batch_size if data.reduction == "sum" else 1.0
        hvp = _HessianProduct(grads, leaves, scale)
        v0 = self._previous
        if v0 is None or v0.shape != (hvp.dim,) or v0.dtype != hvp.dtype:
            gen = torch.Generator(device="cpu").manual_seed(self.seed)
            v0 = torch.randn(hvp.dim, generator=gen, dtype=hvp.dtype).to(hvp.device)
            self._basis = torch.empty(
                min(MAX_BASIS, hvp.dim), hvp.dim, dtype=hvp.dtype, device=hvp.device
            )
        value, vector, products, converged = top_hessian_eigenpair(
            hvp, v0, self.tol, self.max_products, self._basis
        )
        self._previous = vector
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


def _leaves(data: StepData):
    """The tracked parameters themselves (with requires_grad), to differentiate against."""
    return data.extra["tracked"]


class _HessianProduct:
    """v -> H v (flat [D]) for scale * (the loss whose graph-carrying gradients are given)."""

    def __init__(self, grads: list[Tensor], leaves: list[Tensor], scale: float):
        kept = [k for k, g in enumerate(grads) if g.grad_fn is not None]
        self.kept, self.scale = kept, scale
        self.grads = [grads[k] for k in kept]
        self.leaves = list(leaves)
        self.sizes = [p.numel() for p in leaves]
        self.shapes = [p.shape for p in leaves]
        self.dim = sum(self.sizes)
        self.dtype, self.device = leaves[0].dtype, leaves[0].device

    def __call__(self, v: Tensor) -> Tensor:
        parts = v.split(self.sizes)
        tangents = [parts[k].view(self.shapes[k]) for k in self.kept]
        try:
            hv = torch.autograd.grad(
                self.grads, self.leaves, tangents, retain_graph=True, allow_unused=True
            )
        except RuntimeError as error:
            if "is not implemented" in str(error) and "derivative for" in str(error):
                raise RuntimeError(NO_SECOND_DERIVATIVE.format(error=error)) from error
            raise
        flat = torch.cat(
            [
                (h if h is not None else torch.zeros_like(p)).reshape(-1)
                for h, p in zip(hv, self.leaves, strict=True)
            ]
        )
        return flat.mul_(self.scale) if self.scale != 1.0 else flat


# Ritz vectors kept before an explicit restart of the Lanczos basis.
MAX_BASIS = 20
# Safety factor on the gap estimate r^2 / (theta_1 - theta_2) of the eigenvalue error.
GAP_SAFETY = 10.0


def top_hessian_eigenpair(
    hvp, v0: Tensor, tol: float, max_products: int, basis: Tensor | None = None
) -> tuple[float, Tensor, int, bool]:
    """The largest algebraic eigenvalue of a symmetric operator, warm-started from ``v0``:
    (value, unit eigenvector, products used, converged).

    Lanczos with full reorthogonalisation (classical Gram-Schmidt twice) on the basis
    V_j = [v_1, ..., v_j], one product per step, T_j = V_j^T H V_j = Y diag(theta) Y^T. The top
    Ritz pair (theta_1, V_j y_1) has residual norm r = beta_j |e_j^T y_1|, and (Kato-Temple,
    Parlett, *The Symmetric Eigenvalue Problem*, section 11.7) the eigenvalue error is at most
    r and about r^2 / gap, gap = theta_1 - theta_2 estimated from the Ritz values. The
    iteration stops when min(r, GAP_SAFETY r^2 / gap) <= tol |theta_1|. A start vector close to
    the top eigenvector (the previous step's) needs about two products. After ``MAX_BASIS``
    products the basis restarts from the current Ritz vector. ``basis``: optional storage for
    the basis, [MAX_BASIS or fewer, D], reused between calls (fresh memory is slow to touch).
    """
    dim = v0.numel()
    if basis is None:
        basis = torch.empty(min(MAX_BASIS, dim), dim, dtype=v0.dtype, device=v0.device)
    V, size = basis, basis.shape[0]
    T = torch.zeros(size, size, dtype=torch.float64)
    V[0] = v0 / v0.norm()
    j, products = 0, 0
    while True:
        w = hvp(V[j])  # a fresh tensor: updated in place below (large allocations are slow)
        products += 1
        Vj = V[: j + 1]
        h = Vj @ w
        w.addmv_(Vj.t(), h, alpha=-1)
        h2 = Vj @ w
        w.addmv_(Vj.t(), h2, alpha=-1)
        column = (h + h2).to(torch.float64).cpu()
        T[: j + 1, j] = column
        T[j, : j + 1] = column
        beta = float(w.norm())
        theta, Y = torch.linalg.eigh(T[: j + 1, : j + 1])
        top = float(theta[-1])
        r = beta * abs(float(Y[j, -1]))
        err = r
        if j > 0 and float(theta[-1] - theta[-2]) > 0:
            err = min(r, GAP_SAFETY * r * r / float(theta[-1] - theta[-2]))
        converged = err <= tol * abs(top)
        if converged or products >= max_products:
            break
        if j + 1 == size or beta <= torch.finfo(v0.dtype).eps * max(abs(top), 1e-30):
            x = torch.mv(Vj.t(), Y[:, -1].to(v0.dtype))  # restart (or leave an invariant space)
            torch.div(x, x.norm(), out=V[0])
            T.zero_()
            j = 0
            continue
        torch.div(w, beta, out=V[j + 1])
        j += 1
    x = torch.mv(V[: j + 1].t(), Y[:, -1].to(v0.dtype))
    return top, x.div_(x.norm()), products, converged
