"""CURVATURE instruments: largest Hessian eigenvalue, Hessian trace, TIC."""

from __future__ import annotations

from matplotlib.axes import Axes

from avionics.dashboard.style import (
    BLUE,
    GREEN,
    quantity_panel,
    twin_panel,
)


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
    right = twin_panel(
        ax, run, "TIC", ("TICDiag", "TICDiag", "TICDiag", BLUE),
        ("TICTrace", "TICTrace", "TICTrace", GREEN),
    )  # fmt: skip
    if right is None:
        return ax
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    return ax
