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
)
from avionics.quantities.gradient_tests import PER_SAMPLE_KEYS

# the sum the quantities add over the processes: sum_n ||g_n||^2 over all tracked parameters
SQ_NORMS = "sq_norms"


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
    """

    def __init__(self, schedule=None, per_process: bool = False):
        super().__init__(schedule)
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
        ``per_process`` its own mean gradient's ||g_r||^2 (float64)."""
        if not self.per_process:
            return {SQ_NORMS: sum(s.sum(dtype=torch.float64) for s in data.statistics.sq_norms)}
        if data.local_grads is None:
            return {SQ_NORMS: torch.tensor(math.nan, dtype=torch.float64)}
        local = global_norm_squared(data.local_grads).double()
        if data.reduction == "sum":  # this process's gradient of its sum: N_r g_r
            local = local / data.batch_sizes[data.world.rank] ** 2
        return {SQ_NORMS: local}

    def estimates(self, data: StepData) -> tuple[Tensor, Tensor]:
        """(|G|^2, tr(S)) of the step; nan, with a warning, where they are undefined."""
        total = data.totals[self.name][SQ_NORMS]
        n = data.batch_size
        big = mean_gradient_sq_norm(data)
        if self.per_process:
            sizes, processes = set(data.batch_sizes), data.world.size
            if processes > 1 and len(sizes) == 1:
                return signal_and_noise(total / processes, n // processes, big, n)
            why = "one process" if processes == 1 else f"unequal batches {data.batch_sizes}"
        elif n >= 2:
            return signal_and_noise(total / n, 1, big, n)
        else:
            why = "a batch of one sample"
        warnings.warn(
            f"{self.name} at step {data.step} is undefined for {why}; stored nan.", stacklevel=2
        )
        nan = torch.full_like(total, float("nan"))
        return nan, nan


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
        per_process: see :class:`_NoiseScaleEstimate`.
    """

    def __init__(self, schedule=None, smoothing: float = 0.9, per_process: bool = False):
        self.smoothing = checked_real(
            "GradientNoiseScale",
            "smoothing",
            smoothing,
            "the weight of the previous average in the moving averages",
            at_least=0,
            below=1,
        )
        super().__init__(schedule, per_process)
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
