"""STEP SIZE instruments: the alpha distribution, distance and update size, gradient norm."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes

from avionics.dashboard.style import (
    BLUE,
    GREY,
    ORANGE,
    empty_panel,
    quantity_panel,
    style_panel,
    twin_panel,
)
from avionics.records.series import series

ALPHA_RANGE = 1.5


def alpha_panel(fig, spec, run) -> Axes:
    """Histograms of all finite alpha values (grey) and of the latest 10 % (blue) over the
    unit parabola on which alpha is measured (start at -1, minimum at 0, mirror point at 1).
    Values outside [-1.5, 1.5] are counted in the outer bins and reported in the legend."""
    ax = fig.add_subplot(spec)
    title, xlabel, ylabel = (
        "Alpha distribution",
        r"local step length $\alpha$",
        "standardized loss",
    )
    _, alpha = series(run, "Alpha")
    alpha = alpha[np.isfinite(alpha)]
    if len(alpha) == 0:
        return empty_panel(ax, title, xlabel, ylabel, "Alpha")
    x = np.linspace(-ALPHA_RANGE, ALPHA_RANGE, 200)
    ax.plot(x, x**2, color=ORANGE, lw=2)
    for position in (-1, 0, 1):
        ax.axvline(position, color=GREY, lw=1, zorder=0)
    style_panel(ax, title, xlabel, ylabel)
    ax.set_xlim(-ALPHA_RANGE, ALPHA_RANGE)
    ax.set_ylim(0, 1.75)

    density = ax.twinx()
    bins = np.linspace(-ALPHA_RANGE, ALPHA_RANGE, 31)
    inside = np.clip(alpha, -ALPHA_RANGE + 1e-9, ALPHA_RANGE - 1e-9)
    latest = inside[-max(1, len(alpha) // 10) :]
    for values, color, name in ((inside, GREY, "all"), (latest, BLUE, "latest 10 %")):
        raw = alpha[-len(values) :]
        density.hist(
            values,
            bins=bins,
            weights=np.full(len(values), 1 / len(values)),
            color=color,
            alpha=0.55,
            label=f"{name}: {len(values)} step{'s' * (len(values) > 1)}, mean {raw.mean():.3g}",
        )
    outside = int((np.abs(alpha) > ALPHA_RANGE).sum())
    handles, labels = density.get_legend_handles_labels()
    if outside:
        labels[0] += f"\n({outside} outside ±{ALPHA_RANGE}, in the outer bins)"
    density.legend(handles, labels, loc="upper center", fontsize="small")
    density.set_ylabel("fraction of steps")
    return ax


def distance_panel(fig, spec, run) -> Axes:
    """Distance from the start ||theta_t - theta_0|| (left axis) and update size
    ||theta_{t+1} - theta_t|| (right axis) vs step, global values, with their EMAs."""
    ax = fig.add_subplot(spec)
    right = twin_panel(
        ax, run, "Distance and update size",
        ("Distance", "distance", r"distance $\|\theta_t - \theta_0\|$", BLUE),
        ("UpdateSize", r"update size $\|\theta_{t+1} - \theta_t\|$", "update size", ORANGE),
    )  # fmt: skip
    if right is None:
        return ax
    shown = ("EMA", "non-finite")  # the points' colours match their EMA lines
    lines = [
        line
        for line in dict.fromkeys(ax.get_lines() + right.get_lines())  # (right may be ax)
        if any(word in line.get_label() for word in shown)
    ]
    ax.legend(handles=lines, loc="best", fontsize="small", framealpha=0.7)
    return ax


def grad_norm_panel(fig, spec, run) -> Axes:
    """Global gradient norm ||g|| (root-sum-of-squares over parameters) vs step."""
    return quantity_panel(fig, spec, run, "GradNorm", "Gradient norm", r"$\|g\|$", "gradient norm")
