"""avionics: a cockpit for PyTorch training, and exact, fast curvature linear operators."""

from avionics import quantities, schedules
from avionics.cockpit import Cockpit
from avionics.configurations import configuration
from avionics.version import __version__

# Reading, drawing and diagnosing runs import matplotlib and friends: loaded on first use.
_LAZY = {
    "read_run": "avionics.records",
    "plot": "avionics.dashboard",
    "plot_secondary": "avionics.dashboard",
    "LiveDashboard": "avionics.dashboard",
    "diagnose": "avionics.diagnosis",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'avionics' has no attribute {name!r}")


__all__ = ["Cockpit", "__version__", "configuration", "quantities", "schedules", *_LAZY]
