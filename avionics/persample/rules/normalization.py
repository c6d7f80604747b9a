"""Normalisation layers: y = x_hat * w + b, elementwise in the normalised features.

Per sample n: grad w = sum over the other axes of delta * x_hat, grad b = the same sum of
delta, where x_hat is recomputed from the captured input exactly as the layer computes it:

* LayerNorm: x_hat = (x - mean) / sqrt(var + eps) over the last ``normalized_shape`` axes.
* RMSNorm: x_hat = x / sqrt(mean(x^2) + eps) over the same axes.
* GroupNorm: mean and var per sample and group of channels; weights per channel.
* BatchNorm: running statistics in eval mode. In train mode the batch statistics couple the
  samples; what is computed is each sample's share delta_n * x_hat_n of the batch gradient.

These gradients are small (the size of the normalised features), so they are materialised
for all samples at once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from avionics.persample.rules.base import Rule, batch_first, output_gradient


def _normalized(module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
    """x_hat, and how many leading axes (batch included) are summed over."""
    # x_hat by the layer's own kernel without its affine part: the same numbers as its forward
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        shape = module.normalized_shape
        if isinstance(module, nn.LayerNorm):
            x_hat = F.layer_norm(x, shape, None, None, module.eps)
        else:
            x_hat = F.rms_norm(x, shape, None, module.eps)
        return x_hat, x.dim() - len(shape)
    if isinstance(module, nn.GroupNorm):
        x_hat = F.group_norm(x, module.num_groups, None, None, module.eps)
        return x_hat.movedim(1, -1), x.dim() - 1
    # BatchNorm: channels on axis 1
    if module.training or module.running_mean is None:  # the engine warns of it
        dims = tuple(d for d in range(x.dim()) if d != 1)
        var, mean = torch.var_mean(x, dims, keepdim=True, correction=0)
    else:
        shape = [1, -1] + [1] * (x.dim() - 2)
        mean, var = module.running_mean.reshape(shape), module.running_var.reshape(shape)
    x_hat = (x - mean) * torch.rsqrt(var + module.eps)
    return x_hat.movedim(1, -1), x.dim() - 1


def _inputs(module: nn.Module, call, n: int) -> tuple[Tensor, tuple[int, ...]]:
    """x_hat of one call (batch first, features last) and the axes its per-sample sums run
    over."""
    x = batch_first(call.args[0], call.batch_axis, n, f"{type(module).__name__} input")
    x_hat, lead = _normalized(module, x)
    return x_hat, tuple(range(1, lead))


def _features_last(module, call, n: int, d: Tensor) -> Tensor:
    """Output gradient ``d`` of ``call``, batch first and features last (as x_hat)."""
    d = batch_first(d, call.batch_axis, n, f"{type(module).__name__} output")
    return d if isinstance(module, nn.LayerNorm | nn.RMSNorm) else d.movedim(1, -1)


def _per_sample(module, call, x_hat, summed, names, n, d: Tensor) -> list[Tensor]:
    """Each name's per-sample gradient [N, *features] for output gradient ``d`` of ``call``
    (factor 1): sum over ``summed`` of d * x_hat (weight) or d (bias)."""
    d = _features_last(module, call, n, d)
    grads = [d * x_hat if name == "weight" else d for name in names]
    return [g.sum(summed) if summed else g for g in grads]


class NormalizationRule(Rule):
    def __init__(self, module, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        grads = None
        for call in calls:
            x_hat, summed = _inputs(module, call, n)
            per_call = _per_sample(module, call, x_hat, summed, names, n, output_gradient(call))
            if grads is not None:
                per_call = [g + c for g, c in zip(grads, per_call, strict=True)]
            grads = per_call
        # the factor on the small sums, not on the output gradient
        self.grads = [g * output_gradient_factor for g in grads]

    @classmethod
    def column_sums(cls, module, calls, names, n, traces):
        return NormalizationColumnSums(module, calls, names, n, traces)

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        return [g[start:stop] for g in self.grads]

    def chunks(self):
        yield 0, self.grads


# columns whose output gradients are kept before their per-sample gradients are formed together
NORMALIZATION_GROUP = 16


class NormalizationColumnSums:
    """:meth:`NormalizationRule.column_sums`: x_hat of each call computed once for all
    columns; per column j, g_{n,j} = sum over the other axes of delta_j * x_hat (weight) or
    delta_j (bias), summed over the calls, squared and summed over the samples. The columns'
    output gradients are kept and a group of :data:`NORMALIZATION_GROUP` is formed at once,
    [K, N, ...] * x_hat summed over the other axes (one kernel per form instead of one per
    column)."""

    def __init__(self, module, calls, names: list[str], n: int, traces: bool):
        self.module, self.calls, self.names, self.n, self.traces = module, calls, names, n, traces
        self.inputs = [_inputs(module, call, n) for call in calls]
        self.pending: list[list[Tensor | None]] = []  # per column, per call: d batch first
        self.totals: list[Tensor | None] = [None] * len(names)

    def add(self, grad_outputs: list[list[Tensor | None]]) -> None:
        """One column: ``grad_outputs[c]`` replaces ``calls[c].grad_outputs``."""
        self.pending.append([
            None if outs[0] is None else _features_last(self.module, call, self.n, outs[0])
            for call, outs in zip(self.calls, grad_outputs, strict=True)
        ])  # fmt: skip
        if len(self.pending) == NORMALIZATION_GROUP:
            self._reduce()

    def _reduce(self) -> None:
        """The pending columns' squared per-sample gradients, added to the totals (a column
        that did not reach a call adds a zero there)."""
        columns, self.pending = self.pending, []
        grads = None
        for c, (x_hat, summed) in enumerate(self.inputs):
            ds = [column[c] for column in columns]
            known = next((d for d in ds if d is not None), None)
            if known is None:
                continue
            d = torch.stack([torch.zeros_like(known) if g is None else g for g in ds])
            axes = tuple(a + 1 for a in summed)  # (after the column axis)
            per_call = [d * x_hat if name == "weight" else d for name in self.names]
            per_call = [g.sum(axes) if axes else g for g in per_call]  # [K, N, *features]
            grads = per_call if grads is None else [g + p for g, p in zip(grads, per_call)]
        for k, g in enumerate(grads or ()):
            s = g.square_().sum() if self.traces else g.square_().sum((0, 1))
            self.totals[k] = s if self.totals[k] is None else self.totals[k].add_(s)

    def result(self, scale: float) -> list[Tensor | None]:
        """``scale`` times the sums, one per name (None where no column arrived)."""
        if self.pending:
            self._reduce()
        return [t.mul_(scale) if t is not None else None for t in self.totals]
