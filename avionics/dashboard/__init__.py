"""The cockpit dashboard (docs/cockpit.md, section 3): a matplotlib figure from a run log or a live
cockpit, its secondary screen, the layer-health screen (:func:`plot_health`), and a live mode
that redraws during training."""

from avionics.dashboard.figure import plot
from avionics.dashboard.health import plot_health
from avionics.dashboard.heatmap import heatmap_panel
from avionics.dashboard.live import LiveDashboard
from avionics.dashboard.secondary import plot_secondary

__all__ = ["LiveDashboard", "heatmap_panel", "plot", "plot_health", "plot_secondary"]
