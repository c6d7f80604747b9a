"""GRADIENTS instruments: the three gradient tests, the 1d gradient-element histogram and the
2d gradient/parameter histogram with its marginals."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.patches import Circle

from avionics.dashboard.style import (
    BLUE,
    GREEN,
    ORANGE,
    TITLE,
    empty_panel,
    style_panel,
)
from avionics.records.series import latest, series

TESTS = (("NormTest", BLUE), ("InnerTest", ORANGE), ("OrthoTest", GREEN))
PLANE_HALF_WIDTH = 2.0
PLANE_LINTHRESH = 0.1


def _title_axes(fig, spec, title: str, pad: float = 6) -> Axes:
    ax = fig.add_subplot(spec)
    ax.set_axis_off()
    ax.set_title(title, pad=pad, **TITLE)
    return ax


def _plane(ax: Axes) -> None:
    w = PLANE_HALF_WIDTH
    for set_scale in (ax.set_xscale, ax.set_yscale):
        set_scale("symlog", linthresh=PLANE_LINTHRESH)
    ax.set_xlim(-w, w)
    ax.set_ylim(-w, w)
    ax.yaxis.tick_right()
    ax.yaxis.set_label_position("right")
    ax.grid(ls="--", alpha=0.4)
    ax.plot(0, 0, "k+", ms=14, mew=3)
    ax.set_facecolor("white")
    ax.set_xlabel("orthogonality test")
    ax.set_ylabel("inner-product test")


def _history(ax: Axes, steps, values, color, name: str) -> None:
    """A test's history: vs step for the norm and inner tests, sideways for the ortho test
    (which sits above the plane's horizontal axis)."""
    ax.set_facecolor("white")
    ax.tick_params(labelsize="x-small")
    ax.locator_params(nbins=3)
    if name == "OrthoTest":
        ax.fill_betweenx(steps, values, color=color, alpha=0.45)
        ax.plot(values, steps, color=color)
        ax.set_xlim(left=0)
        ax.invert_yaxis()
        ax.xaxis.tick_top()
        ax.yaxis.tick_right()
        ax.yaxis.set_label_position("right")
        ax.set_ylabel("ortho\nvs step", fontsize="small")
    else:
        ax.fill_between(steps, values, color=color, alpha=0.45)
        ax.plot(steps, values, color=color)
        ax.set_ylim(bottom=0)
        ax.set_ylabel(f"{name[:-4].lower()}\nvs step", fontsize="small")
        if name == "InnerTest":
            ax.invert_yaxis()
        else:  # the norm test sits above the inner test and shares its step axis
            ax.tick_params(labelbottom=False)


def gradient_tests_panel(fig, spec, run) -> Axes:
    """The latest norm test as a disc of that radius, the inner-product test as a horizontal
    band of +-its value and the orthogonality test as a vertical band, on a symlog plane
    (they are small when the mini-batch gradient is reliable); their histories beside it."""
    title = "Gradient tests"
    data = {name: series(run, name) for name, _ in TESTS}
    if all(len(steps) == 0 for steps, _ in data.values()):
        return empty_panel(
            fig.add_subplot(spec),
            title,
            "orthogonality test",
            "inner-product test",
            "NormTest, InnerTest, OrthoTest",
        )
    frame = _title_axes(fig, spec, title, pad=22)
    gs = spec.subgridspec(3, 3, wspace=0.1, hspace=0.15, width_ratios=[1, 1.2, 1.2])
    plane = fig.add_subplot(gs[1:, 1:])
    _plane(plane)
    cells = {"NormTest": gs[1, 0], "InnerTest": gs[2, 0], "OrthoTest": gs[0, 2]}
    for name, color in TESTS:
        steps, values = data[name]
        finite = np.isfinite(values)
        history = fig.add_subplot(cells[name])
        if not finite.any():
            empty_panel(history, "", "", "", name)
            continue
        last = float(values[finite][-1])
        label = f"{name[:-4].lower()} test: {last:.3g}"
        if name == "NormTest":
            disc = Circle((0, 0), last, facecolor=color, alpha=0.45, edgecolor=color, label=label)
            plane.add_patch(disc)
        elif name == "InnerTest":
            plane.axhspan(-last, last, color=color, alpha=0.45, label=label)
        else:
            plane.axvspan(-last, last, color=color, alpha=0.45, label=label)
        _history(history, steps[finite], values[finite], color, name)
    key = fig.add_subplot(gs[0, :2])
    key.set_axis_off()
    key.legend(
        *plane.get_legend_handles_labels(), title="latest values", loc="center", fontsize="small"
    )
    return frame


def hist1d_panel(fig, spec, run) -> Axes:
    """Counts of the per-sample gradient elements g_{n,d} at the latest step (log scale)."""
    ax = fig.add_subplot(spec)
    title, xlabel, ylabel = "Gradient element histogram", r"gradient element $g_{n,d}$", "count"
    step, value = latest(run, "GradHist1d")
    if not isinstance(value, dict):
        return empty_panel(ax, title, xlabel, ylabel, "GradHist1d")
    counts = np.asarray(value["hist"], dtype=float)
    edges = np.asarray(value["edges"], dtype=float)
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color=BLUE)
    style_panel(ax, f"{title} (step {step})", xlabel, ylabel)
    if (counts > 0).any():
        ax.set_yscale("log")
    ax.set_xlim(edges[0], edges[-1])
    return ax


def hist2d_panel(fig, spec, value, title: str) -> Axes:
    """A joint histogram of (gradient element, parameter value) as log10(1 + count) colours,
    parameter value across and gradient element up, with the two marginals (log counts)."""
    xlabel, ylabel = r"parameter $\theta_d$", r"gradient element $g_{n,d}$"
    if not isinstance(value, dict):
        return empty_panel(fig.add_subplot(spec), title, xlabel, ylabel, "GradHist2d")
    frame = _title_axes(fig, spec, title)
    hist = np.asarray(value["hist"], dtype=float)  # rows: gradient bins, columns: parameter
    grad_edges, param_edges = (np.asarray(e, dtype=float) for e in value["edges"])
    gs = spec.subgridspec(4, 5, wspace=0.1, hspace=0.15)
    joint = fig.add_subplot(gs[1:, :4])
    top = fig.add_subplot(gs[0, :4], sharex=joint)
    right = fig.add_subplot(gs[1:, 4], sharey=joint)
    joint.pcolormesh(param_edges, grad_edges, np.log10(1 + hist), cmap="Blues")
    joint.axvline(0, color="grey", lw=0.8)
    joint.axhline(0, color="grey", lw=0.8)
    joint.set_xlabel(xlabel)
    joint.set_ylabel(ylabel)
    top.bar(
        param_edges[:-1], hist.sum(axis=0), width=np.diff(param_edges), align="edge", color=BLUE
    )
    right.barh(
        grad_edges[:-1], hist.sum(axis=1), height=np.diff(grad_edges), align="edge", color=BLUE
    )
    if hist.sum() > 0:
        top.set_yscale("log")
        right.set_xscale("log")
    top.tick_params(which="both", labelbottom=False, labelleft=False)
    right.tick_params(which="both", labelleft=False, labelbottom=False)
    right.set_xlabel("log count", fontsize="small")
    return frame


def gradient_hist2d_panel(fig, spec, run) -> Axes:
    """The 2d histogram of all parameters at the latest step."""
    step, value = latest(run, "GradHist2d")
    title = "Gradient/parameter histogram" + ("" if step is None else f" (step {step})")
    return hist2d_panel(fig, spec, value, title)
