"""CURVATURE instruments: largest Hessian eigenvalue, Hessian trace, TIC."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes

from avionics.dashboard.style import (
    BLUE,
    GREEN,
    STEP,
    empty_panel,
    quantity_panel,
    series_plot,
    step_limits,
    style_panel,
)
from avionics.records.series import series


def max_ev_panel(fig, spec, run) -> Axes:
    """Largest eigenvalue of the mini-batch loss Hessian vs step, log scale (symlog when a
    value is not positive)."""
    title, ylabel = "Largest Hessian eigenvalue", r"$\lambda_{\max}$"
    return quantity_panel(fig, spec, run, "HessMaxEV", title, ylabel, "max eigenvalue", "log")


def trace_panel(fig, spec, run) -> Axes:
    """Hessian trace (sum over parameters of the diagonal) vs step."""
    return quantity_panel(fig, spec, run, "HessTrace", "Hessian trace", r"tr$(H)$", "trace")


def tic_panel(fig, spec, run) -> Axes:
    """Takeuchi information criterion vs step: TICDiag on the left axis, TICTrace on the
    right one (their scales differ by orders of magnitude)."""
    ax = fig.add_subplot(spec)
    title = "TIC"
    diag_steps, diag = series(run, "TICDiag")
    trace_steps, trace = series(run, "TICTrace")
    if not len(diag_steps) and not len(trace_steps):
        return empty_panel(ax, title, STEP, "TICDiag", "TICDiag or TICTrace")
    style_panel(ax, title, STEP, "TICDiag")
    if len(diag_steps):
        series_plot(ax, diag_steps, diag, "TICDiag", color=BLUE)
    else:
        ax.text(0.02, 0.9, "no TICDiag data", transform=ax.transAxes, color="grey")
    right = ax.twinx()
    right.set_ylabel("TICTrace", color=GREEN)
    if len(trace_steps):
        series_plot(right, trace_steps, trace, "TICTrace", color=GREEN)
    else:
        right.text(0.98, 0.9, "no TICTrace data", transform=ax.transAxes, ha="right")
    ax.set_xlim(*step_limits(np.concatenate([diag_steps, trace_steps])))
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    return ax
