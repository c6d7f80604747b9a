"""avionics: a cockpit for PyTorch training, and exact, fast curvature linear operators."""

from typing import TYPE_CHECKING

from avionics import schedules
from avionics.version import __version__

if TYPE_CHECKING:
    from avionics import quantities
    from avionics.cockpit import Cockpit
    from avionics.configurations import configuration
    from avionics.dashboard import LiveDashboard, plot, plot_secondary
    from avionics.diagnosis import diagnose
    from avionics.records import read_run

# Loaded on first use: the instruments (the cockpit, the quantities), so that reading a run
# (avionics.records) loads none of them; and reading, drawing and diagnosing runs, which
# import matplotlib and friends.
_LAZY = {
    "Cockpit": "avionics.cockpit",
    "configuration": "avionics.configurations",
    "read_run": "avionics.records",
    "plot": "avionics.dashboard",
    "plot_secondary": "avionics.dashboard",
    "LiveDashboard": "avionics.dashboard",
    "diagnose": "avionics.diagnosis",
}
_LAZY_MODULES = ("quantities",)


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"avionics.{name}")
    raise AttributeError(f"module 'avionics' has no attribute {name!r}")


__all__ = [
    "Cockpit",
    "LiveDashboard",
    "__version__",
    "configuration",
    "diagnose",
    "plot",
    "plot_secondary",
    "quantities",
    "read_run",
    "schedules",
]
