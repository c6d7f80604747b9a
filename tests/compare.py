"""One comparison of nested cockpit outputs for the tests that run the same training twice."""

from __future__ import annotations

import math

import pytest


def assert_same_output(ours, expected, rel: float, abs: float = 1e-12, where=()) -> None:
    """``ours`` equals ``expected`` through their dicts (the same keys), lists and tuples (the
    same lengths): floats to relative ``rel`` and absolute ``abs`` (nan equals nan), every
    other value (ints such as histogram counts, strings, None) exactly. ``where`` is the path
    the assertion messages name."""
    if isinstance(expected, dict):
        assert set(ours) == set(expected), (where, set(ours) ^ set(expected))
        for key in expected:
            assert_same_output(ours[key], expected[key], rel, abs, (*where, key))
    elif isinstance(expected, list | tuple):
        assert len(ours) == len(expected), where
        for i, (a, b) in enumerate(zip(ours, expected, strict=True)):
            assert_same_output(a, b, rel, abs, (*where, i))
    elif isinstance(expected, float):
        if math.isnan(expected):
            assert isinstance(ours, float) and math.isnan(ours), (where, ours, expected)
        else:
            assert ours == pytest.approx(expected, rel=rel, abs=abs), (where, ours, expected)
    else:
        assert ours == expected, (where, ours, expected)
