"""The built-in schedules: the steps they track, and their refusal of nonsensical arguments."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from avionics.schedules import describe, linear, logarithmic

STEPS = range(2000)


def tracked(schedule) -> list[int]:
    return [s for s in STEPS if schedule(s)]


@pytest.mark.parametrize("interval, offset", [(1, 0), (3, 0), (7, 3), (1, 5), (500, 1999)])
def test_linear_tracks_offset_plus_multiples_of_the_interval(interval, offset):
    expected = [offset + k * interval for k in range(len(STEPS)) if offset + k * interval in STEPS]
    assert tracked(linear(interval, offset=offset)) == expected


@pytest.mark.parametrize(
    "start, end, steps, base",
    [(0, 2, 5, 10), (0, 3, 40, 10), (1, 6, 17, 2), (-1, 2.5, 33, math.e), (0.5, 3, 300, 10)],
)
@pytest.mark.parametrize("init", [True, False])
def test_logarithmic_tracks_the_integers_of_the_log_grid(start, end, steps, base, init):
    """The integer parts of base**(start + k (end - start) / (steps - 1)), k < steps, in
    float64, plus step 0 with init."""
    grid = {math.floor(base ** (start + k * (end - start) / (steps - 1))) for k in range(steps)}
    expected = sorted((grid | {0}) if init else grid)
    assert tracked(logarithmic(start, end, steps=steps, base=base, init=init)) == [
        s for s in expected if s in STEPS
    ]


def test_boundary_arguments_are_accepted():
    assert tracked(linear(np.int64(4), offset=np.int32(0)))[:3] == [0, 4, 8]
    assert tracked(logarithmic(2, 2, steps=1, init=False)) == [100]
    assert tracked(logarithmic(np.float32(0), np.int64(1), steps=2, base=1.5)) == [0, 1]
    assert describe(logarithmic(0, 18.96, steps=2)).startswith("logarithmic(start=0, end=18.96")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"interval": 0}, ValueError, r"linear\(interval=\.\.\.\) needs an integer >= 1, got 0"),
        ({"interval": -3}, ValueError, r"interval=\.\.\.\) needs an integer >= 1, got -3"),
        ({"interval": 2.0}, TypeError, r"interval=\.\.\.\) needs an integer >= 1, got 2\.0"),
        ({"interval": "2"}, TypeError, r"interval=\.\.\.\) needs an integer >= 1, got '2'"),
        ({"interval": True}, TypeError, r"interval=\.\.\.\) needs an integer >= 1, got True"),
        ({"interval": None}, TypeError, r"interval=\.\.\.\) needs an integer >= 1, got None"),
        ({"interval": 2, "offset": -1}, ValueError, r"offset=\.\.\.\) needs an integer >= 0"),
        ({"interval": 2, "offset": 1.5}, TypeError, r"offset=\.\.\.\) needs an integer >= 0"),
        ({"interval": 2, "offset": False}, TypeError, r"offset=\.\.\.\) .* got False"),
    ],
)
def test_linear_refuses_nonsensical_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        linear(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"base": -10}, ValueError, r"logarithmic\(base=\.\.\.\) needs a number > 1 .* got -10"),
        ({"base": 0}, ValueError, r"base=\.\.\.\) needs a number > 1 .* got 0"),
        ({"base": 1}, ValueError, r"base=\.\.\.\) needs a number > 1 .* got 1"),
        ({"base": 0.5}, ValueError, r"base=\.\.\.\) needs a number > 1 .* got 0\.5"),
        ({"base": math.inf}, ValueError, r"base=\.\.\.\) needs a finite real number, got inf"),
        ({"base": "10"}, TypeError, r"base=\.\.\.\) needs a finite real number, got '10'"),
        ({"steps": 0}, ValueError, r"logarithmic\(steps=\.\.\.\) needs an integer >= 1, got 0"),
        ({"steps": -1}, ValueError, r"steps=\.\.\.\) needs an integer >= 1, got -1"),
        ({"steps": 2.5}, TypeError, r"steps=\.\.\.\) needs an integer >= 1, got 2\.5"),
        ({"steps": True}, TypeError, r"steps=\.\.\.\) needs an integer >= 1, got True"),
        ({"start": math.nan}, ValueError, r"start=\.\.\.\) needs a finite real number, got nan"),
        ({"start": -math.inf}, ValueError, r"start=\.\.\.\) needs a finite .* got -inf"),
        ({"start": None}, TypeError, r"start=\.\.\.\) needs a finite real number, got None"),
        ({"end": math.nan}, ValueError, r"end=\.\.\.\) needs a finite real number, got nan"),
        ({"end": "2"}, TypeError, r"end=\.\.\.\) needs a finite real number, got '2'"),
        ({"end": False}, TypeError, r"end=\.\.\.\) needs a finite real number, got False"),
        ({"start": 3, "end": 1}, ValueError, r"start <= end, got start=3, end=1"),
        ({"end": 19}, ValueError, r"end=\.\.\.\) needs base\*\*end < 2\*\*63 .* got end=19"),
        ({"end": 64, "base": 2}, ValueError, r"needs base\*\*end < 2\*\*63 .* end=64 with base=2"),
        ({"end": 1e308}, ValueError, r"end=\.\.\.\) needs base\*\*end < 2\*\*63"),
        ({"init": 1}, TypeError, r"logarithmic\(init=\.\.\.\) needs True or False, got 1"),
        ({"init": None}, TypeError, r"init=\.\.\.\) needs True or False, got None"),
    ],
)
def test_logarithmic_refuses_nonsensical_arguments(kwargs, error, match):
    arguments = {"start": 0, "end": 2, **kwargs}
    with pytest.raises(error, match=match):
        logarithmic(**arguments)


@pytest.mark.parametrize("schedule", [linear(3, offset=1), logarithmic(0, 2, steps=5)])
def test_a_schedule_pickles_with_its_steps(schedule):
    """A spawned process (Lightning's ddp_spawn, multiprocessing) receives the quantities
    pickled: their schedules must pickle and keep their steps and description."""
    copy = pickle.loads(pickle.dumps(schedule))
    assert [copy(s) for s in range(200)] == [schedule(s) for s in range(200)]
    assert describe(copy) == describe(schedule)
