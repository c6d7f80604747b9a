"""The per-sample statistics engine (see :mod:`avionics.persample.engine`)."""

from avionics.persample.capture import Capture, ModuleCall
from avionics.persample.engine import PerSampleEngine
from avionics.persample.request import OuterProducts, Request, Statistics

__all__ = ["Capture", "ModuleCall", "OuterProducts", "PerSampleEngine", "Request", "Statistics"]
