"""The primary screen: STEP SIZE, GRADIENTS and CURVATURE columns over a bottom row of
hyperparameters and performance (docs/cockpit.md, section 3)."""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.figure import Figure

from avionics.dashboard.curvature import max_ev_panel, tic_panel, trace_panel
from avionics.dashboard.gradients import (
    gradient_hist2d_panel,
    gradient_tests_panel,
    hist1d_panel,
)
from avionics.dashboard.performance import hyperparameter_panel, performance_panel
from avionics.dashboard.step_size import alpha_panel, distance_panel, grad_norm_panel
from avionics.dashboard.style import FORMATS, GROUP_COLORS, group_frame, save
from avionics.records.reader import as_run

COLUMNS = (
    ("STEP SIZE", (alpha_panel, distance_panel, grad_norm_panel)),
    ("GRADIENTS", (gradient_tests_panel, hist1d_panel, gradient_hist2d_panel)),
    ("CURVATURE", (max_ev_panel, trace_panel, tic_panel)),
)
FIGSIZE = (24, 15)
# the quantities each primary panel draws (a panel is empty when the run has none of them)
PANEL_QUANTITIES = {
    alpha_panel: ("Alpha",),
    distance_panel: ("Distance", "UpdateSize"),
    grad_norm_panel: ("GradNorm",),
    gradient_tests_panel: ("NormTest", "InnerTest", "OrthoTest"),
    hist1d_panel: ("GradHist1d",),
    gradient_hist2d_panel: ("GradHist2d",),
    max_ev_panel: ("HessMaxEV",),
    trace_panel: ("HessTrace",),
    tic_panel: ("TICDiag", "TICTrace"),
}
# Instruments of the "transformer" preset that have no primary panel: they take the place of
# the empty panels, in this order, where the run recorded them.
SUBSTITUTES = (
    "Ranks",
    "UpdateRatio",
    "ActivationHealth dead",
    "ActivationHealth rms",
    "GradientNoiseScale",
    "PreconditionedSharpness",
    "LossOutliers",
)
# The instruments each primary panel draws, as a hidden panel's note names them.
PANEL_NAMES = {
    alpha_panel: "Alpha distribution",
    distance_panel: "Distance and update size",
    grad_norm_panel: "Gradient norm",
    gradient_tests_panel: "Gradient tests",
    hist1d_panel: "Gradient element histogram",
    gradient_hist2d_panel: "Gradient/parameter histogram",
    max_ev_panel: "Largest Hessian eigenvalue",
    trace_panel: "Hessian trace",
    tic_panel: "TIC",
}


def _recorded(run, name: str) -> bool:
    return any(name in values for values in run.steps.values())


def substitute_panels(run) -> list:
    """Panels ``panel(fig, spec, run)`` of the :data:`SUBSTITUTES` the run recorded."""
    from avionics.dashboard.generic import generic_panel  # (they import this module)
    from avionics.dashboard.health import fraction_panel, rms_panel, update_ratio_panel
    from avionics.dashboard.outliers import loss_outliers_panel
    from avionics.dashboard.ranks import ranks_panel
    from avionics.records.ranks import processes

    panels = {
        "Ranks": ranks_panel if processes(run) > 1 else None,
        "UpdateRatio": update_ratio_panel,
        "ActivationHealth dead": lambda fig, spec, run: fraction_panel(
            fig, spec, run, "dead", "Dead units"
        ),
        "ActivationHealth rms": rms_panel,
        "GradientNoiseScale": lambda fig, spec, run: generic_panel(
            fig, spec, run, "GradientNoiseScale"
        ),
        "PreconditionedSharpness": lambda fig, spec, run: generic_panel(
            fig, spec, run, "PreconditionedSharpness"
        ),
        "LossOutliers": loss_outliers_panel,
    }
    recorded = [panels[key] for key in SUBSTITUTES if _recorded(run, key.split(" ")[0])]
    return [panel for panel in recorded if panel is not None]


def _not_recorded_note(fig, spec, panels: list) -> None:
    """In the place of the first panel left out of a column: which instruments this run did
    not record, and the quantities that draw them (figure text, no axes)."""
    lines = [f"{PANEL_NAMES[panel]}: {' or '.join(PANEL_QUANTITIES[panel])}" for panel in panels]
    box = spec.get_position(fig)
    fig.text(
        box.x0 + box.width / 2,
        box.y1,
        "Not recorded in this run (add the quantity to draw it):\n" + "\n".join(lines),
        ha="center",
        va="top",
        color="#333333",
        fontsize="medium",
        linespacing=1.6,
        bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.7, "edgecolor": "none"},
    )


def default_title(run) -> str:
    """``Cockpit: <run name> (<optimizer>), steps a-b``."""
    name = run.path.parent.name if run.path and run.path.name == "log.jsonl" else None
    name = name or (run.path.stem if run.path else "live run")
    optimizer = (run.metadata.get("optimizer") or {}).get("name")
    span = f", steps {min(run.steps)}-{max(run.steps)}" if run.steps else ", no steps yet"
    return f"Cockpit: {name}" + (f" ({optimizer})" if optimizer else "") + span


def plot(source, path: str | os.PathLike | None = None, title: str | None = None) -> Figure:
    """Draw the dashboard of ``source`` (a run log path, a :class:`~avionics.records.Run`,
    or a live ``Cockpit``) and save it to ``path`` (.png, .pdf or .svg) if given.

    Every instrument the run recorded is drawn. The place of one without data goes to an
    instrument that has no panel here (:data:`SUBSTITUTES`: the per-rank view of several
    processes, and the "transformer" preset's UpdateRatio, ActivationHealth's dead fractions
    and RMS, GradientNoiseScale, PreconditionedSharpness, LossOutliers), in order, where the
    run recorded it; otherwise no panel is drawn there, and a note in the first such place of
    each column names the instruments left out and the quantities that draw them. So a
    preset's own dashboard shows each of its instruments and no empty panel. Histograms show
    the latest step that has one.
    """
    run = as_run(source)
    if path is not None and Path(path).suffix.lower() not in FORMATS:
        save(Figure(), path)  # raises the error that says which suffixes work
    fig = Figure(figsize=FIGSIZE)
    outer = fig.add_gridspec(
        2,
        3,
        height_ratios=[3, 1],
        wspace=0.1,
        hspace=0.12,
        left=0.05,
        right=0.97,
        top=0.93,
        bottom=0.04,
    )
    substitutes = substitute_panels(run)
    for column, (group, panels) in enumerate(COLUMNS):
        group_frame(fig, outer[0, column], group, GROUP_COLORS[group])
        inner = outer[0, column].subgridspec(
            5,
            3,
            width_ratios=[0.12, 1, 0.12],
            height_ratios=[0.02, 1, 1, 1, 0.06],
            hspace=0.55,
        )
        left_out = []
        for row, panel in enumerate(panels):
            empty = not any(_recorded(run, name) for name in PANEL_QUANTITIES[panel])
            if empty and substitutes:
                panel, empty = substitutes.pop(0), False
            if empty:
                left_out.append((row, panel))
            else:
                panel(fig, inner[row + 1, 1], run)
        if left_out:
            _not_recorded_note(fig, inner[left_out[0][0] + 1, 1], [p for _, p in left_out])
    hyperparameter_panel(fig, outer[1, 0], run)
    performance_panel(fig, outer[1, 1:], run)
    fig.suptitle(title or default_title(run), fontsize="xx-large", fontweight="bold")
    if path is not None:
        save(fig, path)
    return fig
