"""The per-rank panel of a data-parallel run (the ``Ranks`` quantity): each process's step time
vs step, one line per rank, and each rank's loss relative to the others' on a twin axis, so that
a straggler or an odd shard stands out."""

from __future__ import annotations

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes

from avionics.dashboard.style import STEP, empty_panel, step_limits, style_panel
from avionics.records.ranks import RANKS, rank_series, ratios_to_the_others

TITLE = "Ranks"
MARKED = 8  # ranks drawn each in its own colour; more share one grey and the extremes stand out


def ranks_panel(fig, spec, run) -> Axes:
    """Per rank: step time (ms, solid, left axis) and loss over the other ranks' median
    (dashed, right axis, 1 = like the others) vs step."""
    ax = fig.add_subplot(spec)
    steps, fields = rank_series(run)
    if len(steps) == 0:
        return empty_panel(ax, TITLE, STEP, "step time (ms)", RANKS)
    style_panel(ax, TITLE, STEP, "step time outside collectives (ms)")
    times, losses = fields["step_time"] * 1e3, ratios_to_the_others(fields["loss"])
    ranks = times.shape[1]
    colors = colormaps["tab10"](np.arange(min(ranks, MARKED)))
    twin = ax.twinx()
    twin.set_ylabel("loss / other ranks' median")
    for rank in range(ranks):
        color = colors[rank] if rank < MARKED else "#ababba"
        label = f"rank {rank}" if rank < MARKED else None
        ax.plot(steps, times[:, rank], "o-", color=color, ms=3, lw=1.2, label=label)
        twin.plot(steps, losses[:, rank], "--", color=color, lw=1)
    twin.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_ylim(bottom=0)
    ax.set_xlim(*step_limits(steps))
    ax.legend(loc="upper left", fontsize="small", ncol=min(ranks, 4))
    return ax
