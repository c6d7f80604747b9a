"""CURVATURE instruments: largest Hessian eigenvalue (and preconditioned sharpness), Hessian
trace, TIC."""

from __future__ import annotations

from matplotlib.axes import Axes

from avionics.dashboard.style import (
    BLUE,
    GREEN,
    quantity_panel,
    twin_panel,
)
from avionics.records.series import series


def max_ev_panel(fig, spec, run) -> Axes:
    """Largest eigenvalue of the mini-batch loss Hessian vs step, log scale (symlog when a
    value is not positive); a run with PreconditionedSharpness (an adaptive optimizer's
    lambda_max(P^{-1/2} H P^{-1/2})) has it beside, on a twin axis."""
    title, ylabel = "Largest Hessian eigenvalue", r"$\lambda_{\max}$"
    if not len(series(run, "PreconditionedSharpness")[0]):
        return quantity_panel(fig, spec, run, "HessMaxEV", title, ylabel, "max eigenvalue", "log")
    ax = fig.add_subplot(spec)
    preconditioned = r"$\lambda_{\max}(P^{-1/2} H P^{-1/2})$"
    right = twin_panel(
        ax, run, "Largest eigenvalues", ("HessMaxEV", "HessMaxEV", ylabel, BLUE),
        ("PreconditionedSharpness", "preconditioned", preconditioned, GREEN),
    )  # fmt: skip
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    handles = list(dict.fromkeys(handles))  # (right is ax where one of them has no data)
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    return ax


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
    handles = list(dict.fromkeys(handles))  # (right is ax where one of them has no data)
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    return ax
