"""UpdateSize: ||theta_{t+1} - theta_t|| per parameter, stored under t.

Measured from the parameters, so it works for every optimizer: a copy of theta_t is taken at
the tracked step t and compared at the next step the cockpit sees.
"""

from avionics.quantities.base import Quantity, StepData, per_parameter_distances


class UpdateSize(Quantity):
    def __init__(self, schedule=None):
        super().__init__(schedule)
        self.start: tuple[int, list] | None = None

    def is_active(self, step: int) -> bool:
        return self.start is not None or self.schedule(step)

    def compute(self, data: StepData):
        values = {}
        if self.start is not None:
            step, before = self.start
            values[step] = per_parameter_distances(data.params, before)
            self.start = None
        if self.schedule(data.step):
            self.start = (data.step, data.params_copy())
        return values
