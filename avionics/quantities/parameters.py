"""Parameters: a copy of every tracked parameter (large: not in any preset)."""

from avionics.quantities.base import Quantity, StepData
from avionics.quantities.outputs import TENSORS


class Parameters(Quantity):
    """theta_t: a copy of every tracked parameter, in parameter order (no loss involved)."""

    output = TENSORS

    def compute(self, data: StepData):
        return {data.step: data.params_copy()}
