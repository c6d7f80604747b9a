"""Loss: the mini-batch loss L_t as the user backpropagated it."""

from avionics.quantities.base import Quantity, StepData


class Loss(Quantity):
    """The mini-batch loss L_t as the user reduced it: ``info["loss"]`` (the mean or the sum
    of the per-sample losses, as backpropagated)."""

    def compute(self, data: StepData):
        return {data.step: data.loss}
