"""Distance: ||theta_t - theta_0|| per parameter, theta_0 = the first tracked step's parameters."""

from avionics.quantities.base import Quantity, StepData, per_parameter_distances
from avionics.quantities.outputs import per_parameter


class Distance(Quantity):
    """Per parameter k, ||theta_t^(k) - theta_0^(k)||, theta_0 the parameters at the first
    tracked step (kept in :meth:`state_dict` for a resumed run); globally the RSS."""

    output = per_parameter("rss")

    def __init__(self, schedule=None):
        super().__init__(schedule)
        self.initial = None

    def compute(self, data: StepData):
        if self.initial is None:
            self.initial = data.params_copy()
        return {data.step: per_parameter_distances(data.params, self.initial)}

    def state_dict(self) -> dict:
        return {} if self.initial is None else {"initial": self.initial}

    def load_state_dict(self, state: dict) -> None:
        self.initial = state.get("initial")
