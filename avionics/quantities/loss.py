"""Loss: the mini-batch loss L_t as the user backpropagated it."""

from avionics.quantities.base import Quantity, StepData


class Loss(Quantity):
    """The mini-batch loss L_t, ``info["loss"]`` (mean or sum, as backpropagated)."""

    def compute(self, data: StepData):
        return {data.step: data.loss}
