"""UpdateRatio: the relative size of the update, ||theta_{t+1} - theta_t|| / ||theta_t||.

Per parameter k, r_k = ||theta_{t+1}^(k) - theta_t^(k)|| / ||theta_t^(k)||, stored under t.
Globally it is the same ratio over all parameters at once,

    r = ||theta_{t+1} - theta_t|| / ||theta_t||
      = sqrt(sum_k ||Delta theta^(k)||^2) / sqrt(sum_k ||theta_t^(k)||^2),

which is not a mean of the r_k (a large layer weighs more): the value is a per-layer output
(:data:`~avionics.quantities.outputs.PER_LAYER`), ``{"global": r, "per_parameter": [r_k]}``.

Measured from the parameters, like :class:`~avionics.quantities.update_size.UpdateSize`, so
it works for every optimizer. The usual range of r_k per step is about 1e-3 (CS231n, "Neural
Networks Part 3", section "Ratio of weights:updates"; Karpathy, "A Recipe for Training Neural
Networks", 2019); :func:`avionics.diagnosis.layers.update_ratio_out_of_range` flags layers
that stay far from it.

A parameter that is exactly zero at step t (a bias initialised to 0, at step 0) has no
relative update: its r_k is nan (undefined, where a plain division would give inf or 0/0),
and it is left out of the global ratio, whose sums run over the parameters with
||theta_t^(k)|| > 0 only (nan if there are none). So no healthy run shows inf; the same
parameter has its ratio again at the steps after it has moved away from zero.
"""

import torch

from avionics.quantities.base import (
    StepData,
    TwoStepQuantity,
    per_parameter_distances,
    per_parameter_norms,
)
from avionics.quantities.outputs import PER_LAYER


class UpdateRatio(TwoStepQuantity):
    """Per parameter k, ||theta_{t+1}^(k) - theta_t^(k)|| / ||theta_t^(k)||, stored under t;
    globally ||theta_{t+1} - theta_t|| / ||theta_t|| over all tracked parameters. A parameter
    with theta_t^(k) = 0 has ratio nan and is left out of the global one (see the module
    docstring). It involves no loss; under data parallelism and FSDP the norms are those of
    the whole parameters."""

    output = PER_LAYER

    def start(self, data: StepData):
        return data.params_copy()

    def finish(self, kept, data: StepData):
        updates = per_parameter_distances(data.params, kept, data).double()
        norms = per_parameter_norms(kept, data).double()
        defined = norms > 0  # (a zero parameter has no relative update: left out)
        nan = torch.full_like(norms, torch.nan)
        total = (updates * defined).square().sum().sqrt() / norms.square().sum().sqrt()
        return {
            "global": torch.where(defined.any(), total, nan[0]),  # (on the device)
            "per_parameter": torch.where(defined, updates / norms.where(defined, 1.0), nan),
        }
