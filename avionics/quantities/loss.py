"""Loss: the mini-batch loss L_t as the user backpropagated it."""

from avionics.quantities.base import Quantity, StepData


class Loss(Quantity):
    def compute(self, data: StepData):
        return {data.step: data.loss}
