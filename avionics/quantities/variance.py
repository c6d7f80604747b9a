"""Quantities built on the per-coordinate second moment of the per-sample gradients.

With m2_d = mean_n g_{n,d}^2 (from sum_n g_{n,d}^2) and g_d = mean_n g_{n,d}:

    MeanGSNR      = mean_d g_d^2 / (m2_d - g_d^2 + eps),               eps = 1e-5
    CABS          = lr * sum_d (m2_d - g_d^2) / L                      (plain SGD)
    EarlyStopping = 1 - N * mean_d g_d^2 / (s_d^2 + eps),              eps = 1e-5  (plain SGD)

where s_d^2 = N (m2_d - g_d^2) / (N - 1) is the unbiased variance. MeanGSNR is the gradient
signal-to-noise ratio of Liu et al. (2020); CABS the coupled adaptive batch size of Balles et
al. (2017); EarlyStopping the evidence-based criterion of Mahsereci et al. (2017): stop when
it is positive.
"""

from __future__ import annotations

import torch

from avionics.persample import Request
from avionics.quantities.base import Quantity, StepData
from avionics.quantities.gradient_tests import PER_SAMPLE_KEYS
from avionics.quantities.plain_sgd import require_plain_sgd


def _flat(tensors) -> torch.Tensor:
    """The tensors flattened into one new tensor (a copy even of a single tensor: callers
    overwrite it)."""
    return torch.cat([t.reshape(-1) for t in tensors])


class _SecondMoment(Quantity):
    """Shared: the per-coordinate second moment m2_d = mean_n g_{n,d}^2."""

    info_keys = PER_SAMPLE_KEYS

    def request(self, step: int) -> Request:
        return Request(sum_sq=True)

    def moments(self, data: StepData):
        """(g_d^2, biased variance m2_d - g_d^2), flattened over all parameters: two new
        model-sized tensors, each owned by the caller, which may overwrite them."""
        # in place on the flattened copies: a model-sized temporary per operation would
        # raise the step's peak memory by several copies of the model
        g_sq = _flat(data.mean_grad).square_()
        variance = _flat(data.statistics.sum_sq).div_(data.batch_size).sub_(g_sq)
        return g_sq, variance


class MeanGSNR(_SecondMoment):
    """Mean gradient signal-to-noise ratio (Liu et al. 2020):
    mean_d g_d^2 / (m2_d - g_d^2 + eps), eps = 1e-5."""

    eps = 1e-5

    def compute(self, data: StepData):
        g_sq, variance = self.moments(data)
        return {data.step: g_sq.div_(variance.add_(self.eps)).mean()}


class CABS(_SecondMoment):
    """Coupled adaptive batch size (Balles et al. 2017): lr * sum_d (m2_d - g_d^2) / L, the
    suggested batch size; plain SGD only."""

    info_keys = PER_SAMPLE_KEYS + ("optimizer",)

    def compute(self, data: StepData):
        lr = require_plain_sgd(self.name, data.optimizer)
        _, variance = self.moments(data)
        return {data.step: lr * variance.sum() / data.loss}


class EarlyStopping(_SecondMoment):
    """Evidence-based early-stopping criterion (Mahsereci et al. 2017):
    1 - N * mean_d g_d^2 / (s_d^2 + eps), s_d^2 the unbiased variance, eps = 1e-5; stop when
    it is positive. Plain SGD only."""

    info_keys = PER_SAMPLE_KEYS + ("optimizer",)
    eps = 1e-5

    def compute(self, data: StepData):
        require_plain_sgd(self.name, data.optimizer)
        n = data.batch_size
        g_sq, variance = self.moments(data)
        if n > 1:
            unbiased = variance.mul_(n).div_(n - 1)
        else:
            unbiased = variance.fill_(float("nan"))
        return {data.step: 1 - n * g_sq.div_(unbiased.add_(self.eps)).mean()}
