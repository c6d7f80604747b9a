"""The per-sample statistics engine (see :mod:`avionics.persample.engine`)."""

from avionics.persample.capture import Capture, ModuleCall
from avionics.persample.engine import PerSampleEngine
from avionics.persample.request import Request, Statistics

__all__ = ["Capture", "ModuleCall", "PerSampleEngine", "Request", "Statistics"]
