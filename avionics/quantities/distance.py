"""Distance: ||theta_t - theta_0|| per parameter, theta_0 = the first tracked step's parameters."""

from avionics.quantities.base import Quantity, StepData, per_parameter_distances


class Distance(Quantity):
    def __init__(self, schedule=None):
        super().__init__(schedule)
        self.initial = None

    def compute(self, data: StepData):
        if self.initial is None:
            self.initial = data.params_copy()
        return {data.step: per_parameter_distances(data.params, self.initial)}
