"""The version of avionics (read by the package and written into every run log)."""

__version__ = "0.1.0"
