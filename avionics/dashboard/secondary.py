"""The secondary screen: what the primary one shows only as global values, read per layer,
and the instruments that no preset contains.

* PER LAYER: a layers x steps heat-map (:mod:`avionics.dashboard.heatmap`) of GradNorm and
  UpdateSize (in every preset) and of every other quantity with one number per parameter
  (Distance, HessTrace, the quantities read with ``per_layer=True``, your own);
* AUXILIARY: MeanGSNR, CABS, EarlyStopping and the gradient noise scale vs step, those the
  run recorded;
* PER PARAMETER: the 2d gradient/parameter histogram of every parameter, when GradHist2d kept
  them;
* YOUR INSTRUMENTS: a generic panel of each of your own quantities
  (:mod:`avionics.dashboard.generic`).

What the run lacks is listed on one panel, "Not recorded", with the quantity that adds it, so
that the screen is never blank for a preset.
"""

from __future__ import annotations

import math
import os
import textwrap

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from avionics.dashboard.generic import generic_panel, own_quantities
from avionics.dashboard.gradients import hist2d_panel
from avionics.dashboard.heatmap import heatmap_panel, layers
from avionics.dashboard.style import (
    BLUE,
    FORMATS,
    GREEN,
    GREY,
    ORANGE,
    STEP,
    TITLE,
    empty_panel,
    group_frame,
    save,
    series_plot,
    short_labels,
    style_panel,
)
from avionics.diagnosis.evidence import batch_size
from avionics.records.reader import as_run
from avionics.records.series import latest, layered_names, parameter_histograms, series

# the heat-maps drawn for every run (both quantities are in every preset)
HEATMAPS = (
    ("GradNorm", "Gradient norm"),
    ("UpdateSize", "Update size"),
)
SERIES = (
    ("MeanGSNR", "Mean gradient signal-to-noise ratio", "mean GSNR"),
    ("CABS", "CABS batch-size suggestion", "suggested batch size"),
    ("EarlyStopping", "Early-stopping criterion", "criterion (stop when > 0)"),
)
NOISE_SCALE = "GradientNoiseScale"
# what adds each instrument of the screen that a run may lack
TO_ADD = {
    "MeanGSNR": "quantities.MeanGSNR()",
    "CABS": "quantities.CABS() (plain SGD only)",
    "EarlyStopping": "quantities.EarlyStopping() (plain SGD only)",
    NOISE_SCALE: "quantities.GradientNoiseScale()",
    "per-parameter histograms": "quantities.GradHist2d(per_parameter=True)",
    "per-layer gradient tests": "quantities.NormTest(per_layer=True) (also InnerTest, ...)",
}
NOT_RECORDED = "Not recorded"
LINE_WIDTH = 70  # characters per line of its list
HEATMAP_COLUMNS = 2
COLUMNS = 4
WIDTH = 24  # inches


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
    steps, values = series(run, NOISE_SCALE)
    if len(steps) == 0:
        return empty_panel(ax, title, STEP, ylabel, NOISE_SCALE)
    style_panel(ax, title, STEP, ylabel)
    series_plot(ax, steps, values, "smoothed noise scale", smooth=False, yscale="log")
    size = batch_size(run)
    if size:
        ax.axhline(size, color=GREY, lw=1.5, ls="--", label=f"batch size ({size})")
    ax.legend(loc="best", fontsize="small")
    return ax


def missing(run, histograms: list) -> list[str]:
    """What of this screen the run lacks, as keys of :data:`TO_ADD`."""
    absent = [name for name, _, _ in SERIES if not len(series(run, name)[0])]
    if not len(series(run, NOISE_SCALE)[0]):
        absent.append(NOISE_SCALE)
    if not histograms:
        absent.append("per-parameter histograms")
    if not any(run.output(name).kind == "per_layer" for name in layered_names(run)):
        absent.append("per-layer gradient tests")
    return absent


def not_recorded_panel(fig, spec, absent: list[str]) -> Axes:
    """A panel that lists what the run lacks and the quantity to add for each."""
    ax = fig.add_subplot(spec)
    ax.set_title(NOT_RECORDED, **TITLE)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_facecolor("#f4f4f4")
    lines = [
        textwrap.fill(f"{what}: {TO_ADD[what]}", LINE_WIDTH, subsequent_indent="    ")
        for what in absent
    ]
    text = "\n".join(
        [
            "To draw them, add to the cockpit's quantities",
            "(from avionics import quantities):",
            "",
            *lines,
        ]
    )
    ax.text(0.04, 0.95, text, transform=ax.transAxes, va="top")
    return ax


def _cells(spec, rows: int, columns: int, height: float = 0.12, hspace: float = 0.45) -> list:
    """The cells of a rows x columns grid inside a group's frame, row by row (``height``:
    the margin above and below, relative to a row; ``hspace``: the space between rows)."""
    grid = spec.subgridspec(
        rows + 2,
        columns + 2,
        height_ratios=[height] + [1] * rows + [height],
        width_ratios=[0.03] + [1] * columns + [0.03],
        hspace=hspace,
        wspace=0.3,
    )
    return [grid[1 + r, 1 + c] for r in range(rows) for c in range(columns)]


def heatmap_height(run, names: list[str]) -> float:
    """Inches per row of heat-maps: room for the most layers any of them has (capped)."""
    counts = [len(layers(run, name)[0].labels) for name in names]
    return min(14.0, max(4.0, 2.0 + 0.16 * max(counts)))


def plot_secondary(source, path: str | os.PathLike | None = None) -> Figure:
    """Draw the secondary screen of ``source`` (run log path, Run or Cockpit) and save it to
    ``path`` (.png, .pdf or .svg) if given: see the module docstring."""
    run = as_run(source)
    if path is not None and os.path.splitext(str(path))[1].lower() not in FORMATS:
        save(Figure(), path)  # raises the error that says which suffixes work
    heatmaps = list(HEATMAPS) + [
        (name, None) for name in layered_names(run) if name not in dict(HEATMAPS)
    ]
    present = [s for s in SERIES if len(series(run, s[0])[0])]
    noise = len(series(run, NOISE_SCALE)[0]) > 0
    step, hist2d = latest(run, "GradHist2d")
    histograms = parameter_histograms(hist2d) if isinstance(hist2d, dict) else []
    absent = missing(run, histograms)
    own = own_quantities(run)

    heat_rows = math.ceil(len(heatmaps) / HEATMAP_COLUMNS)
    hist_columns = max(COLUMNS, math.ceil(math.sqrt(len(histograms))))
    hist_rows = math.ceil(len(histograms) / hist_columns)
    own_rows = math.ceil(len(own) / COLUMNS)
    # (group, inches) from top to bottom; the groups a run has nothing for are left out
    groups = [
        ("PER LAYER", heat_rows * heatmap_height(run, [n for n, _ in heatmaps])),
        ("AUXILIARY", 5.0),
    ]
    if histograms:
        groups.append(("PER PARAMETER", 5.0 * hist_rows))
    if own:
        groups.append(("YOUR INSTRUMENTS", 5.0 * own_rows))
    width = max(WIDTH, 6 * hist_columns)
    fig = Figure(figsize=(width, sum(h for _, h in groups) + 1.5))
    outer = fig.add_gridspec(
        len(groups),
        1,
        height_ratios=[h for _, h in groups],
        hspace=0.08,
        left=0.03,
        right=0.97,
        top=1 - 0.9 / fig.get_figheight(),
        bottom=0.3 / fig.get_figheight(),
    )
    spec = dict(zip([g for g, _ in groups], outer))

    group_frame(fig, spec["PER LAYER"], "PER LAYER", GREEN)
    cells = _cells(spec["PER LAYER"], heat_rows, HEATMAP_COLUMNS, 0.3 / heat_rows, hspace=0.8)
    for cell, (name, label) in zip(cells, heatmaps):
        heatmap_panel(fig, cell, run, name, label)
    group_frame(fig, spec["AUXILIARY"], "AUXILIARY", BLUE)
    slots = len(present) + noise + bool(absent)
    cells = iter(_cells(spec["AUXILIARY"], 1, max(slots, 2), height=0.2))
    for name, title, ylabel in present:
        series_panel(fig, next(cells), run, name, title, ylabel)
    if noise:
        noise_scale_panel(fig, next(cells), run)
    if absent:
        not_recorded_panel(fig, next(cells), absent)
    if histograms:
        group_frame(fig, spec["PER PARAMETER"], "PER PARAMETER", ORANGE)
        names = short_labels(run.parameter_names)
        for i, (cell, value) in enumerate(
            zip(_cells(spec["PER PARAMETER"], hist_rows, hist_columns), histograms)
        ):
            name = names[i] if i < len(names) else f"parameter {i}"
            hist2d_panel(fig, cell, value, f"{name} (step {step})")
    if own:
        group_frame(fig, spec["YOUR INSTRUMENTS"], "YOUR INSTRUMENTS", BLUE)
        for cell, name in zip(_cells(spec["YOUR INSTRUMENTS"], own_rows, COLUMNS), own):
            generic_panel(fig, cell, run, name)
    fig.suptitle("Cockpit: secondary screen", fontsize="xx-large", fontweight="bold")
    if path is not None:
        save(fig, path)
    return fig
