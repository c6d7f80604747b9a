"""The bottom row: hyperparameters (learning rate) and performance (loss, accuracies)."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes

from avionics.dashboard.style import (
    BLUE,
    GREEN,
    ORANGE,
    STEP,
    SUMMARY_FACE,
    empty_panel,
    series_plot,
    step_limits,
    style_panel,
)
from avionics.records.series import series

ACCURACIES = (("train_accuracy", BLUE), ("valid_accuracy", ORANGE), ("test_accuracy", GREEN))
LOGGED_LOSSES = (("train_loss", BLUE), ("valid_loss", ORANGE), ("test_loss", GREEN))


def _optimizer_lr(run) -> float | None:
    groups = (run.metadata.get("optimizer") or {}).get("param_groups") or [{}]
    lr = groups[0].get("lr") if isinstance(groups[0], dict) else None
    return float(lr) if isinstance(lr, (int, float)) else None


def hyperparameter_panel(fig, spec, run) -> Axes:
    """The logged learning rate vs step; without one, the optimizer's learning rate from the
    run's metadata as a constant."""
    ax = fig.add_subplot(spec)
    title, ylabel = "Hyperparameters", "learning rate"
    steps, lr = series(run, "learning_rate")
    if len(steps):
        style_panel(ax, title, STEP, ylabel, face=SUMMARY_FACE)
        last = max(run.steps)  # the last value holds until the end of the run
        ax.step(
            np.append(steps, max(last, steps[-1])),
            np.append(lr, lr[-1]),
            where="post",
            color=ORANGE,
            lw=2,
            label=f"learning rate ({lr[-1]:.3g})",
        )
    elif _optimizer_lr(run) is not None and run.steps:
        style_panel(ax, title, STEP, ylabel, face=SUMMARY_FACE)
        span = [min(run.steps), max(run.steps)]
        lr0 = _optimizer_lr(run)
        ax.plot(span, [lr0, lr0], color=ORANGE, lw=2, label=f"optimizer lr ({lr0:.3g})")
    else:
        return empty_panel(ax, title, STEP, ylabel, "cockpit.log(step, learning_rate=...)")
    ax.set_ylim(0, 1.3 * ax.get_ylim()[1])  # room for the legend above the line
    ax.legend(loc="upper right", fontsize="small")
    return ax


def performance_panel(fig, spec, run) -> Axes:
    """Mini-batch loss with its EMA (and logged train/valid/test losses) on the left axis,
    logged accuracies on the right axis (0 to 1)."""
    ax = fig.add_subplot(spec)
    title, ylabel = "Performance", "loss"
    steps, loss = series(run, "Loss")
    logged = [(name, *series(run, name), c) for name, c in LOGGED_LOSSES]
    accuracies = [(name, *series(run, name), c) for name, c in ACCURACIES]
    logged = [entry for entry in logged if len(entry[1])]
    accuracies = [entry for entry in accuracies if len(entry[1])]
    if not len(steps) and not logged and not accuracies:
        return empty_panel(ax, title, STEP, ylabel, "Loss, or logged losses and accuracies")
    style_panel(ax, title, STEP, ylabel, face=SUMMARY_FACE)
    if len(steps):
        series_plot(ax, steps, loss, "mini-batch loss")
    for name, s, v, color in logged:
        ax.plot(s, v, "o-", color=color, ms=4, label=name.replace("_", " "))
    handles = ax.get_legend_handles_labels()[0]
    if accuracies:
        right = ax.twinx()
        for name, s, v, color in accuracies:
            finite = v[np.isfinite(v)]
            label = name.replace("_", " ") + (f" ({finite[-1]:.1%})" if len(finite) else "")
            right.plot(s, v, "s--", color=color, ms=4, lw=1.5, label=label)
        right.set_ylim(0, 1)
        right.set_ylabel("accuracy")
        handles += right.get_legend_handles_labels()[0]
    plotted = [steps] + [s for _, s, _, _ in logged + accuracies]
    ax.set_xlim(*step_limits(np.concatenate(plotted)))
    ax.legend(handles=handles, loc="center right", fontsize="small")
    return ax
