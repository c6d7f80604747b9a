"""nn.Linear: y = x W^T + b over any number of leading axes.

Per sample n (leading non-batch axes flattened into t, calls of one forward concatenated along
t): grad W = sum_t delta_t x_t^T and grad b = sum_t delta_t (see :mod:`bilinear`).
"""

from __future__ import annotations

from torch import nn

from avionics.persample.rules.base import batch_first, concatenate, output_gradient
from avionics.persample.rules.bilinear import BilinearRule


class LinearRule(BilinearRule):
    def __init__(self, module: nn.Linear, calls, names, n, scale):
        super().__init__(module, calls, names, n, scale)
        xs, ds = [], []
        for call in calls:
            x = batch_first(call.args[0], call.batch_axis, n, "Linear input")
            d = batch_first(output_gradient(call), call.batch_axis, n, "Linear output")
            xs.append(x.reshape(n, -1, x.shape[-1]))
            ds.append(d.reshape(n, -1, d.shape[-1]))
        x, d = concatenate(xs, 1), concatenate(ds, 1)
        if d.shape[1] > 1 and x.numel() < d.numel():
            # with shared axes G_n = sum_t delta_t x_t^T is bilinear: the scale goes on the
            # smaller factor (one copy less of the larger); the bias reads delta_scale
            x, self.delta_scale = x * scale, scale
        else:
            d = d * scale
        self.x = x.unsqueeze(1)  # [N, 1 group, T, in]
        self.delta = d.unsqueeze(1)  # [N, 1 group, T, out]
