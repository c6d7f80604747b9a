"""Normalisation layers: y = x_hat * w + b, elementwise in the normalised features.

Per sample n: grad w = sum over the other axes of delta * x_hat, grad b = the same sum of
delta, where x_hat is recomputed from the captured input as the layer computes it:

* LayerNorm: x_hat = (x - mean) / sqrt(var + eps) over the last ``normalized_shape`` axes.
* RMSNorm: x_hat = x / sqrt(mean(x^2) + eps) over the same axes.
* GroupNorm: mean and var per sample and group of channels; weights per channel.
* BatchNorm: mean and var per channel, over the batch and the spatial axes in train mode
  (the running statistics in eval mode); grad w = (sum_l delta_l (x_l - mean)) / sqrt(var +
  eps), x_hat not formed. In train mode the batch statistics couple the samples; what is
  computed is each sample's share delta_n * x_hat_n of the batch gradient.

These gradients are small (the size of the normalised features), so they are materialised
for all samples at once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from avionics.persample.rules.base import Rule, batch_first, output_gradient


def _normalized(module: nn.Module, x: Tensor) -> tuple[Tensor, int]:
    """x_hat of a LayerNorm, RMSNorm or GroupNorm input (features last), and how many
    leading axes (batch included) are summed over."""
    # x_hat by the layer's own kernel without its affine part: the same numbers as its forward
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        shape = module.normalized_shape
        if isinstance(module, nn.LayerNorm):
            x_hat = F.layer_norm(x, shape, None, None, module.eps)
        else:
            x_hat = F.rms_norm(x, shape, None, module.eps)
        return x_hat, x.dim() - len(shape)
    x_hat = F.group_norm(x, module.num_groups, None, None, module.eps)
    return x_hat.movedim(1, -1), x.dim() - 1


def _batch_normalized(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """A BatchNorm input [N, C, *spatial] as (x - mean) [N, C, L] and 1 / sqrt(var + eps) [C],
    so that x_hat = (x - mean) / sqrt(var + eps): the running statistics in eval mode, else
    the batch's, the mean over the N L values of each channel and then the biased variance of
    the centred values (two passes, as stable as the layer's own).

    x_hat is never formed: per sample, grad w = (sum_l delta_l (x_l - mean)) / sqrt(var + eps)
    is one dot product per channel scaled afterwards (the layer's kernels or torch.var_mean
    over axes (0, 2, ...) took 3-7x longer on the ResNet's BatchNorm2d inputs, as they also
    wrote x_hat or reduced across strided axes)."""
    n, c = x.shape[:2]
    x = x.reshape(n, c, -1)
    if module.training or module.running_mean is None:  # the engine warns of it
        centred = x - x.mean((0, 2), keepdim=True)
        var = torch.linalg.vecdot(centred, centred).sum(0) / (n * x.shape[2])
    else:
        centred, var = x - module.running_mean[:, None], module.running_var
    return centred, torch.rsqrt(var + module.eps)


class _Normalized:
    """x_hat of one call, laid out for the per-sample sums of delta * x_hat (weight) and of
    delta (bias): a BatchNorm's as (x - mean) [N, C, L] and its scale 1 / sqrt(var + eps) [C]
    (:func:`_batch_normalized`, summed over the last axis), the others' x_hat with the
    features last (summed over the axes between the batch and the features)."""

    def __init__(self, module: nn.Module, call, n: int):
        self.module, self.call, self.n = module, call, n
        x = batch_first(call.args[0], call.batch_axis, n, f"{type(module).__name__} input")
        self.batch_norm = isinstance(module, nn.modules.batchnorm._BatchNorm)
        if self.batch_norm:
            self.x_hat, self.scale = _batch_normalized(module, x)
        else:
            self.x_hat, lead = _normalized(module, x)
            self.summed = tuple(range(1, lead))

    def layout(self, d: Tensor) -> Tensor:
        """Output gradient ``d`` of the call, batch first and laid out as x_hat."""
        d = batch_first(d, self.call.batch_axis, self.n, f"{type(self.module).__name__} output")
        if self.batch_norm:
            return d.reshape(self.n, d.shape[1], -1)
        return d if isinstance(self.module, nn.LayerNorm | nn.RMSNorm) else d.movedim(1, -1)

    def sums(self, d: Tensor, names, lead: int = 0) -> list[Tensor]:
        """Each name's per-sample gradient [*lead axes, N, *features] for ``d`` laid out as
        x_hat after ``lead`` leading axes (columns; factor 1)."""
        if self.batch_norm:
            return [
                torch.linalg.vecdot(d, self.x_hat) * self.scale if name == "weight" else d.sum(-1)
                for name in names
            ]
        axes = tuple(a + lead for a in self.summed)
        grads = [d * self.x_hat if name == "weight" else d for name in names]
        return [g.sum(axes) if axes else g for g in grads]


class NormalizationRule(Rule):
    def __init__(self, module, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        grads = None
        for call in calls:
            normalized = _Normalized(module, call, n)
            per_call = normalized.sums(normalized.layout(output_gradient(call)), names)
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
        self.inputs = [_Normalized(module, call, n) for call in calls]
        self.pending: list[list[Tensor | None]] = []  # per column, per call: d batch first
        self.totals: list[Tensor | None] = [None] * len(names)

    def add(self, grad_outputs: list[list[Tensor | None]]) -> None:
        """One column: ``grad_outputs[c]`` replaces ``calls[c].grad_outputs``."""
        self.pending.append([
            None if outs[0] is None else normalized.layout(outs[0])
            for normalized, outs in zip(self.inputs, grad_outputs, strict=True)
        ])  # fmt: skip
        if len(self.pending) == NORMALIZATION_GROUP:
            self._reduce()

    def _reduce(self) -> None:
        """The pending columns' squared per-sample gradients, added to the totals (a column
        that did not reach a call adds a zero there)."""
        columns, self.pending = self.pending, []
        grads = None
        for c, normalized in enumerate(self.inputs):
            ds = [column[c] for column in columns]
            known = next((d for d in ds if d is not None), None)
            if known is None:
                continue
            d = torch.stack([torch.zeros_like(known) if g is None else g for g in ds])
            per_call = normalized.sums(d, self.names, lead=1)  # [K, N, *features]
            grads = per_call if grads is None else [g + p for g, p in zip(grads, per_call)]
        for k, g in enumerate(grads or ()):
            s = g.square_().sum() if self.traces else g.square_().sum((0, 1))
            self.totals[k] = s if self.totals[k] is None else self.totals[k].add_(s)

    def result(self, scale: float) -> list[Tensor | None]:
        """``scale`` times the sums, one per name (None where no column arrived)."""
        if self.pending:
            self._reduce()
        return [t.mul_(scale) if t is not None else None for t in self.totals]
