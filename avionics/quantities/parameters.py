"""Parameters: a copy of every tracked parameter (large: not in any preset)."""

from avionics.quantities.base import Quantity, StepData


class Parameters(Quantity):
    def compute(self, data: StepData):
        return {data.step: data.params_copy()}
