"""avionics: a cockpit for PyTorch training, and exact, fast curvature linear operators."""

__version__ = "0.1.0"

from avionics import quantities, schedules  # noqa: E402
from avionics.cockpit import Cockpit  # noqa: E402
from avionics.configurations import configuration  # noqa: E402

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


__all__ = ["Cockpit", "configuration", "quantities", "schedules", *_LAZY]
