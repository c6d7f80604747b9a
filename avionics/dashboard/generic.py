"""Panels for the quantities that have no panel of their own (your own instruments), drawn
from the output each declares (:mod:`avionics.quantities.outputs`): a scalar, per-parameter or
per-layer value as its global value vs step with its EMA (the secondary screen also draws a
per-parameter one as a heat-map, :mod:`avionics.dashboard.heatmap`), a 1d histogram as bars
of the latest step, a 2d histogram as the joint histogram with its marginals."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes

from avionics.dashboard.gradients import hist2d_panel
from avionics.dashboard.style import BLUE, empty_panel, series_plot, style_panel
from avionics.records.outputs import BUILTIN_OUTPUTS
from avionics.records.series import latest, series


def own_quantities(run) -> list[str]:
    """The quantities the run's metadata declares that are not built in, in its order."""
    return [name for name in run.outputs if name not in BUILTIN_OUTPUTS]


def generic_panel(fig, spec, run, name: str) -> Axes:
    """Quantity ``name`` as its declared output reads."""
    output = run.output(name)
    if output.kind == "histogram_2d":
        step, value = latest(run, name)
        return hist2d_panel(fig, spec, value, f"{name} (step {step})")
    ax = fig.add_subplot(spec)
    if output.kind == "histogram_1d":
        step, value = latest(run, name)
        if not isinstance(value, dict):
            return empty_panel(ax, name, "value", "count", name)
        counts = np.asarray(value["hist"], dtype=float)
        edges = np.asarray(value["edges"], dtype=float)
        ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color=BLUE)
        style_panel(ax, f"{name} (step {step})", "value", "count")
        return ax
    steps, values = series(run, name)
    ylabel = {
        "per_parameter": f"{name} ({output.reduce} over parameters)",
        "per_layer": f"{name} (all parameters)",
    }.get(output.kind, name)
    if len(steps) == 0:
        return empty_panel(ax, name, "step", ylabel, name)
    style_panel(ax, name, "step", ylabel)
    series_plot(ax, steps, values, name)
    ax.legend(loc="best", fontsize="small")
    return ax
