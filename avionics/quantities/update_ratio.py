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

import math

from avionics.quantities.base import (
    StepData,
    TwoStepQuantity,
    per_parameter_distances,
    per_parameter_norms,
)
from avionics.quantities.deferred import Deferred
from avionics.quantities.outputs import PER_LAYER


class UpdateRatio(TwoStepQuantity):
    """Per parameter k, ||theta_{t+1}^(k) - theta_t^(k)|| / ||theta_t^(k)||, stored under t;
    globally ||theta_{t+1} - theta_t|| / ||theta_t|| over all tracked parameters. A parameter
    with theta_t^(k) = 0 has ratio nan and is left out of the global one (see the module
    docstring). It involves no loss; under data parallelism and FSDP the norms are those of
    the whole parameters. The ratios are formed on the host, from the K distances and norms
    read with the step's one host transfer."""

    output = PER_LAYER

    def start(self, data: StepData):
        return data.params_copy()

    def finish(self, kept, data: StepData):
        updates = per_parameter_distances(data.params, kept, data)
        norms = per_parameter_norms(kept, data)
        count = len(kept)
        return Deferred((updates, norms), lambda floats, _: ratios(floats[:count], floats[count:]))


def ratios(updates: list[float], norms: list[float]) -> dict:
    """``{"global": r, "per_parameter": [r_k]}`` from ||Delta theta^(k)|| and
    ||theta_t^(k)|| (module docstring), in float64 on the host: r_k = nan where
    ||theta_t^(k)|| = 0, and the global ratio's sums (correctly rounded, ``math.fsum``) over
    the other parameters only (nan if there are none)."""
    defined = [(u, n) for u, n in zip(updates, norms, strict=True) if n > 0]
    total = math.nan
    if defined:
        total = math.sqrt(math.fsum(u * u for u, _ in defined)) / math.sqrt(
            math.fsum(n * n for _, n in defined)
        )
    per_parameter = [u / n if n > 0 else math.nan for u, n in zip(updates, norms)]
    return {"global": total, "per_parameter": per_parameter}
