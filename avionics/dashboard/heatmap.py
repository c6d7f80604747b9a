"""The layers x steps heat-map of a per-parameter quantity: one row per module (or tracked
parameter), one column per step, the value as a colour on a log scale.

A quantity that reduces over parameters (GradNorm and UpdateSize: the RSS of norms; HessTrace:
the sum of traces) is drawn per module, its parameters grouped as
:func:`~avionics.records.series.per_module` does; a per-layer ratio (``NormTest(per_layer=True)``
and the like) and a log that does not name its parameters are drawn per parameter. The colour
is logarithmic (:class:`~matplotlib.colors.LogNorm`); where values are negative too, symmetric
logarithmic about 0 (:class:`~matplotlib.colors.SymLogNorm`, linear within the smallest
|value|). Non-finite values are grey. With many layers only every k-th is labelled, so that at
most :data:`MAX_LABELS` names share the axis.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm, Normalize, SymLogNorm
from matplotlib.ticker import MaxNLocator

from avionics.dashboard.style import STEP, TITLE, empty_panel, short_labels
from avionics.records.series import LayerSeries, parameter_series, per_module

MAX_LABELS = 30
NON_FINITE = "#b0b0b0"


def layers(run, name: str) -> tuple[LayerSeries, str]:
    """(``name`` per module, "module") where its parameters group into modules (a reduction
    and the parameters' names in the log), else (per parameter, "parameter")."""
    parameters = parameter_series(run, name)
    named = len(parameters.labels) == len(run.parameter_names) > 0
    if named and run.output(name).reduce is not None:
        return per_module(run, name), "module"
    return parameters, "parameter"


def step_edges(steps: np.ndarray) -> np.ndarray:
    """The column edges of sorted steps: half-way between neighbours, half a gap (at least
    half a step) beyond the first and last, so that irregular schedules draw to scale."""
    steps = steps.astype(np.float64)
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    middle = (steps[1:] + steps[:-1]) / 2
    return np.concatenate(
        [[steps[0] - (middle[0] - steps[0])], middle, [steps[-1] + (steps[-1] - middle[-1])]]
    )


def color_norm(values: np.ndarray) -> Normalize:
    """Log colour over the finite values: LogNorm for positive values (zeros are drawn at its
    lowest colour), SymLogNorm when some are negative."""
    finite = values[np.isfinite(values)]
    nonzero = np.abs(finite[finite != 0])
    if not len(nonzero):
        return Normalize(0, 1)
    low, high = nonzero.min(), nonzero.max()
    if high == low:
        low, high = low / math.sqrt(10), high * math.sqrt(10)
    if (finite < 0).any():
        return SymLogNorm(linthresh=low, vmin=-high, vmax=high, base=10)
    return LogNorm(vmin=low, vmax=high, clip=True)


def label_rows(count: int, most: int = MAX_LABELS) -> list[int]:
    """The rows that get a label: every ceil(count / most)-th, from the first."""
    return list(range(0, count, max(1, math.ceil(count / most))))


def heatmap_panel(fig, spec, run, name: str, label: str | None = None) -> Axes:
    """``name`` of every module (or parameter) vs step, as a log-coloured heat-map with a
    colour bar, titled "<label, or name> per module" (or "per parameter"); the first layer on
    top. Without per-parameter values of ``name``, an empty panel that names it."""
    ax = fig.add_subplot(spec)
    grid, by = layers(run, name)
    title = f"{label or name} per {by}"
    if not grid.labels or not len(grid.steps):
        return empty_panel(ax, title, STEP, "module", name)
    norm = color_norm(grid.values)
    palette = "RdBu_r" if isinstance(norm, SymLogNorm) else "viridis"
    values = grid.values.copy()
    if isinstance(norm, LogNorm):  # zeros have no logarithm: drawn as the smallest value
        values[values <= 0] = norm.vmin
    mesh = ax.pcolormesh(
        step_edges(grid.steps),
        np.arange(len(grid.labels) + 1),
        np.ma.masked_invalid(values),
        norm=norm,
        cmap=colormaps[palette].with_extremes(bad=NON_FINITE),
    )
    ax.set_ylim(len(grid.labels), 0)  # the first layer (nearest the input) on top
    rows = label_rows(len(grid.labels))
    size = "small" if len(grid.labels) <= MAX_LABELS else "x-small"
    labels = short_labels(grid.labels)
    ax.set_yticks([r + 0.5 for r in rows], [labels[r] for r in rows], fontsize=size)
    ax.set_title(title, **TITLE)
    ax.set_xlabel(STEP)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(by)
    fig.colorbar(mesh, ax=ax, label=f"{name} (log scale)", pad=0.01)
    return ax
