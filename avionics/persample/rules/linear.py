"""nn.Linear: y = x W^T + b over any number of leading axes.

Per sample n (leading non-batch axes flattened into t, calls of one forward concatenated along
t): grad W = sum_t delta_t x_t^T and grad b = sum_t delta_t (see :mod:`bilinear`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from avionics.persample.rules.base import ColumnSums, batch_first, concatenate, output_gradient
from avionics.persample.rules.bilinear import BilinearRule


class LinearRule(BilinearRule):
    def __init__(self, module: nn.Linear, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        xs, ds = [], []
        for call in calls:
            x = batch_first(call.args[0], call.batch_axis, n, "Linear input")
            d = batch_first(output_gradient(call), call.batch_axis, n, "Linear output")
            xs.append(x.reshape(n, 1, -1, x.shape[-1]))  # [N, 1 group, T, in]
            ds.append(d.reshape(n, 1, -1, d.shape[-1]))  # [N, 1 group, T, out]
        x, d = concatenate(xs, 2), concatenate(ds, 2)
        if d.shape[2] > 1 and x.numel() < d.numel():
            # with shared axes G_n = sum_t delta_t x_t^T is bilinear: the output-gradient factor
            # goes on the smaller factor (one copy less of the larger); the bias reads delta_scale
            x, self.delta_scale = x * output_gradient_factor, output_gradient_factor
        else:
            d = d * output_gradient_factor
        self.x, self.delta = x, d

    @classmethod
    def column_sums(cls, module, calls, names, n, traces):
        """Called once on an input [N, I] (no shared axes), g_{n,j} = delta_{n,j} x_n^T, so
        sum_j sum_n g_{n,j}^2 = sum_n (sum_j delta_{n,j}^2) (x_n^2)^T: only sum_j delta_j^2 is
        accumulated over the columns, and one product forms the weight's sum (sum_n sum_j
        delta_{n,j}^2 for the bias); its trace is sum_n (sum_j ||delta_{n,j}||^2) ||x_n||^2
        (N (I + O) per column instead of N I O in all). Else the default."""
        if len(calls) != 1 or not _separable(calls[0], cls.in_features(module), n):
            return super().column_sums(module, calls, names, n, traces)
        return cls.column_sums_class(calls[0], names, n, traces)

    @staticmethod
    def in_features(module: nn.Module) -> int:
        return module.in_features

    column_sums_class: type  # LinearColumnSums, set below its definition


def _separable(call, in_features: int, n: int) -> bool:
    """One call whose input is [N, in_features] (no shared axes)."""
    x = call.args[0] if call.args else None
    return (
        isinstance(x, Tensor)
        and len(call.nodes) == 1
        and x.dim() > call.batch_axis
        and x.shape[call.batch_axis] == n
        and x.numel() == n * in_features
    )


class LinearColumnSums(ColumnSums):
    """:meth:`LinearRule.column_sums` of a Linear layer without shared axes."""

    def __init__(self, call, names: list[str], n: int, traces: bool):
        self.call, self.names, self.n, self.traces = call, names, n, traces
        self.sq: Tensor | None = None  # running sum_j delta_j^2, [N, O]

    def add(self, grad_outputs: list[list[Tensor | None]]) -> None:
        d = grad_outputs[0][self.call.node_outputs[0]]
        if d is not None:
            d = d.movedim(self.call.batch_axis, 0).reshape(self.n, -1)
            self.sq = d * d if self.sq is None else self.sq.addcmul_(d, d)

    def result(self, scale: float) -> list[Tensor | None]:
        sq = self.sq
        if sq is None:
            return [None] * len(self.names)
        sq.mul_(scale)
        x = self.call.args[0].movedim(self.call.batch_axis, 0).reshape(self.n, -1)
        out = []
        for name in self.names:
            if name == "bias":
                out.append(sq.sum() if self.traces else sq.sum(0))
            elif self.traces:  # sum_n ||sq_n||_1 ||x_n||^2
                out.append(torch.dot(sq.sum(1), x.square().sum(1)))
            else:
                out.append(torch.mm(sq.t(), x * x))
        return out


LinearRule.column_sums_class = LinearColumnSums
