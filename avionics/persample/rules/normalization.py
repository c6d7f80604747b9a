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


class NormalizationRule(Rule):
    def __init__(self, module, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        grads = {name: 0 for name in names}
        for call in calls:
            x = batch_first(call.args[0], call.batch_axis, n, f"{type(module).__name__} input")
            d = batch_first(
                output_gradient(call), call.batch_axis, n, f"{type(module).__name__} output"
            )
            x_hat, lead = _normalized(module, x)
            if not isinstance(module, nn.LayerNorm | nn.RMSNorm):
                d = d.movedim(1, -1)
            summed = tuple(range(1, lead))
            for name in names:
                g = d * x_hat if name == "weight" else d
                grads[name] = grads[name] + (g.sum(summed) if summed else g)
        # the factor on the small sums, not on the output gradient
        self.grads = [grads[name] * output_gradient_factor for name in names]

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        return [g[start:stop] for g in self.grads]

    def chunks(self):
        yield 0, self.grads
