"""Alpha: the normalized step length of a noise-aware quadratic fit (SPEC section 2).

Along the update s = theta_{t+1} - theta_t, tau = ||s||, four observations of the loss f(x) =
L(theta_t + x s / tau) on [0, tau]: f_0, f_1 (mini-batch losses at t and t+1), df_0, df_1
(mean over samples of the projections (g_n . s) / tau at t and at t+1), each with the
unbiased variance of its per-sample terms as its noise. A weighted least-squares fit of
f(x) = w1 + w2 x + w3 x^2 (weights 1 / variance, a zero variance becomes 1e-10) gives
alpha = tau / x* - 1 with x* = -w2 / (2 w3), or -1 when w3 < 0. Stored under the start step t.

The projections at t need s, which for most optimizers exists only after ``optimizer.step()``:

* plain SGD (one learning rate, no momentum, weight decay, nesterov or maximize): s = -lr * g
  is known at t and (g_n . s) / tau = -(g_n . g) / ||g||, the "grad" projections the engine
  computes anyway. Only s (one copy of the parameters' size) is kept until t+1. (This assumes
  that the optimizer steps every tracked parameter on its gradient as the cockpit saw it: no
  gradient clipping between the backward and ``optimizer.step()``.)
* every other optimizer: theta_t and the start step's ``StepData.per_sample`` are kept until
  t+1 (that step's captured layer inputs and output gradients, never N x D per-sample
  gradients); at t+1 the start step's g_n are projected onto the measured s in one pass of the
  engine, with theta_t swapped back in.

For a sum-reduced loss, f is L / N (the mean of the per-sample losses), consistent with the
derivatives, which are means over samples; alpha is invariant to that scaling.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor

from avionics.persample import Request
from avionics.quantities.base import Quantity, StepData, global_norm_squared

# Replaces a zero variance in the weights 1 / variance of the fit.
MIN_VARIANCE = 1e-10
_DIRECTION = "Alpha"


class Alpha(Quantity):
    info_keys = ("individual_losses", "batch_size", "optimizer")

    def __init__(self, schedule=None):
        super().__init__(schedule)
        self._start: _Start | None = None
        self._plain_sgd: bool | None = None  # of the optimizer seen at the last start

    def is_active(self, step: int) -> bool:
        return self._start is not None or self.schedule(step)

    def request(self, step: int) -> Request:
        directions = set()
        if self._start is not None:
            directions.add(_DIRECTION)  # g_n . s / tau at the end step
        if self.schedule(step) and (self._plain_sgd is not False or not directions):
            # the start projections of plain SGD; for any other optimizer (known from the last
            # step) only a non-empty request, so that the step's forward is captured
            directions.add("grad")
        return Request(directions=frozenset(directions))

    def directions(self, data: StepData) -> dict[str, list[Tensor]]:
        if self._start is None:
            return {}
        start = self._start
        start.finish_update(data.params)
        if start.tau == 0:
            return {_DIRECTION: [torch.zeros_like(p) for p in data.params]}
        return {_DIRECTION: [s / start.tau for s in start.update]}

    def compute(self, data: StepData):
        values = {}
        if self._start is not None:
            start, self._start = self._start, None
            values[start.step] = start.alpha(data)
        if self.schedule(data.step):
            self._start = _Start.at(data)
            self._plain_sgd = self._start.per_sample is None
        return values


class _Start:
    """What a start step keeps until the next step: its zeroth-order observation and either
    the update (plain SGD, with the start projections) or theta_t and the start's engine."""

    def __init__(self, step: int, f: float, var_f: float):
        self.step, self.f, self.var_f = step, f, var_f
        self.n = 0  # batch size at the start
        self.update: list[Tensor] | None = None  # s
        self.tau: float | None = None
        self.projections: Tensor | None = None  # (g_n . s) / tau at the start, [N]
        self.params: list[Tensor] | None = None  # theta_t, when s is measured
        self.per_sample = None

    @classmethod
    def at(cls, data: StepData) -> _Start:
        losses = _checked_losses(data)
        start = cls(data.step, float(losses.mean()), _unbiased_variance(losses))
        start.n = losses.numel()
        optimizer = data.optimizer
        lr = _plain_sgd_learning_rate(optimizer)
        if lr is not None and "grad" in data.statistics.projections:
            g_norm = math.sqrt(float(global_norm_squared(data.mean_grad)))
            # s = -lr * p.grad, and p.grad = c * g with c > 0 (c = N for a sum-reduced loss)
            start.update = [-lr * g for g in data.grads]
            start.tau = math.sqrt(float(global_norm_squared(start.update)))
            projections = sum(data.statistics.projections["grad"])
            start.projections = (
                -projections / g_norm if g_norm > 0 else torch.zeros_like(projections)
            )
        else:
            if not hasattr(optimizer, "step"):
                raise TypeError(
                    f"Step {data.step}: Alpha reads info['optimizer'], which must be the "
                    f"optimizer that updates the parameters; got {type(optimizer).__name__}."
                )
            if data.per_sample is None:
                raise RuntimeError(f"Step {data.step}: Alpha needs the step's per-sample data.")
            start.params = [p.clone() for p in data.params]
            start.per_sample = data.per_sample
        return start

    def finish_update(self, params: list[Tensor]) -> None:
        """Measure s = theta_{t+1} - theta_t (when not known in advance) and project."""
        if self.update is not None:
            return
        self.update = [p - q for p, q in zip(params, self.params, strict=True)]
        self.tau = math.sqrt(float(global_norm_squared(self.update)))
        if self.tau > 0:
            unit = [s / self.tau for s in self.update]
            stats = self.per_sample(
                Request(directions=frozenset({_DIRECTION})), {_DIRECTION: unit}, self.params
            )
            self.projections = sum(stats.projections[_DIRECTION])
        self.params, self.per_sample = None, None  # release theta_t and the start's capture

    def alpha(self, data: StepData) -> float:
        """Alpha of this start and the end step ``data``."""
        losses = _checked_losses(data)
        self.finish_update(data.params)  # (already done if the engine ran at the end step)
        if min(losses.numel(), self.n) < 2:
            warnings.warn(
                f"Alpha at step {self.step} needs batches of at least 2 samples for its "
                "variances; stored nan.",
                stacklevel=3,
            )
            return math.nan
        if self.tau == 0:
            warnings.warn(
                f"Alpha at step {self.step}: the update theta_{{t+1}} - theta_t has length zero "
                "(no motion); stored -1.",
                stacklevel=3,
            )
            return -1.0
        end = sum(data.statistics.projections[_DIRECTION])
        f = [self.f, float(losses.mean())]
        df = [float(self.projections.mean()), float(end.mean())]
        var_f = [self.var_f, _unbiased_variance(losses)]
        var_df = [_unbiased_variance(self.projections), _unbiased_variance(end)]
        return fit_alpha(self.tau, f, df, var_f, var_df)


def fit_alpha(tau: float, f, df, var_f, var_df) -> float:
    """Alpha from the weighted least-squares quadratic fit of SPEC section 2."""
    x = np.array([[1.0, 0.0, 0.0], [1.0, tau, tau**2], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0 * tau]])
    y = np.array([*f, *df], dtype=np.float64)
    variances = np.array([*var_f, *var_df], dtype=np.float64)
    variances = np.where(variances == 0, MIN_VARIANCE, variances)
    root_weights = 1.0 / np.sqrt(variances)
    w, *_ = np.linalg.lstsq(x * root_weights[:, None], y * root_weights, rcond=None)
    w2, w3 = float(w[1]), float(w[2])
    if w3 < 0 or not math.isfinite(w3):
        return -1.0
    # tau / x* - 1 with x* = -w2 / (2 w3), written without dividing by w3
    if w2 == 0:  # minimum at the start (w3 > 0); a flat fit (w3 = 0) has none
        return math.inf if w3 > 0 else -1.0
    return -2.0 * w3 * tau / w2 - 1.0


def _checked_losses(data: StepData) -> Tensor:
    """The per-sample losses in float64 (the cockpit has checked that they were passed)."""
    return data.individual_losses.detach().double()


def _unbiased_variance(values: Tensor) -> float:
    return float(values.double().var()) if values.numel() > 1 else math.nan


def _plain_sgd_learning_rate(optimizer) -> float | None:
    """The single learning rate of plain SGD, or None for any other update rule."""
    if type(optimizer) is not torch.optim.SGD:
        return None
    lrs = set()
    for group in optimizer.param_groups:
        if (
            group.get("momentum", 0)
            or group.get("weight_decay", 0)
            or group.get("nesterov", False)
            or group.get("maximize", False)
        ):
            return None
        lrs.add(float(group["lr"]))
    return lrs.pop() if len(lrs) == 1 else None
