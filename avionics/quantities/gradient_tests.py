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

With ``per_layer=True`` each test is also read per tracked parameter k: the same ratio of that
parameter's own sums, e.g. NormTest_k = sqrt( sum_n ||g_n^(k) - g^(k)||^2 / ((N-1) N
||g^(k)||^2) ), the test of a model whose only parameter is k (stored as
``{"global": ..., "per_parameter": [...]}``, see :data:`~avionics.quantities.outputs.PER_LAYER`).
"""

from __future__ import annotations

import warnings

import torch

from avionics.persample import Request
from avionics.quantities.base import (
    Quantity,
    StepData,
    mean_gradient_sq_norm,
    mean_gradient_sq_norms,
    per_parameter_rows,
)
from avionics.quantities.outputs import PER_LAYER

PER_SAMPLE_KEYS = ("individual_losses", "batch_size")


class _GradientTest(Quantity):
    """Shared: a sum over samples of the statistics the request names, combined with ||g||^2
    and N; with ``per_layer``, also per tracked parameter, from that parameter's ||g_n^(k)||^2,
    g_n^(k) . g^(k) and ||g^(k)||^2. Under data parallelism the sums are added over the
    processes (g and N are global).

    Args:
        schedule: the steps it is computed at (default: every step).
        per_layer: also keep the test of each tracked parameter alone (see the module
            docstring).
    """

    info_keys = PER_SAMPLE_KEYS
    per_layer_output = PER_LAYER

    def __init__(self, schedule=None, per_layer: bool = False):
        super().__init__(schedule, per_layer)
        self._warned_zero_gradient = False

    def sums(self, data: StepData):
        stats = data.statistics
        # [K, N] each: ||g_n^(k)||^2 and g_n^(k) . g^(k), where the request asked for them
        sq_norms = per_parameter_rows(stats.sq_norms) if stats.sq_norms is not None else None
        grad = stats.projections.get("grad")
        projections = per_parameter_rows(grad) if grad is not None else None
        # the global summand is of g_n . g = sum_k g_n^(k) . g^(k), likewise ||g_n||^2
        whole = [None if rows is None else rows.sum(0) for rows in (sq_norms, projections)]
        sums = {"sum": self.summand(*whole, mean_gradient_sq_norm(data)).sum()}
        if self.per_layer:
            g_sq = mean_gradient_sq_norms(data)[:, None]
            sums["per_parameter"] = self.summand(sq_norms, projections, g_sq).sum(1)
        return sums

    def compute(self, data: StepData):
        n = data.batch_size
        if n < 2:
            warnings.warn(
                f"{self.name} needs a batch of at least 2 samples; stored nan.", stacklevel=2
            )
            nan = torch.tensor(float("nan"), dtype=torch.float64, device=data.params[0].device)
            if self.per_layer:
                return {data.step: self.layered(nan, nan.repeat(len(data.params)))}
            return {data.step: nan}
        g_sq = mean_gradient_sq_norm(data)
        # (one host transfer per step for the three tests, only until the warning is given)
        if not self._warned_zero_gradient and _zero_gradient(data):
            self._warned_zero_gradient = True
            warnings.warn(
                f"{self.name} at step {data.step}: the mean gradient is zero, so the test is "
                "undefined (it divides by ||g||^2); stored nan. Warned once.",
                stacklevel=2,
            )
        totals = data.totals[self.name]
        value = self.statistic(totals["sum"], g_sq, n)
        if self.per_layer:
            g_sq_k = mean_gradient_sq_norms(data)
            value = self.layered(value, self.statistic(totals["per_parameter"], g_sq_k, n))
        return {data.step: value}


class NormTest(_GradientTest):
    """Norm test (Byrd et al. 2012): sqrt( sum_n ||g_n - g||^2 / ((N-1) N ||g||^2) ), the
    relative standard error of the mini-batch gradient (of the mean loss over the batch; the
    same for a sum-reduced loss); nan with a warning when g = 0. It needs only the per-sample
    norms: sum_n ||g_n - g||^2 = sum_n ||g_n||^2 - N ||g||^2.

    Example:
        The three tests split the same noise: NormTest^2 = InnerTest^2 + OrthoTest^2, the
        parts of g_n - g along g and across it.

        >>> from avionics.demo import example_run
        >>> from avionics.quantities import InnerTest, NormTest, OrthoTest
        >>> values = example_run([NormTest(), InnerTest(), OrthoTest()])[0]
        >>> round(values["NormTest"], 2)
        0.73
        >>> parts = values["InnerTest"] ** 2 + values["OrthoTest"] ** 2
        >>> abs(values["NormTest"] ** 2 - parts) < 1e-12
        True
    """

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


def _zero_gradient(data: StepData) -> bool:
    """Whether ||g||^2 of the mean gradient is zero: read on the host once per step, shared by
    the gradient tests."""
    if data.cache.g_sq_is_zero is None:
        data.cache.g_sq_is_zero = bool(mean_gradient_sq_norm(data) == 0)
    return data.cache.g_sq_is_zero
