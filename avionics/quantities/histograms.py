"""Histograms of the per-sample gradient elements g_{n,d} (SPEC section 2).

* ``GradHist1d``: all N * D elements g_{n,d}; default 100 bins on [-2, 2].
* ``GradHist2d``: all pairs (g_{n,d}, theta_d); default 40 x 50 bins on [-1, 1] x [-2, 2];
  optionally one histogram per parameter as well.

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
step; it applies from the next tracked step on.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import Tensor

from avionics.persample import OuterProducts, Request
from avionics.quantities.base import Quantity, StepData
from avionics.quantities.binning import bin_index, count_1d, count_2d
from avionics.quantities.outputs import HISTOGRAM_1D, HISTOGRAM_2D

PER_SAMPLE_KEYS = ("individual_losses", "batch_size")


class _AbsMax:
    """Adapt a histogram range to [-m, m] from the largest absolute value of a step."""

    source = ""

    def __init__(self, padding: float = 0.0, min_size: float = 1e-6):
        if padding < 0 or min_size <= 0:
            raise ValueError(
                f"{type(self).__name__} needs padding >= 0 and min_size > 0; got "
                f"padding={padding}, min_size={min_size}."
            )
        self.padding, self.min_size = float(padding), float(min_size)

    def limits(self, abs_max: float) -> tuple[float, float]:
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


def _checked_range(name: str, bins, limits) -> tuple[int, tuple[float, float]]:
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"{name}: bins must be a positive integer, got {bins!r}.")
    lo, hi = (float(v) for v in limits)
    if not lo < hi:
        raise ValueError(f"{name}: a range needs lower < upper, got ({lo}, {hi}).")
    return bins, (lo, hi)


def _checked_adapt(name: str, adapt):
    if adapt is not None and not isinstance(adapt, _AbsMax):
        raise TypeError(
            f"{name}(adapt=...) takes avionics.quantities.GradAbsMax(...) or "
            f"ParamAbsMax(...) or None, got {adapt!r}."
        )
    return adapt


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
    """Histogram of all per-sample gradient elements g_{n,d}.

    Args:
        schedule: the steps to track (default every step).
        bins: number of bins (default 100).
        range: (lower, upper) limits (default (-2, 2)); values outside are clamped.
        adapt: None, or ``GradAbsMax(padding, min_size)`` / ``ParamAbsMax(...)``.

    Value: ``{"hist": counts [bins], "edges": [bins + 1 edges]}``.
    """

    output = HISTOGRAM_1D

    def __init__(self, schedule=None, bins: int = 100, range=(-2.0, 2.0), adapt=None):
        super().__init__(schedule)
        self.bins, self.range = _checked_range(self.name, bins, range)
        self.adapt = _checked_adapt(self.name, adapt)
        self._counts: Tensor | None = None
        self._max: Tensor | float | None = None

    def _begin(self, data: StepData) -> None:
        self._counts, self._max, self._step_range = None, None, self.range

    def _visit(self, k: int, chunk: Tensor | OuterProducts) -> None:
        if self._counts is None:
            self._counts = torch.zeros(self.bins, dtype=torch.int64, device=chunk.device)
        count_1d(chunk, *self._step_range, self._counts)
        if self.adapt is not None and self.adapt.source == "grad":
            self._max = _larger(self._max, _chunk_abs_max(chunk))

    def compute(self, data: StepData):
        if self._counts is None:  # no tracked parameter had any element
            self._counts = torch.zeros(self.bins, dtype=torch.int64)
        value = {"hist": self._counts, "edges": _edges(self.bins, self._step_range)}
        if self.adapt is not None:
            self.range = self.adapt.limits(_source_max(self.adapt, self._max, data))
        self._counts, self._max = None, None
        return {data.step: value}


class GradHist2d(_Histogram):
    """Joint histogram of (g_{n,d}, theta_d) over all samples n and coordinates d.

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
        if len(bins) != 2 or len(range) != 2 or len(adapt) != 2:
            raise ValueError(
                f"{self.name} takes bins, range and adapt as pairs (gradient axis, parameter "
                f"axis); got bins={bins!r}, range={range!r}, adapt={adapt!r}."
            )
        checked = [_checked_range(self.name, b, r) for b, r in zip(bins, range, strict=True)]
        self.bins = tuple(b for b, _ in checked)
        self.range = [r for _, r in checked]
        self.adapt = [_checked_adapt(self.name, a) for a in adapt]
        self.per_parameter = bool(per_parameter)
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

    def compute(self, data: StepData):
        xbins, ybins = self.bins
        per_param = [
            c.reshape(ybins, xbins).t() if c is not None
            else torch.zeros(xbins, ybins, dtype=torch.int64)
            for c in self._counts
        ]  # fmt: skip
        total = per_param[0].clone()
        for c in per_param[1:]:
            total = total + c.to(total.device)
        edges = [_edges(b, r) for b, r in zip(self.bins, self._step_range, strict=True)]
        value = {"hist": total, "edges": edges}
        if self.per_parameter:
            value["param_hist"] = per_param
        for axis, adapt in enumerate(self.adapt):
            if adapt is not None:
                self.range[axis] = adapt.limits(_source_max(adapt, self._max, data))
        self._counts, self._max, self._params, self._offsets = [], None, None, {}
        return {data.step: value}


def _source_max(adapt: _AbsMax, grad_max: float | None, data: StepData) -> float:
    if adapt.source == "grad":
        return float(grad_max) if grad_max is not None else 0.0
    return max((float(_abs_max(p)) for p in data.params if p.numel()), default=0.0)
