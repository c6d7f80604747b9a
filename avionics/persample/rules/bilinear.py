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
:meth:`Bilinear.statistics` picks the cheapest path.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from avionics.persample.request import MEAN_GRADIENT, Accumulator, OuterProducts, Request
from avionics.persample.rules.base import Rule, chunk_size
from avionics.persample.rules.factored import FactoredDirection, dense


class Bilinear:
    """Per-sample gradients G_n = sum_t delta_t x_t^T of a weight of shape ``weight_shape``.

    ``inputs(start, stop)`` gives x of those samples, [stop - start, G, T, I]: a convolution
    unfolds its input only a chunk of samples at a time when the gradients are materialised.
    """

    def __init__(
        self,
        inputs: Callable[[int, int], Tensor],
        delta: Tensor,
        weight_shape,
        project: Callable[[Tensor], Tensor] | None = None,
        gradients: Callable[[int, int], Tensor] | None = None,
    ):
        self.inputs, self.delta, self.weight_shape = inputs, delta, weight_shape
        self.project = project  # G_n . V for V shaped like the weight, if the layer has its own
        # G_n of samples start..stop-1 shaped like the weight, where the layer has a faster way
        # than unfolding (None otherwise)
        self.gradients = gradients
        self.n, self.groups, self.t, self.o = delta.shape
        self.i = math.prod(weight_shape) // (self.groups * self.o)
        self._x: Tensor | None = None
        self._gram_matrix: Tensor | None = None

    @property
    def x(self) -> Tensor:
        """x of all samples (the closed forms need it whole)."""
        if self._x is None:
            self._x = self.inputs(0, self.n)
        return self._x

    def materialize(self, start: int, stop: int) -> Tensor:
        if self.gradients is not None:
            return self.gradients(start, stop)
        x = self._x[start:stop] if self._x is not None else self.inputs(start, stop)
        g = torch.einsum("ngto,ngti->ngoi", self.delta[start:stop], x)
        return g.reshape(stop - start, *self.weight_shape)

    def _uses_gram(self) -> bool:
        gram = self.t * self.t * (self.i + self.o)
        return gram < self.t * self.i * self.o

    def statistics(self, request: Request, directions: dict[str, Tensor], index: int) -> dict:
        if request.visitors and self.t == 1 and self.groups == 1:
            # the visitors take g_n = delta_n x_n^T unmultiplied; the rest has closed forms
            outer = OuterProducts(self.delta[:, 0, 0], self.x[:, 0, 0])
            for visit in request.visitors:
                visit(index, outer)
            request = dataclasses.replace(request, visitors=())
        materialize = bool(request.visitors) or (request.sum_sq and self.t > 1)
        materialize |= request.sq_norms and self.t > 1 and not self._uses_gram()
        # with shared axes (T > 1) each projection costs N T I O, while materialising G_n
        # costs N T I O once and N I O per direction: cheaper from two directions on (the
        # convolutions' own projections are kept: they need no unfolded input)
        materialize |= self.t > 1 and self.project is None and len(directions) >= 2
        if materialize:
            acc = Accumulator(request, {k: dense(v) for k, v in directions.items()}, index)
            step = self._step()
            for start in range(0, self.n, step):
                acc.add(self.materialize(start, min(self.n, start + step)))
            return acc.result()
        d = self.delta
        out: dict = {}
        if request.sq_norms:
            x = self.x  # (unfolded only where a closed form needs it whole)
            if self.t == 1 and MEAN_GRADIENT in directions and self._mean_projection_by_gram():
                out["sq_norms"] = self._gram().diagonal()
            elif self.t == 1:
                d_sq = torch.linalg.vector_norm(d, dim=-1).square()
                x_sq = torch.linalg.vector_norm(x, dim=-1).square()
                out["sq_norms"] = (d_sq * x_sq).sum((1, 2))
            else:
                dd = torch.einsum("ngto,ngso->ngts", d, d)
                xx = torch.einsum("ngti,ngsi->ngts", x, x)
                out["sq_norms"] = (dd * xx).sum((1, 2, 3))
        if directions:
            out["projections"] = {}
            for name, v in directions.items():
                if isinstance(v, FactoredDirection):
                    if self.t == 1 and self.groups == 1:
                        out["projections"][name] = v.project(d[:, 0, 0], self.x[:, 0, 0])
                        continue
                    v = v.dense()
                if name == MEAN_GRADIENT and self._mean_projection_by_gram():
                    out["projections"][name] = self._gram().mean(1)
                elif self.project is not None:
                    out["projections"][name] = self.project(v.reshape(self.weight_shape))
                else:
                    v = v.reshape(self.groups, self.o, self.i)
                    out["projections"][name] = self._projection(v)
        if request.sum_sq:  # t == 1 here
            s = torch.einsum("ngo,ngi->goi", d[:, :, 0].pow(2), self.x[:, :, 0].pow(2))
            out["sum_sq"] = s.reshape(self.weight_shape)
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

    def _projection(self, v: Tensor) -> Tensor:
        """G_n . V = sum_{g,t} delta_{n,g,t} . (V_g x_{n,g,t}), V mapped onto the smaller side,
        over chunks of samples."""
        parts = []
        for delta, x in self._sample_chunks(self.i + min(self.i, self.o)):
            if self.t > 1 and x.transpose(2, 3).is_contiguous():
                # unfolded convolution inputs hold the positions last in memory: contract in
                # that layout, [n, g, i or o, t], not through the transposed views
                x, delta = x.transpose(2, 3), delta.transpose(2, 3)
                if self.o <= self.i:
                    parts.append((torch.matmul(v, x) * delta).sum((1, 2, 3)))
                else:
                    parts.append((torch.matmul(v.transpose(1, 2), delta) * x).sum((1, 2, 3)))
            elif self.o <= self.i:
                mapped = torch.einsum("ngti,goi->ngto", x, v)
                parts.append((mapped * delta).sum((1, 2, 3)))
            else:
                mapped = torch.einsum("ngto,goi->ngti", delta, v)
                parts.append((mapped * x).sum((1, 2, 3)))
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

    def _sample_chunks(self, per_position: int):
        """(delta, x) of consecutive chunks of samples, each chunk's temporaries of
        ``per_position`` elements per group and position within the chunk budget; x is
        unfolded one chunk at a time (unless it is already whole)."""
        per_sample = self.groups * self.t * per_position
        step = chunk_size(self.n, per_sample, self.delta.element_size())
        for start in range(0, self.n, step):
            stop = min(self.n, start + step)
            x = self._x[start:stop] if self._x is not None else self.inputs(start, stop)
            yield self.delta[start:stop], x

    def _step(self) -> int:
        """Samples per chunk: their gradients and inputs fit the chunk budget."""
        per_sample = self.groups * (self.i * self.o + self.t * self.i)
        return chunk_size(self.n, per_sample, self.delta.element_size())


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
            project = None if self.projection is None else _weak(self.projection)
            gradients = None if self.gradients is None else _weak(self.gradients)
            self._bilinear = Bilinear(
                _weak(self.inputs), self.delta, self.module.weight.shape, project, gradients
            )
        return self._bilinear

    # G_n . V computed by the layer itself (no unfolding), or None for the generic einsum
    projection: Callable[[Tensor], Tensor] | None = None
    # G_n of samples start..stop-1 by the layer itself where it has a faster way than
    # unfolding, or None
    gradients: Callable[[int, int], Tensor] | None = None

    def _bias(self) -> Tensor:
        bias = self.delta.sum(2).flatten(1)
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
