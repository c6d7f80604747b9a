"""Closed forms for layers whose weight gradient is a sum of outer products.

Linear and convolution layers (after unfolding) both have, for sample n and group g,

    G_{n,g} = sum_t delta_{n,g,t} x_{n,g,t}^T          (x: [N, G, T, I], delta: [N, G, T, O])

with t over the shared axes (sequence positions, spatial locations). Then

    ||G_n||^2    = sum_{g,t,s} (delta_t . delta_s)(x_t . x_s)        (Gram, cost N G T^2 (I+O))
                 = sum_g ||delta_{n,g}||^2 ||x_{n,g}||^2              (T = 1, cost N G (I+O))
    G_n . V      = sum_{g,t} delta_{n,g,t} . (V_g x_{n,g,t})          (cost N G T I O)
    G_n . g      = mean_m K_nm,  K_nm = G_n . G_m                      (T = 1, cost N^2 G (I+O))
    sum_n G_n^2  = sum_n (delta_n^2)(x_n^2)^T                         (T = 1 only)

for the mean gradient g = mean_m G_m, and materialising G_n costs N G T I O.
:meth:`Bilinear.statistics` picks the path: without shared axes (T = 1) the closed forms; with
them the plan chosen for the request among materialising G_n (by any of the layer's gradient
kernels) and the Gram form with projections (by any of its projection kernels), measured on
the step's own tensors where the layer offers kernels of its own (:mod:`kernels`), else by
FLOPs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from avionics.persample.request import Accumulator, OuterProducts, Request
from avionics.persample.rules.base import Rule, chunk_size
from avionics.persample.rules.factored import FactoredDirection, dense
from avionics.persample.rules.kernels import LayerKernels, Plan, choose

# The kernels every bilinear form has: G_n as the einsum of delta and the (unfolded) input,
# G_n . V by mapping V onto the smaller side; and the prefix of the plans that materialise G_n.
UNFOLDED_GRADIENTS = "unfold + bmm"
UNFOLDED_PROJECTIONS = "the unfolded input"
_BY = "G_n by "


class Bilinear:
    """Per-sample gradients G_n = sum_t delta_t x_t^T of a weight of shape ``weight_shape``.

    ``inputs(start, stop)`` gives x of those samples, [stop - start, G, T, I]: a convolution
    unfolds its input only a chunk of samples at a time when the gradients are materialised.
    ``kernels``: the layer's own ways to form G_n and G_n . V besides the unfolded ones, and
    the key under which :mod:`kernels` keeps the measured choice between them (None: the
    unfolded forms, chosen by FLOPs).
    """

    def __init__(
        self,
        inputs: Callable[[int, int], Tensor],
        delta: Tensor,
        weight_shape,
        kernels: LayerKernels | None = None,
    ):
        self.inputs, self.delta, self.weight_shape = inputs, delta, weight_shape
        self.kernels = kernels
        self.n, self.groups, self.t, self.o = delta.shape
        self.i = math.prod(weight_shape) // (self.groups * self.o)
        self._x: Tensor | None = None
        self._gram_matrix: Tensor | None = None

    @property
    def gradient_kernels(self) -> dict[str, Callable[[int, int], Tensor]]:
        """G_n of samples start..stop-1 shaped like the weight, by name, the prior first
        (built on each use: the Bilinear keeps no bound method of itself, no cycle)."""
        own = {UNFOLDED_GRADIENTS: self._unfolded_gradients}
        if self.kernels is None:
            return own
        return _prior_first({**own, **self.kernels.gradients}, self.kernels.prior_gradients)

    @property
    def projection_kernels(self) -> dict[str, Callable[..., Tensor]]:
        """G_n . V of samples start..stop-1 (all without a range) for V shaped like the
        weight, by name, the prior first."""
        own = {UNFOLDED_PROJECTIONS: self._unfolded_projection}
        if self.kernels is None:
            return own
        return _prior_first({**own, **self.kernels.projections}, self.kernels.prior_projections)

    @property
    def x(self) -> Tensor:
        """x of all samples (the closed forms need it whole)."""
        if self._x is None:
            self._x = self.inputs(0, self.n)
        return self._x

    def _inputs(self, start: int, stop: int) -> Tensor:
        return self._x[start:stop] if self._x is not None else self.inputs(start, stop)

    def materialize(self, start: int, stop: int) -> Tensor:
        name = self._choose(Request(), {}, self._materialised_plans(Request(), {}, 0))
        return self.gradient_kernels[name.removeprefix(_BY)](start, stop)

    def _unfolded_gradients(self, start: int, stop: int) -> Tensor:
        """G_n = sum_t delta_t x_t^T of samples start..stop-1 from x (unfolded by chunk)."""
        g = torch.matmul(self.delta[start:stop].transpose(2, 3), self._inputs(start, stop))
        return g.reshape(stop - start, *self.weight_shape)

    def statistics(self, request: Request, directions: dict[str, Tensor], index: int) -> dict:
        if self.t > 1:
            return self._shared_axes_statistics(request, directions, index)
        if request.visitors and self.groups == 1:
            # the visitors take g_n = delta_n x_n^T unmultiplied; the rest has closed forms
            outer = OuterProducts(self.delta[:, 0, 0], self.x[:, 0, 0])
            for visit in request.visitors:
                visit(index, outer)
            request = dataclasses.replace(request, visitors=())
        if request.visitors:
            acc = Accumulator(request, {k: dense(v) for k, v in directions.items()}, index)
            for start, stop in self._ranges(0, self.n):
                acc.add(self._unfolded_gradients(start, stop))
            return acc.result()
        d = self.delta
        out: dict = {}
        if request.sq_norms:
            if request.sample_mean in directions and self._mean_projection_by_gram():
                out["sq_norms"] = self._gram().diagonal()
            else:
                d_sq = torch.linalg.vector_norm(d, dim=-1).square()
                x_sq = torch.linalg.vector_norm(self.x, dim=-1).square()
                out["sq_norms"] = (d_sq * x_sq).sum((1, 2))
        if directions:
            out["projections"] = {}
            for name, v in directions.items():
                if isinstance(v, FactoredDirection):
                    if self.groups == 1:
                        out["projections"][name] = v.project(d[:, 0, 0], self.x[:, 0, 0])
                        continue
                    v = v.dense()
                if name == request.sample_mean and self._mean_projection_by_gram():
                    out["projections"][name] = self._gram().mean(1)
                else:
                    out["projections"][name] = self._unfolded_projection(v)
        if request.sum_sq:
            s = torch.einsum("ngo,ngi->goi", d[:, :, 0].pow(2), self.x[:, :, 0].pow(2))
            out["sum_sq"] = s.reshape(self.weight_shape)
        return out

    def _shared_axes_statistics(self, request: Request, directions, index: int) -> dict:
        """With shared axes (T > 1): the statistics by the plan chosen for the request (see
        :meth:`_plans`), either from materialised G_n or by the closed forms."""
        directions = {k: dense(v) for k, v in directions.items()}
        if self.kernels is None and (request.visitors or request.sum_sq):
            # only materialising G_n answers these, and without kernels of its own the layer
            # has one way to (what _choose would pick, without building the plans each step)
            return self._materialised(request, directions, index, UNFOLDED_GRADIENTS, 0, self.n)
        plans = self._plans(request, directions, index)
        return plans[self._choose(request, directions, plans)].run(0, self.n)

    def _plans(self, request: Request, directions, index: int) -> dict[str, Plan]:
        """The exact ways to answer ``request`` with directions ``directions``, by name.

        Materialising G_n costs G T I O per sample (by any of the gradient kernels), the
        Gram form of ||G_n||^2 G T^2 (I + O) and each projection G_n . V G T I O (by any of the
        projection kernels); sum_n G_n^2 and the visitors need G_n materialised.
        """
        plans = self._materialised_plans(request, directions, index)
        if request.sum_sq or request.visitors:
            return plans
        g, t, i, o = self.groups, self.t, self.i, self.o
        gram = g * t * t * (i + o) if request.sq_norms else 0
        kernels = self.projection_kernels if directions else {"": None}
        for kernel in kernels:
            name = ", ".join(
                ["Gram form"] * request.sq_norms + [f"projections by {kernel}"] * bool(directions)
            )
            plans[name] = Plan(
                gram + len(directions) * g * t * i * o,
                functools.partial(self._closed_forms, request, directions, kernel),
            )
        return plans

    def _materialised_plans(self, request: Request, directions, index: int) -> dict[str, Plan]:
        per_sample = self.groups * self.i * self.o
        reductions = (request.sq_norms + request.sum_sq + len(directions)) * per_sample
        return {
            _BY + kernel: Plan(
                self.t * per_sample + reductions,
                functools.partial(self._materialised, request, directions, index, kernel),
            )
            for kernel in self.gradient_kernels
        }

    def _prior(self, request: Request, directions, plans: dict[str, Plan]) -> str:
        """The plan taken unmeasured: by FLOPs between materialising and the closed forms
        (materialising from two directions on without the layer's own projections), each by
        the layer's prior kernels."""
        closed = [name for name in plans if not name.startswith(_BY)]
        own_projection = next(iter(self.projection_kernels)) != UNFOLDED_PROJECTIONS
        if not closed or (request.sq_norms and not self._uses_gram()):
            return next(iter(plans))
        if len(directions) >= 2 and not own_projection:
            return next(iter(plans))
        return closed[0]

    def _choose(self, request: Request, directions, plans: dict[str, Plan]) -> str:
        prior = self._prior(request, directions, plans)
        if self.kernels is None:
            return prior
        kind = (request.sq_norms, request.sum_sq, bool(request.visitors), len(directions))
        asked = _describe_request(request, len(directions))
        return choose(
            (*self.kernels.key, kind), plans, prior, lambda: f"{self.kernels.describe()}, {asked}"
        )

    def _materialised(self, request, directions, index: int, kernel: str, start, stop) -> dict:
        """The statistics of samples start..stop-1 from their G_n, formed by ``kernel`` a
        chunk of samples at a time."""
        acc, gradients = Accumulator(request, directions, index), self.gradient_kernels[kernel]
        for a, b in self._ranges(start, stop):
            acc.add(gradients(a, b))
        return acc.result()

    def _closed_forms(self, request, directions, kernel: str, start: int, stop: int) -> dict:
        """||G_n||^2 by the Gram form and G_n . V by ``kernel``, for samples start..stop-1."""
        out: dict = {}
        if request.sq_norms:
            x = self.x if (start, stop) == (0, self.n) else self._inputs(start, stop)
            dd, xx = _position_gram(self.delta[start:stop]), _position_gram(x)
            out["sq_norms"] = (dd * xx).reshape(stop - start, -1).sum(1)
        if directions:
            project = self.projection_kernels[kernel]
            ranged = (start, stop) != (0, self.n)  # (a kernel projects all samples by default)
            out["projections"] = {
                name: project(v.reshape(self.weight_shape), *((start, stop) * ranged))
                for name, v in directions.items()
            }
        return out

    def _mean_projection_by_gram(self) -> bool:
        """Whether g_n . g is cheaper from the Gram matrix: N^2 G (I+O) < N G I O (T = 1)."""
        return self.t == 1 and self.n * (self.i + self.o) < self.i * self.o

    def _gram(self) -> Tensor:
        """K_nm = G_n . G_m = sum_g (delta_{n,g} . delta_{m,g}) (x_{n,g} . x_{m,g}) for T = 1.

        Since g = mean_m G_m, g_n . g = mean_m K_nm and ||G_n||^2 = K_nn.
        """
        if self._gram_matrix is None:
            d, x = self.delta[:, :, 0], self.x[:, :, 0]
            dd = torch.einsum("ngo,mgo->gnm", d, d)
            xx = torch.einsum("ngi,mgi->gnm", x, x)
            self._gram_matrix = (dd * xx).sum(0)
        return self._gram_matrix

    def _unfolded_projection(self, v: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        """G_n . V = sum_{g,t} delta_{n,g,t} . (V_g x_{n,g,t}) of samples start..stop-1 (all
        by default) for V shaped like the weight, V mapped onto the smaller side, over chunks
        of samples."""
        v = v.reshape(self.groups, self.o, self.i)
        parts = []
        for delta, x in self._sample_chunks(self.i + min(self.i, self.o), start, stop):
            if self.t > 1 and x.transpose(2, 3).is_contiguous():
                # unfolded convolution inputs hold the positions last in memory: contract in
                # that layout, [n, g, i or o, t], not through the transposed views
                x, delta = x.transpose(2, 3), delta.transpose(2, 3)
                if self.o <= self.i:
                    parts.append((torch.matmul(v, x) * delta).sum((1, 2, 3)))
                else:
                    parts.append((torch.matmul(v.transpose(1, 2), delta) * x).sum((1, 2, 3)))
            elif self.o <= self.i:  # (x [n, g, t, i] by V_g^T [g, i, o], batched over n, g)
                parts.append((torch.matmul(x, v.transpose(1, 2)) * delta).sum((1, 2, 3)))
            else:
                parts.append((torch.matmul(delta, v) * x).sum((1, 2, 3)))
        return torch.cat(parts)

    def total(self) -> Tensor:
        """sum_n G_n, over chunks of samples. No G_n is materialised: a chunk holds its inputs
        and output gradients (and their copies in the layout of the contraction), not its
        gradients."""
        total = None
        for delta, x in self._sample_chunks(2 * (self.i + self.o)):
            part = torch.einsum("ngto,ngti->goi", delta, x)
            total = part if total is None else total.add_(part)
        return total.reshape(self.weight_shape)

    def _sample_chunks(self, per_position: int, start: int = 0, stop: int | None = None):
        """(delta, x) of consecutive chunks of samples start..stop-1 (all by default), each
        chunk's temporaries of ``per_position`` elements per group and position within the
        chunk budget; x is unfolded one chunk at a time (unless it is already whole)."""
        per_sample = self.groups * self.t * per_position
        step = chunk_size(self.n, per_sample, self.delta.element_size())
        for a, b in _runs(start, self.n if stop is None else stop, step):
            yield self.delta[a:b], self._inputs(a, b)

    def _ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Chunks of samples start..stop-1 whose gradients and inputs fit the chunk budget."""
        per_sample = self.groups * (self.i * self.o + self.t * self.i)
        return _runs(start, stop, chunk_size(self.n, per_sample, self.delta.element_size()))

    def _uses_gram(self) -> bool:
        """Whether ||G_n||^2 by the Gram form takes fewer FLOPs than materialising G_n."""
        return self.t * self.t * (self.i + self.o) < self.t * self.i * self.o


def _position_gram(a: Tensor) -> Tensor:
    """(a_{n,g,t} . a_{n,g,s}) as [N G, T, T] for a [N, G, T, K]: one batched product (an
    einsum of the same contraction dispatches four times as many operations)."""
    flat = a.reshape(-1, a.shape[2], a.shape[3])
    return torch.bmm(flat, flat.transpose(1, 2))


def position_sums(d: Tensor) -> Tensor:
    """sum_t d_{n,g,t} as [N, G * O] for d [N, G, T, O] (one operation with one group)."""
    return d.sum((1, 2)) if d.shape[1] == 1 else d.sum(2).flatten(1)


def _runs(start: int, stop: int, step: int):
    """(a, b) of consecutive runs of at most ``step`` samples covering start..stop-1."""
    return [(a, min(stop, a + step)) for a in range(start, stop, step)]


def _prior_first(kernels: dict, prior: str) -> dict:
    """``kernels`` with ``prior`` first."""
    return {prior: kernels[prior], **kernels}


def _describe_request(request: Request, directions: int) -> str:
    """'squared norms and 1 projection', for the log of a measured choice."""
    asked = ["squared norms"] * request.sq_norms + ["sums of squares"] * request.sum_sq
    if directions:
        asked.append(f"{directions} projection{'s' * (directions > 1)}")
    if request.visitors:
        asked.append("materialised gradients")
    return " and ".join(asked) or "per-sample gradients"


class BilinearRule(Rule):
    """A layer with a bilinear weight gradient and an optional bias (grad b = sum_t delta_t).

    Subclasses set ``self.delta`` [N, G, T, O] and either ``self.x`` [N, G, T, I] or their own
    :meth:`inputs`, with the scale in one of them: in delta (always where T = 1), or in x with
    ``delta_scale`` set to it.
    """

    x: Tensor
    delta: Tensor
    # what delta still has to be multiplied by (1 where the scale is already in delta; a rule
    # may scale the smaller factor x instead when that changes nothing but the bias)
    delta_scale: float = 1

    def inputs(self, start: int, stop: int) -> Tensor:
        """x of samples start..stop-1, [stop - start, G, T, I]."""
        return self.x[start:stop]

    def _weight(self) -> Bilinear:
        if getattr(self, "_bilinear", None) is None:
            # the Bilinear calls back into the rule through weak references: a cycle rule ->
            # Bilinear -> rule would keep the step's captured tensors alive after the step,
            # until the garbage collector happens to run
            kernels = self.kernels()
            if kernels is not None:
                kernels = dataclasses.replace(
                    kernels,
                    gradients={k: _weak(f) for k, f in kernels.gradients.items()},
                    projections={k: _weak(f) for k, f in kernels.projections.items()},
                    describe=_weak(kernels.describe),
                )
            self._bilinear = Bilinear(
                _weak(self.inputs), self.delta, self.module.weight.shape, kernels
            )
        return self._bilinear

    def kernels(self) -> LayerKernels | None:
        """The layer's own ways to form G_n and G_n . V besides the unfolded ones, or None."""
        return None

    def _bias(self) -> Tensor:
        d = self.delta  # without shared axes (T = 1) the bias's g_n is delta_n itself: a view
        bias = d.reshape(len(d), -1) if d.shape[2] == 1 else position_sums(d)
        return bias if self.delta_scale == 1 else bias * self.delta_scale

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        weight = self._weight()
        return [
            weight.materialize(start, stop) if name == "weight" else self._bias()[start:stop]
            for name in self.names
        ]

    def statistics(self, requests: list[Request], directions) -> list[dict]:
        results = []
        for k, name in enumerate(self.names):
            if name == "weight":
                results.append(self._weight().statistics(requests[k], directions[k], k))
            else:
                acc = Accumulator(requests[k], {d: dense(v) for d, v in directions[k].items()}, k)
                acc.add(self._bias())
                results.append(acc.result())
        return results

    def total(self) -> list[Tensor]:
        return [
            self._weight().total() if name == "weight" else self._bias().sum(0)
            for name in self.names
        ]


def _weak(method: Callable) -> Callable:
    """A bound method that does not keep its object alive."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class FactoredWeights:
    """Shared by the rules whose weights are :class:`Bilinear` forms of factors (x, delta)
    kept per weight in ``self.factors`` and whose biases are per-sample sums of delta: mixed
    into a :class:`~avionics.persample.rules.base.Rule` subclass that gives
    ``_weight_form(name)``, ``_bias(name)`` ([N, *bias shape]) and ``is_weight(name)``.
    Where ``self.factors`` is None (no closed form for these calls), the next class in the
    method order computes them."""

    factors: dict | None

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        if self.factors is None:
            return super().materialize(start, stop)
        return [
            self._weight_form(name).materialize(start, stop)
            if self.is_weight(name)
            else self._bias(name)[start:stop]
            for name in self.names
        ]

    def statistics(self, requests: list[Request], directions) -> list[dict]:
        if self.factors is None:
            return super().statistics(requests, directions)
        results = []
        for k, name in enumerate(self.names):
            if self.is_weight(name):
                results.append(self._weight_form(name).statistics(requests[k], directions[k], k))
            else:
                acc = Accumulator(requests[k], {d: dense(v) for d, v in directions[k].items()}, k)
                acc.add(self._bias(name))
                results.append(acc.result())
        return results

    def total(self) -> list[Tensor]:
        if self.factors is None:
            return super().total()
        return [
            self._weight_form(name).total() if self.is_weight(name) else self._bias(name).sum(0)
            for name in self.names
        ]
