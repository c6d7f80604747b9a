"""Histograms of the per-sample gradient elements g_{n,d} (docs/definitions.md, section 8).

* ``GradHist1d``: all N * D elements g_{n,d}; default 100 bins on [-2, 2].
* ``GradHist2d``: all pairs (g_{n,d}, theta_d); default 40 x 50 bins on [-1, 1] x [-2, 2];
  optionally one histogram per parameter as well.

g_n is the gradient of the per-sample loss l_n, whether the user's loss is their mean or sum.

Bins are those of ``numpy.histogram``: edges ``numpy.linspace(lo, hi, bins + 1)``, bin i holds
[e_i, e_{i+1}) and the last bin also holds hi; values outside the range are clamped into the
outer bins. Counts are accumulated on the gradients' device from the chunks the per-sample
engine materialises one parameter at a time (a request ``visitor``): the N x D set never
exists at once. The bin of a value is floor((x - lo) * bins / (hi - lo)) clamped to
[0, bins - 1], counted by the one-pass kernels of :mod:`avionics.quantities.binning`; a value
that lies within rounding of an inner edge can land one bin off numpy's choice.

Range adaptation (``adapt=GradAbsMax()`` or ``ParamAbsMax()``), as in the reference Cockpit
tool: after each tracked step the range becomes [-m, m], m = (1 + padding) * max(min_size / 2,
max |value|), the maximum over all g_{n,d} (GradAbsMax) or all theta_d (ParamAbsMax) of that
step; it applies from the next tracked step on. A step whose maximum is not finite (NaN or
infinite gradients or parameters) leaves the range as it was, with a warning.
"""

from __future__ import annotations

import copy
import math
import warnings
from numbers import Real

import numpy as np
import torch
from torch import Tensor

from avionics.persample import OuterProducts, Request
from avionics.quantities.arguments import checked_int, checked_real
from avionics.quantities.base import Quantity, StepData
from avionics.quantities.binning import Tally1d, bin_index, count_2d, load_kernels
from avionics.quantities.outputs import HISTOGRAM_1D, HISTOGRAM_2D

PER_SAMPLE_KEYS = ("individual_losses", "batch_size")


class _AbsMax:
    """Adapt a histogram range to [-m, m] from the largest absolute value of a step."""

    source = ""

    def __init__(self, padding: float = 0.0, min_size: float = 1e-6):
        owner = type(self).__name__
        self.padding = checked_real(
            owner, "padding", padding, "the range's margin, a fraction of m", at_least=0
        )
        self.min_size = checked_real(
            owner, "min_size", min_size, "the smallest width of the range", above=0
        )

    def limits(self, abs_max: float) -> tuple[float, float]:
        """[-m, m], m = (1 + padding) max(min_size / 2, abs_max), for a finite abs_max."""
        end = (1.0 + self.padding) * max(self.min_size / 2, abs_max)
        return -end, end

    def __repr__(self) -> str:
        return f"{type(self).__name__}(padding={self.padding}, min_size={self.min_size})"


class GradAbsMax(_AbsMax):
    """Range from max_{n,d} |g_{n,d}| of the last tracked step."""

    source = "grad"


class ParamAbsMax(_AbsMax):
    """Range from max_d |theta_d| of the last tracked step."""

    source = "param"


def _checked_range(name: str, bins, limits, axis: str = "") -> tuple[int, tuple[float, float]]:
    """(bins, (lower, upper)) of one axis: a positive number of bins and finite limits with
    lower < upper; ``axis`` ("[0]", "[1]" for GradHist2d) says which element of the pairs."""
    bins = checked_int(name, f"bins{axis}", bins, 1, "the number of bins")
    valid = "a pair (lower, upper) of finite numbers with lower < upper, e.g. (-2.0, 2.0)"
    if not (
        isinstance(limits, (tuple, list))
        and len(limits) == 2
        and all(isinstance(v, Real) and not isinstance(v, bool) for v in limits)
    ):
        raise TypeError(f"{name}(range{axis}={limits!r}): range{axis} must be {valid}.")
    lo, hi = float(limits[0]), float(limits[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"{name}(range{axis}={limits!r}): range{axis} must be {valid}.")
    return bins, (lo, hi)


def _checked_adapt(name: str, adapt):
    if adapt is not None and not isinstance(adapt, _AbsMax):
        raise TypeError(
            f"{name}(adapt={adapt!r}): adapt takes avionics.quantities.GradAbsMax(...) or "
            "ParamAbsMax(...) or None."
        )
    return adapt


def _checked_pair(name: str, argument: str, value) -> tuple:
    """``value`` as a pair (gradient axis, parameter axis)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(
            f"{name}({argument}={value!r}): {argument} must be a pair (gradient axis, "
            "parameter axis)."
        )
    return tuple(value)


def _edges(bins: int, limits: tuple[float, float]) -> list[float]:
    return np.linspace(limits[0], limits[1], bins + 1).tolist()


def _larger(a: Tensor | None, b: Tensor) -> Tensor:
    """The larger of two 0-d maxima, None standing for none yet."""
    return b if a is None else torch.maximum(a, b.to(a.device))


def _abs_max(t: Tensor) -> Tensor:
    low, high = torch.aminmax(t)
    return torch.maximum(-low, high)


def _chunk_abs_max(chunk: Tensor | OuterProducts) -> Tensor:
    if isinstance(chunk, OuterProducts):
        return chunk.abs_max()
    return _abs_max(chunk) if chunk.numel() else chunk.new_zeros(())


class _Histogram(Quantity):
    """Shared: counts accumulated by a visitor of the per-sample gradient chunks; the range
    (adapted or not) is what a resumed run needs."""

    info_keys = PER_SAMPLE_KEYS

    def request(self, step: int) -> Request:
        return Request(visitors=(self._visit,)) if self.schedule(step) else Request()

    def prepare(self, data: StepData) -> dict[str, list[Tensor]]:
        """Called before the engine visits the chunks: reset this step's counts."""
        self._begin(data)
        return {}

    def state_dict(self) -> dict:
        return {"range": copy.deepcopy(self.range)}

    def load_state_dict(self, state: dict) -> None:
        if "range" in state:
            self.range = copy.deepcopy(state["range"])

    def _visit(self, k: int, chunk: Tensor | OuterProducts) -> None:
        raise NotImplementedError

    def _begin(self, data: StepData) -> None:
        raise NotImplementedError


class GradHist1d(_Histogram):
    """Histogram of all per-sample gradient elements g_{n,d}, g_n the gradient of the
    per-sample loss l_n (the same for a mean- or a sum-reduced loss).

    Args:
        schedule: the steps to track (default every step).
        bins: number of bins (default 100).
        range: (lower, upper) limits (default (-2, 2)); values outside are clamped.
        adapt: None, or ``GradAbsMax(padding, min_size)`` / ``ParamAbsMax(...)``.

    Value: ``{"hist": counts [bins], "edges": [bins + 1 edges]}``.

    Example:
        Every one of the N * D per-sample gradient elements is counted once: 16 samples of a
        4-8-3 MLP with D = 67 parameters give 1072 counts in 100 bins on [-2, 2].

        >>> from avionics.demo import example_run
        >>> from avionics.quantities import GradHist1d
        >>> histogram = example_run([GradHist1d()], steps=1)[0]["GradHist1d"]
        >>> int(sum(histogram["hist"])), len(histogram["hist"]), len(histogram["edges"])
        (1072, 100, 101)
        >>> histogram["edges"][0], histogram["edges"][-1]
        (-2.0, 2.0)
    """

    output = HISTOGRAM_1D

    def __init__(self, schedule=None, bins: int = 100, range=(-2.0, 2.0), adapt=None):
        super().__init__(schedule)
        self.bins, self.range = _checked_range(self.name, bins, range)
        self.adapt = _checked_adapt(self.name, adapt)
        self._tally: Tally1d | None = None
        self._max: Tensor | float | None = None

    def _begin(self, data: StepData) -> None:
        # one tally per step: every parameter's chunks are counted into the same counters,
        # collected once in sums
        self._step_range = self.range
        self._tally, self._max = Tally1d(self.bins, *self._step_range), None

    def _visit(self, k: int, chunk: Tensor | OuterProducts) -> None:
        self._tally.add(chunk)
        if self.adapt is not None and self.adapt.source == "grad":
            self._max = _larger(self._max, _chunk_abs_max(chunk))

    def sums(self, data: StepData):
        sums = {"hist": self._tally.counts(data.params[0].device)}
        if self.adapt is not None and self.adapt.source == "grad":
            sums["max"] = _slots_of_max(self._max, data)
        self._tally, self._max = None, None
        return sums

    def compute(self, data: StepData):
        totals = data.totals[self.name]
        value = {"hist": totals["hist"], "edges": _edges(self.bins, self._step_range)}
        if self.adapt is not None:
            grad_max = totals["max"].max() if "max" in totals else None
            self.range = _adapted(self.name, self.adapt, grad_max, data, self.range)
        return {data.step: value}


class GradHist2d(_Histogram):
    """Joint histogram of (g_{n,d}, theta_d) over all samples n and coordinates d, g_n the
    gradient of the per-sample loss l_n (the same for a mean- or a sum-reduced loss).

    Args:
        schedule: the steps to track (default every step).
        bins: (gradient bins, parameter bins), default (40, 50).
        range: ((g lower, g upper), (theta lower, theta upper)), default ((-1, 1), (-2, 2)).
        adapt: (adaptation of the gradient axis, of the parameter axis), each None,
            ``GradAbsMax(...)`` or ``ParamAbsMax(...)``.
        per_parameter: also keep one histogram per tracked parameter.

    Value: ``{"hist": counts [xbins, ybins], "edges": [x edges, y edges]}`` (axis 0 is the
    gradient, as ``numpy.histogram2d(g, theta)``), plus ``"param_hist"``: the per-parameter
    counts in parameter order, when ``per_parameter`` is set.
    """

    output = HISTOGRAM_2D

    def __init__(
        self,
        schedule=None,
        bins=(40, 50),
        range=((-1.0, 1.0), (-2.0, 2.0)),
        adapt=(None, None),
        per_parameter: bool = False,
    ):
        super().__init__(schedule)
        bins, range, adapt = (
            _checked_pair(self.name, argument, value)
            for argument, value in (("bins", bins), ("range", range), ("adapt", adapt))
        )
        checked = [
            _checked_range(self.name, b, r, f"[{axis}]")
            for axis, (b, r) in enumerate(zip(bins, range, strict=True))
        ]
        self.bins = tuple(b for b, _ in checked)
        self.range = [r for _, r in checked]
        self.adapt = [_checked_adapt(self.name, a) for a in adapt]
        if not isinstance(per_parameter, bool):
            raise TypeError(
                f"{self.name}(per_parameter={per_parameter!r}): per_parameter must be True or "
                "False (whether to keep one histogram per parameter as well)."
            )
        self.per_parameter = per_parameter
        self._counts: list[Tensor | None] = []
        self._offsets: dict[int, Tensor] = {}
        self._track_max = any(a is not None and a.source == "grad" for a in self.adapt)

    def _begin(self, data: StepData) -> None:
        self._params, self._offsets = data.params, {}
        self._counts = [None] * len(data.params)
        self._max = None
        self._step_range = list(self.range)

    def _visit(self, k: int, chunk: Tensor | OuterProducts) -> None:
        (xbins, ybins), ((xlo, xhi), (ylo, yhi)) = self.bins, self._step_range
        # flat bin index y * xbins + x per element (y from theta_d, the same for every sample);
        # the counts are reshaped to [ybins, xbins] and transposed at the end
        offset = self._offsets.get(k)
        if offset is None:
            theta = self._params[k].detach().reshape(-1)
            offset = bin_index(theta, ybins, ylo, yhi).mul_(xbins)
            self._offsets[k] = offset = offset.to(torch.int32)
        counts = self._counts[k]
        if counts is None:
            counts = self._counts[k] = torch.zeros(
                xbins * ybins, dtype=torch.int64, device=chunk.device
            )
        count_2d(chunk, offset, xbins, xlo, xhi, counts)
        if self._track_max:
            self._max = _larger(self._max, _chunk_abs_max(chunk))

    def sums(self, data: StepData):
        xbins, ybins = self.bins
        per_param = [
            c.reshape(ybins, xbins).t() if c is not None
            else torch.zeros(xbins, ybins, dtype=torch.int64, device=data.params[0].device)
            for c in self._counts
        ]  # fmt: skip
        total = per_param[0].clone()
        for c in per_param[1:]:
            total = total + c.to(total.device)
        sums = {"hist": total}
        if self.per_parameter:
            sums.update({f"param_hist.{k}": c for k, c in enumerate(per_param)})
        if self._track_max:
            sums["max"] = _slots_of_max(self._max, data)
        self._counts, self._max, self._params, self._offsets = [], None, None, {}
        return sums

    def compute(self, data: StepData):
        totals = data.totals[self.name]
        edges = [_edges(b, r) for b, r in zip(self.bins, self._step_range, strict=True)]
        value = {"hist": totals["hist"], "edges": edges}
        if self.per_parameter:
            value["param_hist"] = [totals[f"param_hist.{k}"] for k in range(len(data.params))]
        grad_max = totals["max"].max() if "max" in totals else None
        for axis, adapt in enumerate(self.adapt):
            if adapt is not None:
                self.range[axis] = _adapted(self.name, adapt, grad_max, data, self.range[axis])
        return {data.step: value}


def _slots_of_max(grad_max: Tensor | None, data: StepData) -> Tensor:
    """This process's max_{n,d} |g_{n,d}| in its slot of a [processes] vector: the sum over
    the processes holds every one's, whose max is the global batch's."""
    if grad_max is None:
        mine = torch.zeros((), dtype=torch.float64, device=data.params[0].device)
    else:
        mine = grad_max.double()
    return data.parallel.world.slots(mine.reshape(()))


def _adapted(name: str, adapt: _AbsMax, grad_max, data: StepData, current) -> tuple:
    """The range for the next tracked step: adapted to this step's maximum, or ``current``,
    with a warning, when that maximum is not finite (a NaN or infinite range would spoil the
    histograms of the finite steps after it)."""
    abs_max = _source_max(adapt, grad_max, data)
    if math.isfinite(abs_max):
        return adapt.limits(abs_max)
    what = "per-sample gradient element" if adapt.source == "grad" else "parameter"
    warnings.warn(
        f"{name} at step {data.step}: the largest |{what}| is {abs_max}, so {adapt!r} keeps "
        f"the range {tuple(current)} for the next tracked step.",
        stacklevel=3,
    )
    return current


def _source_max(adapt: _AbsMax, grad_max: Tensor | None, data: StepData) -> float:
    """max_{n,d} |g_{n,d}| (from the visited chunks) or max_d |theta_d| of the step; nan
    when any of them is nan."""
    if adapt.source == "grad":
        return float(grad_max) if grad_max is not None else 0.0
    maxima = [float(_abs_max(p)) for p in data.params if p.numel()]
    return math.nan if any(map(math.isnan, maxima)) else max(maxima, default=0.0)


def load_histogram_kernels(quantities: list[Quantity], params: list[Tensor]) -> None:
    """Where ``quantities`` hold a histogram, load (or compile) the CPU kernels they use (1d
    for GradHist1d, 2d for GradHist2d) for the per-sample gradients of ``params``
    (:func:`avionics.quantities.binning.load_kernels`; the gradients are in float32 or
    float64, the CPU parameters' dtype at least float32), so that the first tracked step does
    not pay for it. Parameters on another device are counted by torch operations, which need
    nothing loaded."""
    dims = {1 if isinstance(q, GradHist1d) else 2 for q in quantities if isinstance(q, _Histogram)}
    if dims:
        cpu = {p.dtype for p in params if p.device.type == "cpu"}
        load_kernels({torch.float64 if d == torch.float64 else torch.float32 for d in cpu}, dims)
