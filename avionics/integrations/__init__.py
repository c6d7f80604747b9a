"""The cockpit inside training frameworks: :mod:`avionics.integrations.lightning` (Lightning).

Each integration imports its framework itself, on import of its own module only.
"""
