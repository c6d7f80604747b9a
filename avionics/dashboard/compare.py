"""Several runs' instruments overlaid in one figure: the sweep a team runs.

Each run is one colour, labelled by its name (the run directory's, as the dashboard's title
names it; parent folders are added where two runs share a name). Every scalar series that
a run recorded and that overlays on one step axis is a panel, in the dashboard's groups:

* STEP SIZE: Loss, the learning rate, Alpha, Distance, UpdateSize, UpdateRatio;
* GRADIENTS: GradNorm, the gradient tests, the noise scales, GSNR, ...;
* CURVATURE: HessMaxEV, PreconditionedSharpness, HessTrace, TICDiag, TICTrace;
* PERFORMANCE: the logged losses and accuracies, the wall-clock time since the first step;
* then every other scalar any run recorded (an instrument of your own, a metric you logged).

A panel, its group named at its top left, draws each run's values as faint points and their
EMA (:func:`~avionics.dashboard.style.ema`) as a line (a series of few points, as its points
joined), on a log axis where all values are positive and span more than three decades, and
names the runs that did not record it. The distributions (the alpha histogram, the gradient
histograms) do not overlay and are left to each run's dashboard. Panels no run recorded are
not drawn.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator

from avionics.dashboard.style import (
    FORMATS,
    STEP,
    ema,
    save,
    step_limits,
    style_panel,
)
from avionics.records.reader import as_run
from avionics.records.series import scalar_names, series

PERFORMANCE = "PERFORMANCE"
OTHER = "YOURS"  # an instrument of your own, a metric you logged
# (group, quantity, title, y label) of the panels in the order drawn
PANELS = (
    ("STEP SIZE", "Loss", "Mini-batch loss", "loss"),
    ("STEP SIZE", "learning_rate", "Learning rate", "learning rate"),
    ("STEP SIZE", "Alpha", "Alpha", r"local step length $\alpha$"),
    ("STEP SIZE", "Distance", "Distance from the start", r"$\|\theta_t - \theta_0\|$"),
    ("STEP SIZE", "UpdateSize", "Update size", r"$\|\theta_{t+1} - \theta_t\|$"),
    ("STEP SIZE", "UpdateRatio", "Update ratio", r"$\|\Delta\theta\| / \|\theta_t\|$"),
    ("GRADIENTS", "GradNorm", "Gradient norm", r"$\|g\|$"),
    ("GRADIENTS", "NormTest", "Norm test", "norm test"),
    ("GRADIENTS", "InnerTest", "Inner product test", "inner product test"),
    ("GRADIENTS", "OrthoTest", "Orthogonality test", "orthogonality test"),
    ("GRADIENTS", "GradientNoiseScale", "Gradient noise scale", r"$B_{\mathrm{noise}}$"),
    ("GRADIENTS", "SimpleNoiseScale", "Simple noise scale", r"$B_{\mathrm{simple}}$"),
    ("GRADIENTS", "MeanGSNR", "Mean GSNR", "GSNR"),
    ("GRADIENTS", "GradCovTrace", "Gradient covariance trace", r"tr$(\Sigma)$"),
    ("GRADIENTS", "TrueGradSqNorm", "Squared true gradient norm", r"$\|\nabla L\|^2$"),
    ("GRADIENTS", "CABS", "CABS batch size", "batch size"),
    ("GRADIENTS", "EarlyStopping", "Early stopping criterion", "criterion"),
    ("CURVATURE", "HessMaxEV", "Largest Hessian eigenvalue", r"$\lambda_{\max}(H)$"),
    ("CURVATURE", "PreconditionedSharpness", "Preconditioned sharpness", r"$\lambda_{\max}$"),
    ("CURVATURE", "HessTrace", "Hessian trace", r"tr$(H)$"),
    ("CURVATURE", "TICDiag", "TIC (diagonal)", "TICDiag"),
    ("CURVATURE", "TICTrace", "TIC (trace)", "TICTrace"),
    (PERFORMANCE, "train_loss", "Training loss", "loss"),
    (PERFORMANCE, "valid_loss", "Validation loss", "loss"),
    (PERFORMANCE, "test_loss", "Test loss", "loss"),
    (PERFORMANCE, "train_accuracy", "Training accuracy", "accuracy"),
    (PERFORMANCE, "valid_accuracy", "Validation accuracy", "accuracy"),
    (PERFORMANCE, "test_accuracy", "Test accuracy", "accuracy"),
    (PERFORMANCE, "Time", "Time since the first step", "seconds"),
)
# wall-clock times (seconds since the epoch), drawn from each run's first
SINCE_FIRST = ("Time",)
NOT_DRAWN = ("epoch",)  # bookkeeping that cockpit.log records beside the metrics
COLUMNS = 3
SMOOTHED_FROM = 20  # points of a series drawn with its EMA
PANEL_SIZE = (6.4, 3.9)  # inches


def run_labels(runs) -> list[str]:
    """Each run's name: its directory's (a ``log.jsonl``'s folder) or its log file's stem;
    where names repeat, the path from the runs' common folder; "run <i>" for a run in
    memory."""
    paths = [
        (run.path.parent if run.path.name == "log.jsonl" else run.path.with_suffix(""))
        if run.path
        else None
        for run in runs
    ]
    labels = [p.name if p else f"run {i + 1}" for i, p in enumerate(paths)]
    if len(set(labels)) < len(labels) and all(paths):
        common = Path(os.path.commonpath([p.absolute() for p in paths]))
        labels = [str(p.absolute().relative_to(common)) or p.name for p in paths]
    return labels


def run_colors(count: int) -> list:
    """``count`` colours told apart: tab10's, tab20's for up to 20 runs, else evenly spaced
    along viridis."""
    if count <= 20:
        name = "tab10" if count <= 10 else "tab20"
        return [colormaps[name](i) for i in range(count)]
    return [colormaps["viridis"](i / (count - 1)) for i in range(count)]


def compare_panels(runs) -> list[tuple[str, str, str, str]]:
    """The (group, quantity, title, y label) of every panel some run can draw: those of
    :data:`PANELS` in order, then the other scalar series, by name."""
    recorded = set().union(*(scalar_names(run) for run in runs)) - set(NOT_DRAWN)
    known = [panel for panel in PANELS if panel[1] in recorded]
    named = {panel[1] for panel in PANELS}
    others = [(OTHER, name, name, name) for name in sorted(recorded - named)]
    return known + others


def _check_runs(runs) -> None:
    """At least two runs, each given once."""
    if len(runs) < 2:
        raise ValueError(
            f"compare needs two runs or more, got {len(runs)}: pass each run of the sweep "
            "(or use plot for one run)."
        )
    paths = [run.path.resolve() for run in runs if run.path]
    if len(set(paths)) < len(paths):
        twice = next(p for p in paths if paths.count(p) > 1)
        raise ValueError(f"the run {twice} is given twice: pass each run once.")


def _check_common(runs, labels) -> None:
    """Two runs at least that recorded a scalar series in common."""
    names = [set(scalar_names(run)) for run in runs]
    if not any(a & b for i, a in enumerate(names) for b in names[i + 1 :]):
        recorded = "; ".join(
            f"{label}: {', '.join(sorted(n)) or 'nothing'}" for label, n in zip(labels, names)
        )
        raise ValueError(
            f"the runs have no series in common, so nothing overlays ({recorded}). Compare "
            "runs that recorded a quantity in common (the same preset, say)."
        )


def _draw(ax, drawn: list) -> None:
    """Each (steps, values, colour) of ``drawn`` as faint points and an EMA line (a series
    of fewer than :data:`SMOOTHED_FROM` points, a metric logged now and then, as its points
    joined: an EMA of few points lags far behind them), on the scale :func:`value_scale`
    chooses; non-finite values as ticks on the step axis."""
    for steps, values, color in drawn:
        finite = np.isfinite(values)
        if len(steps) < SMOOTHED_FROM:
            ax.plot(steps[finite], values[finite], "o-", color=color, ms=3.5, lw=1.5)
        else:
            ax.scatter(steps[finite], values[finite], s=6, color=color, alpha=0.3, lw=0)
            ax.plot(steps, ema(values), color=color, lw=1.8)
        if (~finite).any():
            ticks = np.zeros((~finite).sum())
            transform = ax.get_xaxis_transform()
            ax.plot(steps[~finite], ticks, "|", color=color, ms=12, mew=2, transform=transform)
    shown = np.concatenate([values[np.isfinite(values)] for _, values, _ in drawn])
    scale = value_scale(shown)
    if scale == "log":
        ax.set_yscale("log")
    elif scale is not None:
        ax.set_yscale("symlog", linthresh=scale)
        ax.yaxis.set_major_locator(FixedLocator(symlog_ticks(scale, shown.min(), shown.max())))
        ax.yaxis.set_minor_locator(NullLocator())


def value_scale(values: np.ndarray):
    """The y scale of the finite ``values`` of a panel's runs: None (linear) unless they
    span more than three decades (a diverging run among healthy ones); then "log" where all
    are positive, else the linear threshold of a symlog scale. Without negative values the
    span is from the smallest positive value (the threshold) to the largest; with some, from
    the median magnitude (then the lower quartile of the nonzero magnitudes is the threshold:
    values that cross 0 come near it without spanning decades)."""
    magnitudes = np.abs(values[values != 0])
    if not len(magnitudes):
        return None
    if (values >= 0).all():
        if magnitudes.max() <= 1e3 * magnitudes.min():
            return None
        return "log" if (values > 0).all() else float(magnitudes.min())
    if magnitudes.max() <= 1e3 * np.median(magnitudes):
        return None
    return float(np.percentile(magnitudes, 25))


def symlog_ticks(linthresh: float, lowest: float, highest: float) -> list[float]:
    """0 and at most four powers of ten on each side that the values reach; the smallest is
    a twelfth of the decades drawn above ``linthresh`` (at least one), so that its label does
    not print over the label of 0."""
    top = math.floor(math.log10(max(abs(lowest), abs(highest))))
    decades = (top - math.log10(linthresh)) * (2 if lowest < 0 else 1)
    bottom = min(math.ceil(math.log10(linthresh)) + max(1, math.ceil(decades / 12)), top)
    exponents = np.unique(np.linspace(bottom, top, min(4, top - bottom + 1)).round())
    powers = [10.0**e for e in exponents]
    below = [-p for p in reversed(powers) if -p >= lowest]
    return below + [0.0] + [p for p in powers if p <= highest]


def plot_compare(
    sources, path: str | os.PathLike | None = None, title: str | None = None, labels=None
) -> Figure:
    """Overlay the runs ``sources`` (run log paths, :class:`~avionics.records.Run` objects or
    live cockpits) in one figure (see the module docstring) and save it to ``path`` (.png,
    .pdf or .svg) if given. ``labels`` name the runs (default: :func:`run_labels`).

    Raises ValueError for fewer than two runs, a run given twice, labels that do not match
    the runs, or runs that share no scalar series (nothing to overlay)."""
    if path is not None and Path(path).suffix.lower() not in FORMATS:
        save(Figure(), path)  # raises the error that says which suffixes work
    runs = [as_run(source) for source in sources]
    _check_runs(runs)
    labels = list(labels) if labels is not None else run_labels(runs)
    if len(labels) != len(runs) or len(set(labels)) < len(labels):
        raise ValueError(
            f"compare got {len(labels)} label(s) {labels} for {len(runs)} runs: give each "
            "run its own label."
        )
    _check_common(runs, labels)
    colors = run_colors(len(runs))
    panels = compare_panels(runs)
    rows = math.ceil(len(panels) / COLUMNS)
    fig = Figure(
        figsize=(PANEL_SIZE[0] * COLUMNS, PANEL_SIZE[1] * rows + 1.2), layout="constrained"
    )
    grid = fig.add_gridspec(rows, COLUMNS)
    limits = step_limits(np.array([step for run in runs for step in run.steps]))
    for i, (group, name, panel_title, ylabel) in enumerate(panels):
        ax = fig.add_subplot(grid[i // COLUMNS, i % COLUMNS])
        style_panel(ax, panel_title, STEP, ylabel)
        ax.set_title(group, loc="left", fontsize="small", color="grey")
        drawn, missing = [], []
        for run, label, color in zip(runs, labels, colors):
            steps, values = series(run, name)
            if name in SINCE_FIRST and len(steps):
                values = values - values[0]
            if len(steps):
                drawn.append((steps, values, color))
            else:
                missing.append(label)
        _draw(ax, drawn)
        ax.set_xlim(*limits)  # one step axis for all panels
        if missing:
            ax.text(
                0.98,
                0.96,
                "not recorded by " + ", ".join(missing),
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize="small",
                color="grey",
                wrap=True,
            )
    handles = [Line2D([], [], color=color, lw=2.5) for color in colors]
    fig.legend(  # (the figure's title is the legend's: a suptitle would overlap it)
        handles,
        labels,
        loc="outside upper center",
        ncols=min(len(labels), 6),
        fontsize="large",
        frameon=False,
        title=title or _default_title(runs),
        title_fontproperties={"size": "xx-large", "weight": "bold"},
    )
    if path is not None:
        save(fig, path)
    return fig


def _default_title(runs) -> str:
    steps = [step for run in runs for step in run.steps]
    return f"Cockpit: {len(runs)} runs compared, steps {min(steps)}-{max(steps)}"
