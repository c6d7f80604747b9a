"""The secondary screen: MeanGSNR, CABS, EarlyStopping and the gradient noise scale vs step,
the 2d gradient/parameter histogram of every parameter, and a generic panel for each of your
own quantities (:mod:`avionics.dashboard.generic`)."""

from __future__ import annotations

import math
import os

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from avionics.dashboard.figure import FORMATS, group_frame, save
from avionics.dashboard.generic import generic_panel, own_quantities
from avionics.dashboard.gradients import hist2d_panel
from avionics.dashboard.style import (
    BLUE,
    GREY,
    ORANGE,
    STEP,
    empty_panel,
    series_plot,
    style_panel,
)
from avionics.diagnosis.evidence import batch_size
from avionics.records.reader import as_run
from avionics.records.series import latest, parameter_histograms, series

SERIES = (
    ("MeanGSNR", "Mean gradient signal-to-noise ratio", "mean GSNR"),
    ("CABS", "CABS batch-size suggestion", "suggested batch size"),
    ("EarlyStopping", "Early-stopping criterion", "criterion (stop when > 0)"),
)


def series_panel(fig, spec, run, name: str, title: str, ylabel: str) -> Axes:
    """One scalar quantity vs step with its EMA."""
    ax = fig.add_subplot(spec)
    steps, values = series(run, name)
    if len(steps) == 0:
        return empty_panel(ax, title, "step", ylabel, name)
    style_panel(ax, title, "step", ylabel)
    series_plot(ax, steps, values, name)
    if name == "EarlyStopping":
        ax.axhline(0, color="red", lw=1, ls="--", label="stop above this line")
    ax.legend(loc="best", fontsize="small")
    return ax


def noise_scale_panel(fig, spec, run) -> Axes:
    """The smoothed gradient noise scale B_simple (GradientNoiseScale, the critical batch size
    of McCandlish et al. 2018) vs step on a log scale (symlog where a value is not positive),
    with the batch size in use as a dashed line when the run records it."""
    ax = fig.add_subplot(spec)
    title, ylabel = "Gradient noise scale", r"smoothed $B_{\mathrm{simple}}$"
    steps, values = series(run, "GradientNoiseScale")
    if len(steps) == 0:
        return empty_panel(ax, title, STEP, ylabel, "GradientNoiseScale")
    style_panel(ax, title, STEP, ylabel)
    series_plot(ax, steps, values, "smoothed noise scale", smooth=False, yscale="log")
    size = batch_size(run)
    if size:
        ax.axhline(size, color=GREY, lw=1.5, ls="--", label=f"batch size ({size})")
    ax.legend(loc="best", fontsize="small")
    return ax


def _cells(spec, rows: int, columns: int) -> list:
    """The cells of a rows x columns grid inside a group's frame, row by row."""
    grid = spec.subgridspec(
        rows + 2,
        columns + 2,
        height_ratios=[0.12] + [1] * rows + [0.12],
        width_ratios=[0.03] + [1] * columns + [0.03],
        hspace=0.45,
        wspace=0.3,
    )
    return [grid[1 + r, 1 + c] for r in range(rows) for c in range(columns)]


def plot_secondary(source, path: str | os.PathLike | None = None) -> Figure:
    """Draw the secondary screen of ``source`` (run log path, Run or Cockpit) and save it to
    ``path`` (.png, .pdf or .svg) if given. The per-parameter histograms need GradHist2d
    with per-parameter histograms switched on; without them the panel says so."""
    run = as_run(source)
    if path is not None and os.path.splitext(str(path))[1].lower() not in FORMATS:
        save(Figure(), path)  # raises the error that says which suffixes work
    step, hist2d = latest(run, "GradHist2d")
    per_parameter = parameter_histograms(hist2d) if isinstance(hist2d, dict) else []
    columns = max(3, math.ceil(math.sqrt(len(per_parameter))))
    rows = max(1, math.ceil(len(per_parameter) / columns))
    own = own_quantities(run)
    own_rows = math.ceil(len(own) / columns)
    fig = Figure(figsize=(6 * columns, 5 + 5 * rows + 5 * own_rows))
    outer = fig.add_gridspec(
        2 + (own_rows > 0),
        1,
        height_ratios=[1, 1.3 * rows] + ([1.2 * own_rows] if own_rows else []),
        hspace=0.12,
        left=0.03,
        right=0.97,
        top=0.92,
        bottom=0.02,
    )
    group_frame(fig, outer[0], "AUXILIARY", BLUE)
    top = outer[0].subgridspec(
        3, 6, height_ratios=[0.15, 1, 0.25], width_ratios=[0.02, 1, 1, 1, 1, 0.02], wspace=0.3
    )
    for column, (name, title, ylabel) in enumerate(SERIES):
        series_panel(fig, top[1, column + 1], run, name, title, ylabel)
    noise_scale_panel(fig, top[1, len(SERIES) + 1], run)

    group_frame(fig, outer[1], "PER PARAMETER", ORANGE)
    if not per_parameter:
        inner = outer[1].subgridspec(3, 3, height_ratios=[0.15, 1, 0.2])
        empty_panel(
            fig.add_subplot(inner[1, 1]),
            "Gradient/parameter histogram per parameter",
            r"parameter $\theta_d$",
            r"gradient element $g_{n,d}$",
            "GradHist2d with per-parameter histograms",
        )
    else:
        names = run.parameter_names
        for i, (cell, value) in enumerate(zip(_cells(outer[1], rows, columns), per_parameter)):
            name = names[i] if i < len(names) else f"parameter {i}"
            hist2d_panel(fig, cell, value, f"{name} (step {step})")
    if own:
        group_frame(fig, outer[2], "YOUR INSTRUMENTS", BLUE)
        for cell, name in zip(_cells(outer[2], own_rows, columns), own):
            generic_panel(fig, cell, run, name)
    fig.suptitle("Cockpit: secondary screen", fontsize="xx-large", fontweight="bold")
    if path is not None:
        save(fig, path)
    return fig
