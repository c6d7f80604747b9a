"""UpdateSize: ||theta_{t+1} - theta_t|| per parameter, stored under t.

Measured from the parameters, so it works for every optimizer (and involves no loss): a copy
of theta_t is taken at the tracked step t and compared at the next step the cockpit sees.
"""

from avionics.quantities.base import StepData, TwoStepQuantity, per_parameter_distances
from avionics.quantities.outputs import per_parameter


class UpdateSize(TwoStepQuantity):
    """Per parameter k, ||theta_{t+1}^(k) - theta_t^(k)||, stored under t; globally the RSS.
    It involves no loss."""

    output = per_parameter("rss")

    def start(self, data: StepData):
        return data.params_copy()

    def finish(self, kept, data: StepData):
        return per_parameter_distances(data.params, kept, data)
