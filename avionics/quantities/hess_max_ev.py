"""HessMaxEV: the largest algebraic eigenvalue of the Hessian of the mini-batch loss as the user
reduced it (docs/definitions.md, section 2): of the mean loss for ``loss = losses.mean()``, of
the sum (N times that) for ``loss = losses.sum()``.

Lanczos (:func:`avionics.curvature.algorithms.top_eigenpairs`) on Hessian-vector products
through the graph of the step's backward, so it sets ``create_graph = True``: pass
``loss.backward(create_graph=cockpit.create_graph(step))``. Warm-started from the previous
tracked step's eigenvector, kept with the basis storage and the gap estimate of the
one-product check in a :class:`~avionics.curvature.algorithms.lanczos.LanczosState`; ``tol`` is
the relative accuracy of the eigenvalue. It does not touch the global random number generator.
"""

from __future__ import annotations

import math
import warnings
from itertools import accumulate

import torch
from torch import Tensor

from avionics.curvature.algorithms.lanczos import BlockOperator, LanczosState, top_eigenpairs
from avionics.curvature.step._autograd import NO_SECOND_DERIVATIVE
from avionics.persample.precision import computing, computing_dtype
from avionics.quantities.arguments import checked_int, checked_real, checked_seed
from avionics.quantities.base import Quantity, StepData
from avionics.quantities.curvature import _graph_grads
from avionics.schedules import Schedule

# Krylov basis size before a restart of Lanczos.
MAX_BASIS = 20


class WarmStartedTopEigenvalue(Quantity):
    """The largest algebraic eigenvalue of a symmetric operator of the step
    (:meth:`operator`, products through the gradient graph kept by ``create_graph=True``), by
    Lanczos warm-started from the previous tracked step's eigenvector: the machinery HessMaxEV
    and PreconditionedSharpness share (see :class:`HessMaxEV` for the stopping rule, the warm
    start, non-finite products and the seeded first start vector).

    Args:
        schedule: the steps to track (default every step).
        tol: the relative accuracy of the eigenvalue, in [0, 1).
        max_products: the most operator-vector products per step, >= 1.
        seed: the seed of the first step's start vector, in [0, 2**32).
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
        self.tol = checked_real(
            self.name, "tol", tol, "the relative accuracy of the eigenvalue", at_least=0, below=1
        )
        self.max_products = checked_int(
            self.name, "max_products", max_products, 1, "Hessian-vector products per step"
        )
        self.seed = checked_seed(self.name, seed)
        self._lanczos = LanczosState()  # basis storage and the previous eigenpair
        self._warned = False
        self.num_products: dict[int, int] = {}

    def operator(self, data: StepData) -> BlockOperator:
        """The step's symmetric operator, whose largest eigenvalue is stored."""
        raise NotImplementedError(f"{self.name} must implement operator(data).")

    def compute(self, data: StepData):
        result = top_eigenpairs(
            self.operator(data),
            tol=self.tol,
            max_products=self.max_products,
            max_basis=MAX_BASIS,
            generator=torch.Generator().manual_seed(self.seed),
            criterion="eigenvalue",
            state=self._lanczos,
            progress=False,  # (inside a training step: no bar)
        )
        self.num_products[data.step] = result.num_products
        # a non-finite product leaves no eigenpair in the state (the next step starts afresh)
        value = self._lanczos.eigenvalue  # float64, unlike result.values
        if value is None:
            return {data.step: math.nan}
        if not result.converged and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.name}: Lanczos did not reach tol={self.tol} within max_products="
                f"{self.max_products} at step {data.step}; the current estimate is stored. "
                "Raise max_products or tol (warned once).",
                stacklevel=2,
            )
        return {data.step: value}

    @property
    def eigenvector(self) -> Tensor | None:
        """The last step's (unit) eigenvector estimate, flat [D] (a view of the storage)."""
        return self._lanczos.eigenvector

    def state_dict(self) -> dict:
        """The warm start (the last eigenpair and the gap estimate of the one-product check)
        and whether the warning was given."""
        if self._lanczos.eigenvalue is None:
            return {"warned": self._warned}
        state = {
            "warned": self._warned,
            "eigenvalue": self._lanczos.eigenvalue,
            "eigenvector": self._lanczos.eigenvector.clone(),
        }
        if self._lanczos.gap is not None:
            state["gap"] = self._lanczos.gap
        return state

    def load_state_dict(self, state: dict) -> None:
        if "eigenvector" in state:
            lanczos = LanczosState.from_eigenpair(
                state["eigenvector"], state["eigenvalue"], gap=state.get("gap")
            )
        else:
            lanczos = LanczosState()
        self._warned = bool(state.get("warned", False))
        self._lanczos = lanczos


class HessMaxEV(WarmStartedTopEigenvalue):
    """The largest algebraic eigenvalue of the Hessian of the loss as the user reduced it
    (``info["loss"]``: the mean or the sum of the per-sample losses): note, the most positive
    eigenvalue, not the eigenvalue of largest magnitude (a Hessian with a large negative
    eigenvalue still reports its most positive one). For plain SGD on that loss, lr * HessMaxEV
    above 2 means the step is unstable along the top eigenvector.

    Lanczos (:func:`~avionics.curvature.algorithms.top_eigenpairs` with the Kato-Temple
    stopping rule ``criterion="eigenvalue"``: min(r, GAP_SAFETY r^2 / gap) <= tol |theta|, r
    the Ritz residual norm) on Hessian-vector products through the gradient graph kept by
    ``create_graph=True``; each tracked step starts from the previous one's eigenvector. Its
    first product is a Rayleigh quotient check: the quotient theta of that vector is stored
    after this one product when the Kato-Temple bound with the gap estimated by the previous
    steps' Lanczos meets the rule (the module docstring of
    :mod:`avionics.curvature.algorithms.lanczos`), which it does while the Hessian moves
    slowly; otherwise that product is the first Lanczos step. ``tol`` is the relative
    accuracy of the eigenvalue; when ``max_products`` products do not reach it, the
    current estimate is stored and a warning is given (once). The start vector of the first
    step comes from a private seeded generator: the global RNG is untouched.

    A warm start follows the previous step's top eigenvector: if another eigenvector overtakes
    it within one step (the top two eigenvalues cross), a few products may not notice, and
    that step reports the one followed (within tol of an eigenvalue, not of the largest).

    A step whose Hessian-vector products are not finite (NaN or infinite gradients) stores nan;
    the next step starts afresh from the seeded random vector instead of that step's.

    Args:
        schedule: the steps to track (default every step).
        tol: the relative accuracy of the eigenvalue, in [0, 1).
        max_products: the most Hessian-vector products per step, >= 1.
        seed: the seed of the first step's start vector, in [0, 2**32).

    Example:
        Plain SGD at lr = 0.1 on this loss is stable along the top eigenvector while
        lr * HessMaxEV < 2; the second step starts from the first one's eigenvector and needs
        fewer products.

        >>> from avionics.demo import example_run
        >>> from avionics.quantities import HessMaxEV
        >>> sharpness = HessMaxEV(tol=1e-6)
        >>> output = example_run([sharpness], steps=2, lr=0.1)
        >>> round(output[0]["HessMaxEV"], 3), round(output[1]["HessMaxEV"], 3)
        (0.755, 0.749)
        >>> 0.1 * output[1]["HessMaxEV"] < 2
        True
        >>> sharpness.num_products[1] < sharpness.num_products[0]
        True
    """

    def operator(self, data: StepData) -> BlockOperator:
        """v -> H v, per tracked parameter, through the step's gradient graph."""
        hvp = _HessianProduct(_graph_grads(data), _leaves(data), data)
        return BlockOperator(hvp, hvp.slices, hvp.dtype, hvp.device)


def _leaves(data: StepData):
    """What the step's graph is differentiated against (with requires_grad): the tracked
    parameters themselves, or under FSDP their whole unsharded ones (:attr:`StepData.leaves`)."""
    return data.leaves


class _HessianProduct:
    """Row of the storage -> H v, per leaf (a list; None for a leaf H v does not reach), for
    the loss whose graph-carrying gradients are given. The tangents are views of the row."""

    def __init__(self, grads: list[Tensor], leaves: list[Tensor], data: StepData | None = None):
        kept = [k for k, g in enumerate(grads) if g.grad_fn is not None]
        self.data = data  # the step, whose world and share make the product global
        self.grads = [grads[k] for k in kept]
        self.leaves = list(leaves)
        offsets = [0, *accumulate(p.numel() for p in self.leaves)]
        self.slices = [slice(a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
        self.shapes = [p.shape for p in self.leaves]
        self.kept = kept
        self.dim = int(offsets[-1])
        # (a 16-bit model's Lanczos vectors and products in float32)
        self.dtype, self.device = computing_dtype(self.leaves[0].dtype), self.leaves[0].device

    def __call__(self, v: Tensor) -> list[Tensor | None]:
        tangents = [
            v[self.slices[k]].view(self.shapes[k]).to(self.leaves[k].dtype) for k in self.kept
        ]
        try:
            products = list(
                torch.autograd.grad(
                    self.grads, self.leaves, tangents, retain_graph=True, allow_unused=True
                )
            )
            products = [p if p is None else computing(p) for p in products]
        except RuntimeError as error:
            if "is not implemented" in str(error) and "derivative for" in str(error):
                raise RuntimeError(NO_SECOND_DERIVATIVE.format(error=error)) from error
            raise
        data = self.data
        if data is None or data.parallel.world.size == 1:
            return products
        # the global loss's H v: sum_r w_r H_r v, one all-reduce per product
        local = [
            p * data.share if p is not None else torch.zeros_like(leaf)
            for p, leaf in zip(products, self.leaves, strict=True)
        ]
        return data.parallel.sum(local)
