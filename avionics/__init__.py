"""avionics: a cockpit for PyTorch training, and exact, fast curvature linear operators."""

__version__ = "0.1.0"

from avionics import quantities, schedules  # noqa: E402
from avionics.cockpit import Cockpit  # noqa: E402
from avionics.configurations import configuration  # noqa: E402

__all__ = ["Cockpit", "configuration", "quantities", "schedules"]
