"""The layer-health panels: update-to-weight ratios against their usual range, and the dead
and saturated units, mean and RMS of each activation module (ActivationHealth), and a screen
of them (:func:`plot_health`).

* UpdateRatio: every weight's ||theta_{t+1} - theta_t|| / ||theta_t|| vs step (log), the
  global ratio as a thick line, the usual range 1e-4 to 1e-2 (a heuristic, see
  :mod:`avionics.diagnosis.layers`) as a band;
* dead and saturated fractions: a modules x steps heat-map on a linear 0 to 1 scale (a
  fraction is not a magnitude; 0 is healthy);
* RMS of the activations: one line per module vs step (log).
"""

from __future__ import annotations

import os
from functools import partial

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from avionics.dashboard.heatmap import NON_FINITE, label_rows, step_edges
from avionics.dashboard.style import (
    FORMATS,
    GREEN,
    STEP,
    TITLE,
    empty_panel,
    group_frame,
    save,
    short_labels,
    style_panel,
)
from avionics.diagnosis.layers import RATIO_RANGE
from avionics.records.reader import as_run
from avionics.records.series import LayerSeries, parameter_series, series

HEALTH = "ActivationHealth"
FRACTIONS = (("dead", "Dead units"), ("saturated", "Saturated values"))


def activation_layers(run, key: str) -> LayerSeries:
    """ActivationHealth's ``key`` ("dead", "saturated", "mean" or "rms") of every module
    that has it at one step at least (in the order they first appear) at every step with an
    ActivationHealth value; nan where a module lacks it."""
    rows = [(s, v[HEALTH]) for s, v in run.steps.items() if isinstance(v.get(HEALTH), dict)]
    labels: list[str] = []
    for _, value in rows:
        labels += [m for m, stats in value.items() if key in stats and m not in labels]
    values = np.full((len(labels), len(rows)), np.nan)
    for j, (_, value) in enumerate(rows):
        for i, module in enumerate(labels):
            number = value.get(module, {}).get(key)
            if isinstance(number, (int, float)):
                values[i, j] = number
    steps = np.array([s for s, _ in rows], dtype=np.int64)
    return LayerSeries([m or "(model)" for m in labels], steps, values)


def fraction_panel(fig, spec, run, key: str, title: str) -> Axes:
    """ActivationHealth's ``key`` fraction of every module vs step, as a heat-map from 0
    (healthy) to 1, the first module on top."""
    ax = fig.add_subplot(spec)
    grid = activation_layers(run, key)
    if not grid.labels:
        return _no_fractions(ax, run, key, title)
    mesh = ax.pcolormesh(
        step_edges(grid.steps),
        np.arange(len(grid.labels) + 1),
        np.ma.masked_invalid(grid.values),
        norm=Normalize(0, 1),
        cmap=colormaps["magma_r"].with_extremes(bad=NON_FINITE),
    )
    ax.set_ylim(len(grid.labels), 0)
    rows = label_rows(len(grid.labels))
    labels = short_labels(grid.labels)
    ax.set_yticks([r + 0.5 for r in rows], [labels[r] for r in rows], fontsize="small")
    ax.set_title(f"{title} per module", **TITLE)
    ax.set_xlabel(STEP)
    ax.set_ylabel("module")
    fig.colorbar(mesh, ax=ax, label=f"{key} fraction", pad=0.01)
    return ax


def _no_fractions(ax: Axes, run, key: str, title: str) -> Axes:
    """A fraction panel without data: ActivationHealth not recorded (what it needs), or
    recorded on activations that have no such fraction (why: only saturating activations,
    tanh, sigmoid and the like, have saturated values)."""
    watched = activation_layers(run, "rms").labels
    if not watched:
        return empty_panel(ax, title, STEP, "module", f"{HEALTH}()")
    empty_panel(ax, title, STEP, "module", HEALTH)
    kinds = "tanh, sigmoid, hardtanh, ..." if key == "saturated" else "ReLU-like ones"
    ax.texts[-1].set_text(
        f"no {key} fraction: none of\nthe {len(watched)} watched activations\nhas one "
        f"(only {kinds})"
    )
    return ax


def rms_panel(fig, spec, run) -> Axes:
    """The RMS of every activation module's output vs step, one line each (log scale)."""
    ax = fig.add_subplot(spec)
    title, ylabel = "Activation RMS", r"$\sqrt{\mathrm{mean}\, y^2}$"
    grid = activation_layers(run, "rms")
    if not grid.labels:
        return empty_panel(ax, title, STEP, ylabel, f"{HEALTH}()")
    style_panel(ax, title, STEP, ylabel)
    for label, values in zip(short_labels(grid.labels), grid.values):
        ax.plot(grid.steps, values, lw=1.4, label=label)
    if (grid.values > 0).any():
        ax.set_yscale("log")
    ax.legend(loc="best", fontsize="x-small", ncol=2)
    return ax


def update_ratio_panel(fig, spec, run) -> Axes:
    """Every weight's UpdateRatio vs step (thin lines; biases too when the log does not name
    the parameters' shapes), the global ratio (thick), and the usual range as a band."""
    ax = fig.add_subplot(spec)
    title, ylabel = "Update-to-weight ratio", r"$\|\Delta\theta\| / \|\theta\|$"
    # (records.series.parameter_series cannot read a run without the quantity yet)
    recorded = any("UpdateRatio" in values for values in run.steps.values())
    layers = parameter_series(run, "UpdateRatio") if recorded else None
    if layers is None or not layers.labels:
        return empty_panel(ax, title, STEP, ylabel, "UpdateRatio()")
    style_panel(ax, title, STEP, ylabel)
    shapes = run.metadata.get("parameters")
    for i, (name, label) in enumerate(zip(layers.labels, short_labels(layers.labels))):
        shape = shapes.get(name) if isinstance(shapes, dict) else None
        if shape is None or len(shape) >= 2:
            ax.plot(layers.steps, layers.values[i], lw=1, alpha=0.7, label=label)
    steps, total = series(run, "UpdateRatio")
    ax.plot(steps, total, color="black", lw=2.5, label="global")
    ax.axhspan(*RATIO_RANGE, color=GREEN, alpha=0.15, label="usual range (heuristic)")
    ax.set_yscale("log")
    ax.legend(loc="best", fontsize="x-small", ncol=2)
    return ax


PANELS = (
    update_ratio_panel,
    *(partial(fraction_panel, key=key, title=title) for key, title in FRACTIONS),
    rms_panel,
)


def plot_health(source, path: str | os.PathLike | None = None) -> Figure:
    """Draw the layer-health screen of ``source`` (run log path, Run or Cockpit): the four
    panels of this module in a row, and save it to ``path`` (.png, .pdf or .svg) if given.
    A panel without data is drawn empty and names the quantity it needs."""
    run = as_run(source)
    if path is not None and os.path.splitext(str(path))[1].lower() not in FORMATS:
        save(Figure(), path)  # raises the error that says which suffixes work
    fig = Figure(figsize=(26, 7))
    outer = fig.add_gridspec(1, 1, left=0.02, right=0.98, top=0.86, bottom=0.04)
    group_frame(fig, outer[0], "LAYER HEALTH", GREEN)
    cells = outer[0].subgridspec(
        3,
        len(PANELS) + 2,
        height_ratios=[0.12, 1, 0.16],
        width_ratios=[0.02] + [1] * len(PANELS) + [0.02],
        wspace=0.75,  # (room for module names of LABEL_WIDTH characters beside a panel)
    )
    for column, panel in enumerate(PANELS):
        panel(fig, cells[1, column + 1], run)
    fig.suptitle("Cockpit: layer health", fontsize="xx-large", fontweight="bold")
    if path is not None:
        save(fig, path)
    return fig
