"""The cockpit dashboard (SPEC section 3): a matplotlib figure from a run log or a live
cockpit, its secondary screen, and a live mode that redraws during training."""

from avionics.dashboard.figure import plot
from avionics.dashboard.live import LiveDashboard
from avionics.dashboard.secondary import plot_secondary

__all__ = ["LiveDashboard", "plot", "plot_secondary"]
