"""Quantities built on the per-coordinate second moment of the per-sample gradients.

With m2_d = mean_n g_{n,d}^2 (from sum_n g_{n,d}^2) and g_d = mean_n g_{n,d}, g_n the gradient
of the per-sample loss l_n:

    MeanGSNR      = mean_d g_d^2 / (m2_d - g_d^2 + eps),               eps = 1e-5
    CABS          = lr * c^2 sum_d (m2_d - g_d^2) / L                  (plain SGD)
    EarlyStopping = 1 - N * mean_d g_d^2 / (s_d^2 + eps),              eps = 1e-5  (plain SGD)

where s_d^2 = N (m2_d - g_d^2) / (N - 1) is the unbiased variance. MeanGSNR is the gradient
signal-to-noise ratio of Liu et al. (2020); CABS the coupled adaptive batch size of Balles et
al. (2017); EarlyStopping the evidence-based criterion of Mahsereci et al. (2017): stop when
it is positive.

MeanGSNR and EarlyStopping are the same for a mean- and a sum-reduced loss. CABS refers to the
loss as the user reduced it, L = ``info["loss"]``, with the learning rate that SGD applies to
its gradient: L is the mean of the terms c l_n (c = 1 for ``losses.mean()``, c = N for
``losses.sum()``), whose gradients c g_n have the variance c^2 (m2_d - g_d^2). For a sum,
SGD's step lr * N g is that of the mean loss with the learning rate N lr, so CABS is N times
the mean-reduced value at the same lr (as in the reference Cockpit tool).

The sums over the coordinates stay in the gradients' dtype (a float64 copy would be
model-sized); what follows them is computed in float64.

``per_layer=True`` also reads them per tracked parameter k, over that parameter's D_k
coordinates alone: CABS is a sum over the coordinates, so it stores the list of the K terms
lr c^2 sum_{d in k} (m2_d - g_d^2) / L (their sum is the global value); MeanGSNR and
EarlyStopping store the global value and the K values with the means over d in k, MeanGSNR_k =
mean_{d in k} g_d^2 / (m2_d - g_d^2 + eps) (the global one is their mean weighted by D_k / D;
see :data:`~avionics.quantities.outputs.PER_LAYER`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from avionics.persample import Request
from avionics.quantities.base import Quantity, StepData, flat_sum_sq, per_parameter_sums
from avionics.quantities.gradient_tests import PER_SAMPLE_KEYS
from avionics.quantities.outputs import PER_LAYER, per_parameter
from avionics.quantities.plain_sgd import plain_sgd_learning_rate, require_plain_sgd


def _flat(tensors) -> torch.Tensor:
    """The tensors flattened into one new tensor (a copy even of a single tensor: callers
    overwrite it)."""
    return torch.cat([t.reshape(-1) for t in tensors])


class _SecondMoment(Quantity):
    """Shared: the per-coordinate second moment m2_d = mean_n g_{n,d}^2.

    Args:
        schedule: the steps it is computed at (default: every step).
        per_layer: also keep the value over each tracked parameter's coordinates alone (see
            the module docstring).
    """

    info_keys = PER_SAMPLE_KEYS
    per_layer_output = PER_LAYER

    def request(self, step: int) -> Request:
        return Request(sum_sq=True)

    def sums(self, data: StepData):
        return {"sum_sq": flat_sum_sq(data)}

    def moments(self, data: StepData):
        """(g_d^2, biased variance m2_d - g_d^2), flattened over all parameters: two new
        model-sized tensors, each owned by the caller, which may overwrite them."""
        # in place on new tensors: a model-sized temporary per operation would raise the
        # step's peak memory by several copies of the model
        g_sq = _flat(data.mean_grad).square_()
        variance = data.totals[self.name]["sum_sq"].div(data.batch_size).sub_(g_sq)
        return g_sq, variance

    def coordinate_mean(self, terms: Tensor, data: StepData, then=None) -> Tensor | dict:
        """``then(mean_d terms_d)`` (float64; ``then`` the identity by default) and, with
        ``per_layer``, ``then`` of the mean over each parameter's coordinates
        (:meth:`~avionics.quantities.base.Quantity.layered`)."""
        then = then or (lambda mean: mean)
        value = then(terms.mean().double())
        if self.per_layer:
            sizes = [p.numel() for p in data.params]
            sizes = torch.tensor(sizes, dtype=torch.float64, device=value.device)
            means = per_parameter_sums(terms, data).double() / sizes
            return self.layered(value, then(means))
        return value


class _PlainSGDOnly(_SecondMoment):
    """Shared: defined for plain SGD only, which is checked on entering the step."""

    info_keys = PER_SAMPLE_KEYS + ("optimizer",)

    def validate(self, step: int, info: dict) -> None:
        require_plain_sgd(self.name, info["optimizer"])


class MeanGSNR(_SecondMoment):
    """Mean gradient signal-to-noise ratio (Liu et al. 2020):
    mean_d g_d^2 / (m2_d - g_d^2 + eps), eps = 1e-5, from the gradients g_n of the per-sample
    losses (the same for a mean- or a sum-reduced loss)."""

    eps = 1e-5

    def compute(self, data: StepData):
        g_sq, variance = self.moments(data)
        return {data.step: self.coordinate_mean(g_sq.div_(variance.add_(self.eps)), data)}


class CABS(_PlainSGDOnly):
    """Coupled adaptive batch size (Balles et al. 2017): lr * c^2 sum_d (m2_d - g_d^2) / L, the
    suggested batch size, for the loss L as the user reduced it (c = 1 for the mean of the
    per-sample losses, c = N for their sum: see the module docstring); plain SGD only."""

    per_layer_output = per_parameter("sum")

    def compute(self, data: StepData):
        lr = plain_sgd_learning_rate(data.optimizer)
        c = data.batch_size if data.reduction == "sum" else 1
        _, variance = self.moments(data)
        scale = lr * c**2 / data.loss.double()
        value = scale * variance.sum().double()
        if self.per_layer:
            value = self.layered(value, scale * per_parameter_sums(variance, data).double())
        return {data.step: value}


class EarlyStopping(_PlainSGDOnly):
    """Evidence-based early-stopping criterion (Mahsereci et al. 2017):
    1 - N * mean_d g_d^2 / (s_d^2 + eps), s_d^2 the unbiased variance, eps = 1e-5, from the
    gradients g_n of the per-sample losses (the same for a mean- or a sum-reduced loss); stop
    when it is positive. Plain SGD only."""

    eps = 1e-5

    def compute(self, data: StepData):
        n = data.batch_size
        g_sq, variance = self.moments(data)
        if n > 1:
            unbiased = variance.mul_(n).div_(n - 1)
        else:
            unbiased = variance.fill_(float("nan"))
        ratios = g_sq.div_(unbiased.add_(self.eps))
        return {data.step: self.coordinate_mean(ratios, data, lambda mean: 1 - n * mean)}
