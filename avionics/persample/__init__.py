"""The per-sample statistics engine (see :mod:`avionics.persample.engine` for the routing of
parameters to module calls, :mod:`avionics.persample.step` for one step's statistics)."""

from avionics.persample.calls import ModuleCall
from avionics.persample.capture import Capture
from avionics.persample.engine import PerSampleEngine
from avionics.persample.request import OuterProducts, Request, Statistics
from avionics.persample.step import CapturedStep

__all__ = [
    "Capture",
    "CapturedStep",
    "ModuleCall",
    "OuterProducts",
    "PerSampleEngine",
    "Request",
    "Statistics",
]
