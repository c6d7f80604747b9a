"""GradNorm: ||g^(k)|| per parameter k, g = mean_n g_n the gradient of the mean loss over the
batch (also for a sum-reduced loss, whose gradient is N g); the global norm is their RSS."""

from avionics.quantities.base import Quantity, StepData, mean_gradient_norms, whole_norms
from avionics.quantities.outputs import per_parameter


class GradNorm(Quantity):
    """Per parameter k, ||g^(k)|| with g = mean_n g_n the gradient of the mean loss over the
    batch (``p.grad / N`` for a sum-reduced loss); the global norm ||g|| =
    sqrt(sum_k ||g^(k)||^2).

    Example:
        One norm per tracked parameter (a 4-8-3 MLP: two weights, two biases), in parameter
        order; the log's summary of them is their root-sum-of-squares.

        >>> import math
        >>> from avionics.demo import example_run
        >>> from avionics.quantities import GradNorm
        >>> norms = example_run([GradNorm()])[0]["GradNorm"]
        >>> [round(norm, 3) for norm in norms]
        [0.22, 0.229, 0.322, 0.39]
        >>> round(math.sqrt(sum(norm**2 for norm in norms)), 3)
        0.598
    """

    output = per_parameter("rss")

    def compute(self, data: StepData):
        return {data.step: whole_norms(mean_gradient_norms(data), data)}
