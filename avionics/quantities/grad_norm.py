"""GradNorm: ||g^(k)|| per parameter k, g = mean_n g_n; the global norm is their RSS."""

from avionics.quantities.base import Quantity, StepData, per_parameter_norms


class GradNorm(Quantity):
    def compute(self, data: StepData):
        return {data.step: per_parameter_norms(data.mean_grad)}
