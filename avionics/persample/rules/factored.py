"""A direction kept as the factors of a mean of outer products, for Linear weights.

The mean gradient of a Linear weight without shared axes (T = 1) is g = (1/N) sum_m delta_m
x_m^T (delta: output gradients, x: inputs of the N samples). A direction V = c * sum_m delta_m
x_m^T (plain SGD's unit step -g / ||g||, kept from one step to the next by Alpha) can stay in
that form: projecting another step's per-sample gradients G_n = delta'_n x'_n^T onto it is

    G_n . V = c * sum_m (delta'_n . delta_m) (x'_n . x_m)       (cost N M (I + O))

instead of N I O from the dense V, and the factors take M (I + O) numbers instead of I O.
"""

from __future__ import annotations

import torch
from torch import Tensor


class FactoredDirection:
    """V = coef * delta^T x, shaped ``shape`` ([O, I]); delta [M, O], x [M, I]."""

    def __init__(self, delta: Tensor, x: Tensor, coef: Tensor, shape):
        # an input not produced by the graph (the data batch, a buffer) may be refilled in
        # place before the next step: keep a copy of it
        self.x = x.clone() if x.grad_fn is None else x
        self.delta, self.coef, self.shape = delta, coef, torch.Size(shape)
        self._versions = (self.delta._version, self.x._version)

    @staticmethod
    def worth_it(m: int, i: int, o: int) -> bool:
        """Whether the factors are cheaper than the dense direction: M (I + O) < I O."""
        return m * (i + o) < i * o

    def _check(self) -> None:
        if (self.delta._version, self.x._version) != self._versions:
            raise RuntimeError(
                "A layer input kept from the previous step (for Alpha's projections) was "
                "modified in place since; its per-sample projections cannot be computed. Avoid "
                "in-place operations on a layer's input after the backward."
            )

    def dense(self) -> Tensor:
        self._check()
        return (self.coef * (self.delta.T @ self.x)).reshape(self.shape)

    def project(self, delta: Tensor, x: Tensor) -> Tensor:
        """G_n . V for G_n = delta_n x_n^T: delta [N, O], x [N, I] -> [N]."""
        self._check()
        cross = (delta @ self.delta.T).mul_(x @ self.x.T)
        return cross.sum(1) * self.coef


def dense(v):
    """A direction as a tensor."""
    return v.dense() if isinstance(v, FactoredDirection) else v
