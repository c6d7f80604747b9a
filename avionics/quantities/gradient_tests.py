"""The gradient-noise tests of Bollapragada et al. (2018) and Byrd et al. (2012).

With per-sample gradients g_n, their mean g and N samples (sums over all tracked parameters):

    NormTest  = sqrt( sum_n ||g_n - g||^2 / ((N-1) N ||g||^2) )
    InnerTest = sqrt( sum_n (g_n . g - ||g||^2)^2 / ((N-1) N ||g||^4) )
    OrthoTest = sqrt( sum_n ||g_n - (g_n . g / ||g||^2) g||^2 / ((N-1) N ||g||^2) )

computed from ||g_n||^2 and g_n . g alone, since sum_n ||g_n - g||^2 = sum_n ||g_n||^2 - N||g||^2
and ||g_n - (g_n.g/||g||^2) g||^2 = ||g_n||^2 - (g_n . g)^2 / ||g||^2. g_n is the gradient of
the per-sample loss l_n and g the gradient of the mean loss over the batch; the tests are ratios,
the same for a mean- or a sum-reduced loss.

The [N] statistics and ||g||^2 are combined in float64: in float32, ||g||^4 and (g_n . g)^2
overflow once ||g|| exceeds a few times 1e9. A zero mean gradient leaves the tests undefined: they
store nan, with a warning (once per quantity).
"""

from __future__ import annotations

import warnings

import torch

from avionics.persample import Request
from avionics.quantities.base import Quantity, StepData, mean_gradient_sq_norm

PER_SAMPLE_KEYS = ("individual_losses", "batch_size")


class _GradientTest(Quantity):
    """Shared: a sum over samples of the statistics the request names, combined with ||g||^2
    and N. Under data parallelism the sum is added over the processes (g and N are global)."""

    info_keys = PER_SAMPLE_KEYS

    def __init__(self, schedule=None):
        super().__init__(schedule)
        self._warned_zero_gradient = False

    def sums(self, data: StepData):
        stats = data.statistics
        # [N] each: ||g_n||^2 and g_n . g, where the request asked for them
        sq_norms = sum(stats.sq_norms).double() if stats.sq_norms is not None else None
        grad = stats.projections.get("grad")
        projections = sum(grad).double() if grad is not None else None
        g_sq = mean_gradient_sq_norm(data)
        return {"sum": self.summand(sq_norms, projections, g_sq).sum()}

    def compute(self, data: StepData):
        n = data.batch_size
        if n < 2:
            warnings.warn(
                f"{self.name} needs a batch of at least 2 samples; stored nan.", stacklevel=2
            )
            return {data.step: torch.tensor(float("nan"))}
        g_sq = mean_gradient_sq_norm(data)
        # (a host transfer per step only until the warning is given)
        if not self._warned_zero_gradient and bool(g_sq == 0):
            self._warned_zero_gradient = True
            warnings.warn(
                f"{self.name} at step {data.step}: the mean gradient is zero, so the test is "
                "undefined (it divides by ||g||^2); stored nan. Warned once.",
                stacklevel=2,
            )
        total = data.totals[self.name]["sum"]
        return {data.step: self.statistic(total, g_sq, n)}


class NormTest(_GradientTest):
    """Norm test (Byrd et al. 2012): sqrt( sum_n ||g_n - g||^2 / ((N-1) N ||g||^2) ), the
    relative standard error of the mini-batch gradient (of the mean loss over the batch; the
    same for a sum-reduced loss); nan with a warning when g = 0. It needs only the per-sample
    norms: sum_n ||g_n - g||^2 = sum_n ||g_n||^2 - N ||g||^2."""

    def request(self, step: int) -> Request:
        return Request(sq_norms=True)

    @staticmethod
    def summand(sq_norms, projections, g_sq):
        return sq_norms

    @staticmethod
    def statistic(total, g_sq, n):
        return ((total - n * g_sq) / ((n - 1) * n * g_sq)).clamp(min=0).sqrt()


class InnerTest(_GradientTest):
    """Inner-product test (Bollapragada et al. 2018):
    sqrt( sum_n (g_n . g - ||g||^2)^2 / ((N-1) N ||g||^4) ), g the gradient of the mean loss
    over the batch (the same for a sum-reduced loss); nan with a warning when g = 0."""

    def request(self, step: int) -> Request:
        return Request(directions=frozenset({"grad"}))

    @staticmethod
    def summand(sq_norms, projections, g_sq):
        return (projections - g_sq).pow(2)

    @staticmethod
    def statistic(total, g_sq, n):
        return (total / ((n - 1) * n * g_sq.pow(2))).sqrt()


class OrthoTest(_GradientTest):
    """Orthogonality test (Bollapragada et al. 2018):
    sqrt( sum_n ||g_n - (g_n . g / ||g||^2) g||^2 / ((N-1) N ||g||^2) ), g the gradient of the
    mean loss over the batch (the same for a sum-reduced loss); nan with a warning when g = 0."""

    def request(self, step: int) -> Request:
        return Request(sq_norms=True, directions=frozenset({"grad"}))

    @staticmethod
    def summand(sq_norms, projections, g_sq):
        return sq_norms - projections.pow(2) / g_sq

    @staticmethod
    def statistic(total, g_sq, n):
        return (total / ((n - 1) * n * g_sq)).clamp(min=0).sqrt()
