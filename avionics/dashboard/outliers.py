"""The loss-outliers panel (LossOutliers, in the "transformer" preset): each step's median
per-sample loss, the threshold above which a sample is an outlier,

    median + k * s,  s = max(1.4826 * MAD, 0.01 |median|)

(avionics.quantities.LossOutliers), and the outlying samples' losses as red points with
their number."""

from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes

from avionics.dashboard.style import BLUE, ORANGE, STEP, empty_panel, step_limits, style_panel

OUTLIERS = "LossOutliers"


def loss_outliers_panel(fig, spec, run) -> Axes:
    """Median per-sample loss and the outlier threshold vs step, the outliers as points."""
    ax = fig.add_subplot(spec)
    title, ylabel = "Loss outliers", "per-sample loss"
    rows = sorted(
        (s, v[OUTLIERS]) for s, v in run.steps.items() if isinstance(v.get(OUTLIERS), dict)
    )
    if not rows:
        return empty_panel(ax, title, STEP, ylabel, f"{OUTLIERS}()")
    style_panel(ax, title, STEP, ylabel)
    steps = np.array([s for s, _ in rows], dtype=np.float64)
    median = np.array([float(v["median"]) for _, v in rows])
    threshold = median + np.array([float(v["k"]) * float(v["scale"]) for _, v in rows])
    ax.plot(steps, median, color=BLUE, lw=1.8, marker="o", ms=3, label="median loss")
    ax.plot(steps, threshold, color=ORANGE, lw=1.4, ls="--", label="outlier threshold")
    points = [(s, float(x)) for s, v in rows for x in v["losses"] if np.isfinite(float(x))]
    count = sum(int(v["count"]) for _, v in rows)
    if points:
        xs, ys = zip(*points, strict=True)
        ax.scatter(xs, ys, color="red", s=18, zorder=3, label="outlying samples")
    ax.set_xlim(*step_limits(steps))
    ax.legend(loc="best", fontsize="small", title=f"{count} outlying sample(s) in all")
    return ax
