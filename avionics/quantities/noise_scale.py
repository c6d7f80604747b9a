"""The gradient noise scale of McCandlish et al. (2018), "An Empirical Model of Large-Batch
Training", appendix A.1, from the step's own per-sample gradients.

With N samples, g_n the gradient of the per-sample loss l_n and g = mean_n g_n the gradient of
the mean loss over the batch, the paper's unbiased estimates from a small batch of
B_small = 1 sample (|G_small|^2 = ||g_n||^2, averaged over the N samples) and a big one of
B_big = N (|G_big|^2 = ||g||^2) are

    |G|^2 = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
          = (N ||g||^2 - mean_n ||g_n||^2) / (N - 1)
    tr(S) = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)
          = (mean_n ||g_n||^2 - ||g||^2) / (1 - 1 / N)

of the squared norm of the true gradient G = E[g_n] and of the trace of the per-sample
gradients' covariance Sigma (E ||g_n||^2 = |G|^2 + tr(Sigma), E ||g||^2 = |G|^2 + tr(Sigma) / N).
tr(S) is the trace of the unbiased sample covariance, sum_n ||g_n - g||^2 / (N - 1), and
||g||^2 = |G|^2 + tr(S) / N exactly. Their ratio is the simple noise scale
B_simple = tr(S) / |G|^2, the paper's estimate of the critical batch size. The squared norms
are over all tracked parameters.

A quantity stores one value per step and a stored value has no dict-of-numbers kind
(:mod:`avionics.quantities.outputs`), so these are four scalar quantities, each read by the log
reader, the exports and the dashboard as any scalar; they share the per-sample work (the merged
request computes ||g_n||^2 once for all): TrueGradSqNorm (|G|^2), GradCovTrace (tr(S)),
SimpleNoiseScale (this step's B_simple) and GradientNoiseScale (the smoothed B_simple, the one
to read: a single step's |G|^2 is noisy and can be negative).

The estimates refer to the mean loss over the batch; for a sum-reduced loss they are the same
(g_n are the per-sample losses' gradients either way). Under data parallelism the batch is the
global one: N counts every process's samples, sum_n ||g_n||^2 is added over the processes (one
number per quantity in the cockpit's packed all-reduce) and g is the global mean gradient.
Everything after the per-parameter sums is float64. A batch of one sample leaves them
undefined: nan, with a warning.

``per_process=True`` is the cheap form under data parallelism (the paper's own estimator in
data-parallel training): the small batches are the P processes' own, B_small = N / P with
|G_small|^2 the mean over processes of ||g_r||^2 (each process's gradient before the
all-reduce), B_big = N with ||g||^2; no per-sample statistics, one number per process.

``per_layer=True`` also reads them per tracked parameter k, from that parameter's squared
norms alone (|G^(k)|^2 from ||g_n^(k)||^2 and ||g^(k)||^2, likewise tr(S^(k))): TrueGradSqNorm
and GradCovTrace are sums over the parameters, so they store the list of the K terms (their
sum is the global value); SimpleNoiseScale stores the global ratio and the K ratios
tr(S^(k)) / |G^(k)|^2, the noise scale of each parameter (see
:data:`~avionics.quantities.outputs.PER_LAYER`).
"""

from __future__ import annotations

import math
import warnings
from numbers import Real

import torch
from torch import Tensor

from avionics.persample import Request
from avionics.quantities.arguments import checked_real
from avionics.quantities.base import (
    Quantity,
    StepData,
    global_norm_squared,
    mean_gradient_sq_norm,
    mean_gradient_sq_norms,
    per_parameter_rows,
)
from avionics.quantities.gradient_tests import PER_SAMPLE_KEYS
from avionics.quantities.outputs import PER_LAYER, per_parameter

# the sum the quantities add over the processes: sum_n ||g_n||^2 over all tracked parameters,
# and with per_layer its terms of each parameter
SQ_NORMS = "sq_norms"
PER_PARAMETER = "per_parameter"


def signal_and_noise(
    small: Tensor, b_small: int, big: Tensor, b_big: int
) -> tuple[Tensor, Tensor]:
    """(|G|^2, tr(S)) from |G_small|^2 of batches of b_small samples and |G_big|^2 of one of
    b_big > b_small: ((b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small),
    (|G_small|^2 - |G_big|^2) / (1 / b_small - 1 / b_big))."""
    signal = (b_big * big - b_small * small) / (b_big - b_small)
    noise = (small - big) / (1 / b_small - 1 / b_big)
    return signal, noise


class _NoiseScaleEstimate(Quantity):
    """Shared: the step's |G|^2 and tr(S) of the global batch, from ||g_n||^2 alone or, with
    ``per_process``, from the processes' own gradients (see the module docstring).

    Args:
        schedule: the steps it is computed at (default: every step).
        per_process: under data parallelism, take each process's batch of N / P samples as
            the small batch (B_small = N / P) instead of single samples: no per-sample
            statistics, and one number per process added over them. Needs equal batches on
            every process; with one process it stores nan, with a warning.
        per_layer: also keep the estimate of each tracked parameter (see the module
            docstring).
    """

    def __init__(self, schedule=None, per_process: bool = False, per_layer: bool = False):
        super().__init__(schedule, per_layer)
        if not isinstance(per_process, bool):
            raise TypeError(
                f"{self.name}(per_process={per_process!r}): per_process must be True or False."
            )
        self.per_process = per_process
        self.info_keys = ("batch_size",) if per_process else PER_SAMPLE_KEYS

    def request(self, step: int) -> Request:
        return Request() if self.per_process else Request(sq_norms=True)

    def sums(self, data: StepData) -> dict[str, Tensor]:
        """{"sq_norms": sum_n ||g_n||^2} over this process's samples, or with
        ``per_process`` its own mean gradient's ||g_r||^2 (float64); with ``per_layer``,
        also {"per_parameter": those of each tracked parameter}."""
        if not self.per_process:
            terms = per_parameter_rows(data.statistics.sq_norms).sum(1)
        elif data.parallel.local_grads is None:
            terms = torch.full(
                (len(data.params),), math.nan, dtype=torch.float64, device=data.params[0].device
            )
        else:
            local_grads, world = data.parallel.local_grads, data.parallel.world
            terms = torch.stack([global_norm_squared([g]).double() for g in local_grads])
            if data.reduction == "sum":  # this process's gradient of its sum: N_r g_r
                terms = terms / data.parallel.batch_sizes[world.rank] ** 2
        if self.per_layer:
            return {SQ_NORMS: terms.sum(), PER_PARAMETER: terms}
        return {SQ_NORMS: terms.sum()}

    def estimates(self, data: StepData, key: str = SQ_NORMS) -> tuple[Tensor, Tensor]:
        """(|G|^2, tr(S)) of the step, or with ``key="per_parameter"`` those of each tracked
        parameter; nan, with a warning (of the global ones), where they are undefined."""
        total = data.totals[self.name][key]
        n = data.batch_size
        big = mean_gradient_sq_norm(data) if key == SQ_NORMS else mean_gradient_sq_norms(data)
        if self.per_process:
            sizes, processes = data.parallel.batch_sizes, data.parallel.world.size
            if processes > 1 and len(set(sizes)) == 1:
                return signal_and_noise(total / processes, n // processes, big, n)
            why = "one process" if processes == 1 else f"unequal batches {sizes}"
        elif n >= 2:
            return signal_and_noise(total / n, 1, big, n)
        else:
            why = "a batch of one sample"
        if key == SQ_NORMS:
            warnings.warn(
                f"{self.name} at step {data.step} is undefined for {why}; stored nan.",
                stacklevel=2,
            )
        nan = torch.full_like(total, float("nan"))
        return nan, nan

    def value(self, data: StepData, statistic) -> Tensor | dict:
        """``statistic(|G|^2, tr(S))`` of the step and, with ``per_layer``, of each parameter
        (:meth:`~avionics.quantities.base.Quantity.layered`)."""
        value = statistic(*self.estimates(data))
        if self.per_layer:
            return self.layered(value, statistic(*self.estimates(data, PER_PARAMETER)))
        return value


class TrueGradSqNorm(_NoiseScaleEstimate):
    """|G|^2 = (N ||g||^2 - mean_n ||g_n||^2) / (N - 1), the unbiased estimate of the squared
    norm of the true gradient (McCandlish et al. 2018) of the mean loss over the batch (the same
    for a sum-reduced loss); can be negative when the noise dominates. See the module
    docstring."""

    per_layer_output = per_parameter("sum")

    def compute(self, data: StepData):
        return {data.step: self.value(data, lambda signal, noise: signal)}


class GradCovTrace(_NoiseScaleEstimate):
    """tr(S) = (mean_n ||g_n||^2 - ||g||^2) / (1 - 1 / N) = sum_n ||g_n - g||^2 / (N - 1), the
    unbiased estimate of the trace of the covariance of the gradients of the per-sample losses
    (McCandlish et al. 2018), g the gradient of the mean loss over the batch (the same for a
    sum-reduced loss). See the module docstring."""

    per_layer_output = per_parameter("sum")

    def compute(self, data: StepData):
        return {data.step: self.value(data, lambda signal, noise: noise)}


class SimpleNoiseScale(_NoiseScaleEstimate):
    """This step's simple noise scale B_simple = tr(S) / |G|^2 (McCandlish et al. 2018), of
    the mean loss over the batch (the same for a sum-reduced loss): noisy, and negative when
    the step's |G|^2 estimate is; GradientNoiseScale smooths it. See the module docstring."""

    per_layer_output = PER_LAYER

    def compute(self, data: StepData):
        return {data.step: self.value(data, lambda signal, noise: noise / signal)}


class GradientNoiseScale(_NoiseScaleEstimate):
    """The smoothed simple noise scale B_simple (McCandlish et al. 2018, appendix A.1), the
    estimate of the critical batch size: tr(S) / |G|^2 of exponential moving averages of the
    two estimates over the tracked steps, as the paper does (a single step's |G|^2 can be
    negative). They refer to the mean loss over the batch (the same for a sum-reduced loss);
    under data parallelism to the global batch of N = all processes' samples (see the module
    docstring).

    With beta = ``smoothing`` and m_0 = 0, each average is m_t = beta m_{t-1} + (1 - beta) x_t,
    bias-corrected as Adam's moments, m_t / (1 - beta^t). Both have the same correction, which
    cancels in the ratio: the stored value is m_t(tr S) / m_t(|G|^2), at the first step that
    step's own B_simple (not pulled towards 0). A step whose estimates are not finite stores
    nan and leaves the averages as they were. The averages are kept by :meth:`state_dict`, so
    a resumed run continues them. With ``per_layer``, each parameter k has its own two
    averages, of |G^(k)|^2 and tr(S^(k)), and its smoothed ratio is stored beside the global
    one (:data:`~avionics.quantities.outputs.PER_LAYER`).

    Args:
        schedule: the steps it is computed at (default: every step); the averages run over
            these steps.
        smoothing: beta, in [0, 1): the weight of the previous average (0: no smoothing).
        per_process: see :class:`_NoiseScaleEstimate`.
        per_layer: also keep the smoothed noise scale of each tracked parameter.
    """

    per_layer_output = PER_LAYER

    def __init__(
        self,
        schedule=None,
        smoothing: float = 0.9,
        per_process: bool = False,
        per_layer: bool = False,
    ):
        self.smoothing = checked_real(
            "GradientNoiseScale",
            "smoothing",
            smoothing,
            "the weight of the previous average in the moving averages",
            at_least=0,
            below=1,
        )
        super().__init__(schedule, per_process, per_layer)
        # m_t of |G|^2 and of tr(S) (float64 scalars; with per_layer, also [K] of each
        # parameter's), keyed as in the state dict; empty before the first step
        self._averages: dict[str, Tensor] = {}

    def compute(self, data: StepData):
        averages, smoothed = self._smoothed("", *self.estimates(data))
        if self.per_layer:
            layer_averages, layers = self._smoothed(LAYER, *self.estimates(data, PER_PARAMETER))
            averages.update(layer_averages)
            smoothed = self.layered(smoothed, layers)
        self._averages = averages  # (all or nothing: _smoothed may raise)
        return {data.step: smoothed}

    def _smoothed(self, prefix: str, signal: Tensor, noise: Tensor) -> tuple[dict, Tensor]:
        """The averages ``prefix + "signal_average"`` and ``prefix + "noise_average"`` moved
        by this step's estimates where they are finite, and their ratio there (nan
        elsewhere)."""
        keys = prefix + "signal_average", prefix + "noise_average"
        beta = self.smoothing
        # on the device, without a host transfer, both averages in one pass over [2, ...]: a
        # non-finite step keeps the averages
        estimates = torch.stack([signal, noise])
        finite = torch.isfinite(estimates).all(0)
        saved = [self._averages.get(key) for key in keys]
        if saved[0] is None:
            previous = torch.zeros_like(estimates)
        else:
            for average in saved:
                if average.shape != signal.shape:
                    raise ValueError(
                        f"GradientNoiseScale: the loaded state has averages of "
                        f"{average.numel()} parameters, but the cockpit tracks {signal.numel()}: "
                        "load the state_dict of a run of this model."
                    )
            previous = torch.stack(saved).to(estimates)
        moved = torch.where(finite, beta * previous + (1 - beta) * estimates, previous)
        signal_average, noise_average = moved
        smoothed = torch.where(finite, noise_average / signal_average, math.nan)
        return {keys[0]: signal_average, keys[1]: noise_average}, smoothed

    def state_dict(self) -> dict:
        """The moving averages m_t (none before the first step)."""
        return dict(self._averages)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a bad state raises and changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(
                "GradientNoiseScale.load_state_dict(state) takes the dict that "
                f"GradientNoiseScale.state_dict() returned, got {type(state).__name__}."
            )
        if not state:
            self._averages = {}
            return
        expected = ["signal_average", "noise_average"]
        if self.per_layer:
            expected += [LAYER + key for key in expected]
        if set(state) != set(expected):
            raise ValueError(
                f"GradientNoiseScale.load_state_dict(state): state has the keys {list(state)}; "
                f"it must have {expected} (or none), as GradientNoiseScale.state_dict() "
                "returns."
            )
        self._averages = {key: _saved_average(state, key) for key in expected}


# the prefix of the per-layer averages' keys in GradientNoiseScale's state
LAYER = "layer_"


def _saved_average(state: dict, key: str) -> Tensor:
    """``state[key]`` as a float64 tensor, when it is one finite real number (or, for a
    per-layer average, a 1-d tensor of them)."""
    value = state[key]
    layers = key.startswith(LAYER)
    if layers:
        real = isinstance(value, Tensor) and value.dim() == 1 and value.dtype.is_floating_point
    else:
        one_element = isinstance(value, Tensor) and value.numel() == 1
        real = (one_element and value.dtype.is_floating_point) or (
            isinstance(value, Real) and not isinstance(value, bool)
        )
    what = "a 1-d tensor of finite numbers" if layers else "one finite number"
    message = (
        f"GradientNoiseScale.load_state_dict(state): state[{key!r}] must be {what} (a moving "
        f"average that GradientNoiseScale.state_dict() saved), got {value!r}; pass the "
        "state_dict of the run being resumed."
    )
    if not real:
        raise TypeError(message)
    average = torch.as_tensor(value, dtype=torch.float64)
    if not bool(torch.isfinite(average).all()):
        raise ValueError(message)
    return average if layers else average.reshape(())
