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
"""

from __future__ import annotations

import math
import warnings
from numbers import Real

import torch
from torch import Tensor

from avionics.persample import Request
from avionics.quantities.arguments import checked_real
from avionics.quantities.base import Quantity, StepData, global_norm_squared
from avionics.quantities.gradient_tests import PER_SAMPLE_KEYS

# the sum the quantities add over the processes: sum_n ||g_n||^2 over all tracked parameters
SQ_NORMS = "sq_norms"


def signal_and_noise(sum_sq_norms: Tensor, grad_sq_norm: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(|G|^2, tr(S)) from sum_n ||g_n||^2, ||g||^2 and the batch size N >= 2:
    ((N ||g||^2 - mean_n ||g_n||^2) / (N - 1), (mean_n ||g_n||^2 - ||g||^2) / (1 - 1 / N))."""
    mean_sq_norm = sum_sq_norms / n
    signal = (n * grad_sq_norm - mean_sq_norm) / (n - 1)
    noise = (mean_sq_norm - grad_sq_norm) / (1 - 1 / n)
    return signal, noise


class _NoiseScaleEstimate(Quantity):
    """Shared: the step's |G|^2 and tr(S) of the global batch, from ||g_n||^2 alone."""

    info_keys = PER_SAMPLE_KEYS

    def request(self, step: int) -> Request:
        return Request(sq_norms=True)

    def sums(self, data: StepData) -> dict[str, Tensor]:
        """{"sq_norms": sum_n ||g_n||^2} over this process's samples, float64."""
        return {SQ_NORMS: sum(s.sum(dtype=torch.float64) for s in data.statistics.sq_norms)}

    def estimates(self, data: StepData) -> tuple[Tensor, Tensor]:
        """(|G|^2, tr(S)) of the step; nan, with a warning, for a batch of one sample."""
        sum_sq_norms = data.totals[self.name][SQ_NORMS]
        n = data.batch_size
        if n < 2:
            warnings.warn(
                f"{self.name} needs a batch of at least 2 samples; stored nan.", stacklevel=2
            )
            nan = torch.full_like(sum_sq_norms, float("nan"))
            return nan, nan
        grad_sq_norm = global_norm_squared(data.mean_grad).double()
        return signal_and_noise(sum_sq_norms, grad_sq_norm, n)


class TrueGradSqNorm(_NoiseScaleEstimate):
    """|G|^2 = (N ||g||^2 - mean_n ||g_n||^2) / (N - 1), the unbiased estimate of the squared
    norm of the true gradient (McCandlish et al. 2018) of the mean loss over the batch (the same
    for a sum-reduced loss); can be negative when the noise dominates. See the module
    docstring."""

    def compute(self, data: StepData):
        signal, _ = self.estimates(data)
        return {data.step: signal}


class GradCovTrace(_NoiseScaleEstimate):
    """tr(S) = (mean_n ||g_n||^2 - ||g||^2) / (1 - 1 / N) = sum_n ||g_n - g||^2 / (N - 1), the
    unbiased estimate of the trace of the covariance of the gradients of the per-sample losses
    (McCandlish et al. 2018), g the gradient of the mean loss over the batch (the same for a
    sum-reduced loss). See the module docstring."""

    def compute(self, data: StepData):
        _, noise = self.estimates(data)
        return {data.step: noise}


class SimpleNoiseScale(_NoiseScaleEstimate):
    """This step's simple noise scale B_simple = tr(S) / |G|^2 (McCandlish et al. 2018), of
    the mean loss over the batch (the same for a sum-reduced loss): noisy, and negative when
    the step's |G|^2 estimate is; GradientNoiseScale smooths it. See the module docstring."""

    def compute(self, data: StepData):
        signal, noise = self.estimates(data)
        return {data.step: noise / signal}


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
    a resumed run continues them.

    Args:
        schedule: the steps it is computed at (default: every step); the averages run over
            these steps.
        smoothing: beta, in [0, 1): the weight of the previous average (0: no smoothing).
    """

    def __init__(self, schedule=None, smoothing: float = 0.9):
        self.smoothing = checked_real(
            "GradientNoiseScale",
            "smoothing",
            smoothing,
            "the weight of the previous average in the moving averages",
            at_least=0,
            below=1,
        )
        super().__init__(schedule)
        # m_t of |G|^2 and of tr(S): float64 scalars, None before the first step
        self._signal_average: Tensor | None = None
        self._noise_average: Tensor | None = None

    def compute(self, data: StepData):
        signal, noise = self.estimates(data)
        if self._signal_average is None:
            self._signal_average = self._noise_average = torch.zeros_like(signal)
        beta = self.smoothing
        # on the device, without a host transfer: a non-finite step keeps the averages
        finite = torch.isfinite(signal) & torch.isfinite(noise)
        signal_average = self._signal_average.to(signal)
        noise_average = self._noise_average.to(noise)
        self._signal_average = torch.where(
            finite, beta * signal_average + (1 - beta) * signal, signal_average
        )
        self._noise_average = torch.where(
            finite, beta * noise_average + (1 - beta) * noise, noise_average
        )
        smoothed = self._noise_average / self._signal_average
        return {data.step: torch.where(finite, smoothed, torch.full_like(smoothed, float("nan")))}

    def state_dict(self) -> dict:
        """The two moving averages m_t (none before the first step)."""
        if self._signal_average is None:
            return {}
        return {"signal_average": self._signal_average, "noise_average": self._noise_average}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a bad state raises and changes nothing."""
        if not isinstance(state, dict):
            raise TypeError(
                "GradientNoiseScale.load_state_dict(state) takes the dict that "
                f"GradientNoiseScale.state_dict() returned, got {type(state).__name__}."
            )
        if not state:
            self._signal_average = self._noise_average = None
            return
        expected = ("signal_average", "noise_average")
        if set(state) != set(expected):
            raise ValueError(
                f"GradientNoiseScale.load_state_dict(state): state has the keys {list(state)}; "
                f"it must have {list(expected)} (or none), as GradientNoiseScale.state_dict() "
                "returns."
            )
        signal = _saved_average(state, "signal_average")
        noise = _saved_average(state, "noise_average")
        self._signal_average, self._noise_average = signal, noise


def _saved_average(state: dict, key: str) -> Tensor:
    """``state[key]`` as a float64 scalar tensor, when it is one finite real number."""
    value = state[key]
    one_element = isinstance(value, Tensor) and value.numel() == 1
    real = (one_element and value.dtype.is_floating_point) or (
        isinstance(value, Real) and not isinstance(value, bool)
    )
    message = (
        f"GradientNoiseScale.load_state_dict(state): state[{key!r}] must be one finite number "
        f"(a moving average that GradientNoiseScale.state_dict() saved), got {value!r}; pass "
        "the state_dict of the run being resumed."
    )
    if not real:
        raise TypeError(message)
    if not math.isfinite(float(value)):
        raise ValueError(message)
    return torch.as_tensor(value, dtype=torch.float64).reshape(())
