"""Distance: ||theta_t - theta_0|| per parameter, theta_0 = the parameters at the first tracked
step where they are all finite (no loss is involved)."""

import torch

from avionics.quantities.base import Quantity, StepData, per_parameter_distances
from avionics.quantities.outputs import per_parameter


class Distance(Quantity):
    """Per parameter k, ||theta_t^(k) - theta_0^(k)||, theta_0 the parameters at the first
    tracked step (kept in :meth:`state_dict` for a resumed run); globally the RSS. It involves
    no loss.

    Parameters with a NaN or infinite entry are no start: that step stores nan for them (0
    for the others), and the next tracked step is tried as theta_0 instead.
    """

    output = per_parameter("rss")

    def __init__(self, schedule=None):
        super().__init__(schedule)
        self.initial = None

    def compute(self, data: StepData):
        if self.initial is not None:
            return {data.step: per_parameter_distances(data.params, self.initial, data)}
        start = data.params_copy()
        # ||theta - theta|| is 0 where theta is finite, nan where it is not: the check is the
        # value itself (one host transfer, at the start steps only)
        distances = per_parameter_distances(data.params, start, data)
        if bool(torch.isfinite(distances).all()):
            self.initial = start
        return {data.step: distances}

    def state_dict(self) -> dict:
        return {} if self.initial is None else {"initial": self.initial}

    def load_state_dict(self, state: dict) -> None:
        self.initial = state.get("initial")
