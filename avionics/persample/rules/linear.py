"""nn.Linear: y = x W^T + b over any number of leading axes.

Per sample n (leading non-batch axes flattened into t, calls of one forward concatenated along
t): grad W = sum_t delta_t x_t^T and grad b = sum_t delta_t (see :mod:`bilinear`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from avionics.persample.rules.base import (
    ColumnSums,
    GroupedColumnSums,
    batch_first,
    concatenate,
    output_gradient,
)
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
        (N (I + O) per column instead of N I O in all). With shared axes (nn.Linear), the
        columns go together a group at a time (:class:`SharedAxesColumnSums`). Else the
        default."""
        if len(calls) == 1 and _separable(calls[0], cls.in_features(module), n):
            return cls.column_sums_class(calls[0], names, n, traces)
        if cls is LinearRule:
            return SharedAxesColumnSums(calls, names, n, traces)
        return super().column_sums(module, calls, names, n, traces)

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


# the bytes of one chunk of a group's per-sample gradients [c, K, O, I]
SHARED_AXES_CHUNK_BYTES = 2**24


class SharedAxesColumnSums(GroupedColumnSums):
    """:meth:`LinearRule.column_sums` of nn.Linear calls with shared axes: for column j,
    G_{n,j} = sum_t delta_{n,j,t} x_{n,t}^T over the calls' positions t (concatenated, as the
    rule does). The columns' output gradients are kept, and a group of K at a time forms, a
    chunk of samples at once, [c, K O, T] @ [c, T, I] -> G [c, K, O, I] in one product,
    squared and summed over n and j (instead of the rule built and its plan run once per
    column); the bias's G_{n,j} = sum_t delta_{n,j,t}."""

    def __init__(self, calls, names: list[str], n: int, traces: bool):
        super().__init__(calls, names, n, traces)
        xs = [batch_first(c.args[0], c.batch_axis, n, "Linear input") for c in calls]
        self.x = torch.cat([x.reshape(n, -1, x.shape[-1]) for x in xs], 1)  # [N, T, I]

    def add(self, grad_outputs: list[list[Tensor | None]]) -> None:
        ds = []
        for call, outs in zip(self.calls, grad_outputs, strict=True):
            d = output_gradient(call.with_grad_outputs(outs))
            d = batch_first(d, call.batch_axis, self.n, "Linear output")
            ds.append(d.reshape(self.n, -1, d.shape[-1]))
        self.hold(torch.cat(ds, 1))  # [N, T, O]

    def _reduce(self) -> None:
        delta = torch.stack(self.pending, 1)  # [N, K, T, O]
        self.pending = []
        n, k, t, o = delta.shape
        x = self.x.to(delta.dtype)
        step = max(1, SHARED_AXES_CHUNK_BYTES // (k * o * x.shape[-1] * delta.element_size()))
        for start in range(0, n, step):
            d = delta[start : start + step]
            if "weight" in self.names:
                g = torch.bmm(d.transpose(2, 3).reshape(len(d), k * o, t), x[start : start + step])
                self._add("weight", g.square_().sum(0).unflatten(0, (k, o)).sum(0))
            if "bias" in self.names:
                self._add("bias", d.sum(2).square_().sum((0, 1)))
