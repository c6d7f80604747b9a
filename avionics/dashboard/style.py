"""Shared look of the dashboard panels: colours, smoothing, series and empty panels."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import SymmetricalLogLocator

from avionics.records.series import series

BLUE = (0.29, 0.45, 0.68)
ORANGE = (0.95, 0.50, 0.20)
GREEN = (0.30, 0.60, 0.40)
GREY = "#ababba"
GROUP_COLORS = {"STEP SIZE": BLUE, "GRADIENTS": ORANGE, "CURVATURE": GREEN}
PANEL_FACE = "white"
SUMMARY_FACE = "#e4e4ea"  # the bottom row
EMA_WEIGHT = 0.2
TITLE = {"fontweight": "bold", "fontsize": "large"}
STEP = "step"  # the label of every step axis


def ema(values: np.ndarray, weight: float = EMA_WEIGHT) -> np.ndarray:
    """Exponential moving average ``s_t = weight * x_t + (1 - weight) * s_{t-1}``,
    ``s_0 = x_0``; a non-finite ``x_t`` leaves the average unchanged (nan before any finite
    value)."""
    smoothed = np.full(len(values), np.nan)
    current = np.nan
    for i, x in enumerate(values):
        if np.isfinite(x):
            current = x if np.isnan(current) else weight * x + (1 - weight) * current
        smoothed[i] = current
    return smoothed


LABEL_WIDTH = 26  # characters of a parameter's or module's name on an axis or in a legend


def short_labels(names: list[str], width: int = LABEL_WIDTH) -> list[str]:
    """Parameter or module names as an axis shows them: where one is longer than ``width``
    characters, the dotted prefix that all of them share left out (``transformer.`` of a
    Hugging Face GPT-2's parameters); a name still longer than
    ``width`` characters has its inner components cut to their first letter, from the left,
    until it fits (``encoder.layer.0.attention.self.query.weight`` becomes
    ``e.l.0.a.self.query.weight``; numbers and the last two components stay whole), and
    what still does not fit loses its middle to an ellipsis. Distinct names stay distinct (a
    name whose cut would meet another's is shown whole)."""
    parts = [name.split(".") for name in names]
    shared = 0
    too_long = any(len(name) > width for name in names)
    while too_long and len(names) > 1 and all(len(p) > shared + 1 for p in parts):
        if len({p[shared] for p in parts}) > 1:
            break
        shared += 1
    shown = [_shortened(p[shared:], width) for p in parts]
    whole = [".".join(p[shared:]) for p in parts]
    taken: dict[str, int] = {}
    for label in shown:
        taken[label] = taken.get(label, 0) + 1
    return [s if taken[s] == 1 else w for s, w in zip(shown, whole, strict=True)]


def _shortened(components: list[str], width: int) -> str:
    components = list(components)
    for k in range(len(components) - 2):
        if len(".".join(components)) <= width:
            break
        if not components[k].isdigit():
            components[k] = components[k][0]
    name = ".".join(components)
    if len(name) <= width:
        return name
    start = (width - 1) // 3
    return f"{name[:start]}…{name[len(name) - (width - 1 - start) :]}"


def empty_panel(ax: Axes, title: str, xlabel: str, ylabel: str, needs: str) -> Axes:
    """Draw an instrument without data: its title and axis labels, and what it needs."""
    ax.set_title(title, **TITLE)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_facecolor("#f4f4f4")
    ax.text(
        0.5,
        0.5,
        f"no data\n(needs {needs})",
        transform=ax.transAxes,
        ha="center",
        va="center",
        color="grey",
        fontsize="medium",
    )
    return ax


def series_plot(
    ax: Axes,
    steps: np.ndarray,
    values: np.ndarray,
    label: str,
    color=BLUE,
    smooth: bool = True,
    yscale: str = "auto",
):
    """Points of ``values`` vs ``steps`` and, if ``smooth``, their EMA as a line. Non-finite
    values are left out of the points (and marked with a red tick on the step axis). The
    y scale is ``yscale``; symlog when ``"log"`` is asked but a value is not positive;
    ``"auto"`` is log for positive values spanning more than three decades (a diverging
    run; symlog if some are 0), else linear."""
    finite = np.isfinite(values)
    size = 9 if finite.sum() > 40 else 30  # few points must still be seen
    ax.scatter(steps[finite], values[finite], s=size, color=color, alpha=0.7, label=label, lw=0)
    if smooth and finite.any():
        ax.plot(steps, ema(values), color=color, lw=1.8, label=f"{label} (EMA)")
    if (~finite).any():
        ax.plot(
            steps[~finite],
            np.zeros((~finite).sum()),
            "|",
            color="red",
            ms=14,
            mew=2,
            transform=ax.get_xaxis_transform(),
            label=f"{label}: non-finite",
        )
    shown = values[finite]
    positive = shown[shown > 0]
    wide = len(positive) and (shown >= 0).all() and positive.max() > 1e3 * positive.min()
    if yscale == "auto":
        yscale = "log" if wide else "linear"
    if yscale == "log" and len(shown) and (shown <= 0).any():
        yscale = "symlog"
    if yscale == "symlog" and wide:  # zeros among spread positives: linear only near 0
        ax.set_yscale("symlog", linthresh=positive.min())
        ax.yaxis.set_major_locator(SymmetricalLogLocator(base=10, linthresh=positive.min()))
        ax.yaxis.get_major_locator().set_params(numticks=7)
        ax.set_ylim(bottom=0)
    else:
        ax.set_yscale(yscale)
    if len(steps):
        ax.set_xlim(*step_limits(steps))


def step_limits(steps: np.ndarray) -> tuple[float, float]:
    """The step axis: the steps' range plus 2 % on each side (at least half a step)."""
    pad = max(0.5, 0.02 * (steps.max() - steps.min()))
    return steps.min() - pad, steps.max() + pad


def style_panel(ax: Axes, title: str, xlabel: str, ylabel: str, face=PANEL_FACE) -> None:
    """Title, labels, face colour and a light grid for one instrument."""
    ax.set_title(title, **TITLE)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_facecolor(face)
    ax.grid(alpha=0.3, ls="--")


def quantity_panel(
    fig, spec, run, quantity: str, title: str, ylabel: str, label: str, yscale: str = "auto"
) -> Axes:
    """One quantity's values (and their EMA) vs step, or a labelled empty panel."""
    ax = fig.add_subplot(spec)
    steps, values = series(run, quantity)
    if len(steps) == 0:
        return empty_panel(ax, title, STEP, ylabel, quantity)
    style_panel(ax, title, STEP, ylabel)
    series_plot(ax, steps, values, label, yscale=yscale)
    ax.legend(loc="upper right", fontsize="small")
    return ax


def twin_panel(ax: Axes, run, title: str, left: tuple, right: tuple) -> Axes | None:
    """Two quantities vs step whose scales differ: ``left`` and ``right`` are (quantity, line
    label, axis label, colour), drawn on ``ax`` and on a twin axis. Where only one has data,
    it is drawn on ``ax`` alone, which says that the other has none, and is returned; None when
    neither has data (the panel then says what it needs)."""
    (l_name, l_label, l_axis, l_color), (r_name, r_label, r_axis, r_color) = left, right
    l_steps, l_values = series(run, l_name)
    r_steps, r_values = series(run, r_name)
    if not len(l_steps) and not len(r_steps):
        empty_panel(ax, title, STEP, l_axis, f"{l_name} or {r_name}")
        return None
    if not len(l_steps) or not len(r_steps):
        shown, steps, values, absent = (
            (left, l_steps, l_values, r_name)
            if len(l_steps)
            else (right, r_steps, r_values, l_name)
        )
        style_panel(ax, title, STEP, shown[2])
        series_plot(ax, steps, values, shown[1], color=shown[3])
        ax.text(0.02, 0.92, f"no {absent} data", transform=ax.transAxes, color="grey")
        return ax
    style_panel(ax, title, STEP, l_axis)
    series_plot(ax, l_steps, l_values, l_label, color=l_color)
    twin = ax.twinx()
    twin.set_ylabel(r_axis, color=r_color)
    series_plot(twin, r_steps, r_values, r_label, color=r_color)
    ax.set_xlim(*step_limits(np.concatenate([l_steps, r_steps])))
    return twin


# The file types a dashboard is saved as.
FORMATS = (".png", ".pdf", ".svg")


def group_frame(fig: Figure, spec, name: str, color) -> None:
    """The coloured background and bold title of a group of instruments."""
    frame = fig.add_subplot(spec)
    frame.set_facecolor((*color, 0.6))
    frame.set_title(name, fontweight="bold", fontsize="x-large")
    frame.set_xticks([])
    frame.set_yticks([])
    for spine in frame.spines.values():
        spine.set_visible(False)


def save(fig: Figure, path: str | os.PathLike) -> Path:
    """Save ``fig`` as PNG, PDF or SVG, chosen by the file suffix."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(
            f"Cannot save a dashboard as {path.name!r}: use a file name ending in "
            f"{', '.join(FORMATS)}."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100 if path.suffix.lower() == ".png" else None)
    return path
