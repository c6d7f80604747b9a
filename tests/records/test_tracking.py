"""What the tracker sinks show of a step (avionics.records.tracking), without the trackers:
scalars, per-parameter numbers by parameter name, histograms and their marginals, the
metadata as parameters."""

from __future__ import annotations

import numpy as np

from avionics.records.tracking import Tracking, flat_parameters

METADATA = {
    "model": "MLP",
    "parameters": {"0.weight": [3, 2], "0.bias": [3]},
    "outputs": {
        "GradNorm": {"kind": "per_parameter", "reduce": "rss"},
        "HessTrace": {"kind": "per_parameter", "reduce": "sum"},
        "Own": {"kind": "scalar"},
    },
}


def test_values_read_as_scalars_per_parameter_numbers_and_histograms():
    tracking = Tracking()
    tracking.update_metadata(METADATA)
    hist2d = {"hist": [[1, 0, 2], [3, 4, 0]], "edges": [[-1.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0]]}
    tracked = tracking.read(
        {
            "Loss": 0.5,
            "GradNorm": [3.0, 4.0],
            "HessTrace": [1.5, -0.5],
            "UpdateRatio": {"global": 0.01, "per_parameter": [0.02, 0.005]},
            "GradHist1d": {"hist": [1, 2, 3], "edges": [0.0, 1.0, 2.0, 3.0]},
            "GradHist2d": hist2d,
            "Parameters": [[0.1, 0.2]],  # tensors: no number to chart
            "Own": 7,
        }
    )
    assert tracked.scalars == {
        "Loss": 0.5,
        "GradNorm": 5.0,  # the root of the sum of squares
        "HessTrace": 1.0,  # the sum
        "UpdateRatio": 0.01,
        "Own": 7.0,
    }
    assert tracked.parameters == {
        "GradNorm": {"0.weight": 3.0, "0.bias": 4.0},
        "HessTrace": {"0.weight": 1.5, "0.bias": -0.5},
        "UpdateRatio": {"0.weight": 0.02, "0.bias": 0.005},
    }
    assert set(tracked.histograms) == {"GradHist1d", "GradHist2d/gradient", "GradHist2d/parameter"}
    counts, edges = tracked.histograms["GradHist2d/gradient"]
    assert counts.tolist() == [3, 7] and edges.tolist() == [-1.0, 0.0, 1.0]
    counts, edges = tracked.histograms["GradHist2d/parameter"]
    assert counts.tolist() == [4, 4, 2] and edges.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_parameters_without_names_are_numbered_and_empty_histograms_left_out():
    tracking = Tracking()  # no metadata: the built-in outputs, no parameter names
    tracked = tracking.read(
        {"GradNorm": [1.0, 2.0, 2.0], "GradHist1d": {"hist": [0, 0], "edges": [0.0, 1.0, 2.0]}}
    )
    assert tracked.scalars == {"GradNorm": 3.0}
    assert tracked.parameters == {"GradNorm": {"param_0": 1.0, "param_1": 2.0, "param_2": 2.0}}
    assert tracked.histograms == {}
    assert not tracking.counted_histogram("GradHist1d", {"hist": [0, 0], "edges": [0, 1, 2]})
    assert tracking.counted_histogram("GradHist1d", {"hist": [0, 1], "edges": [0, 1, 2]})


def test_non_finite_numbers_are_shown_as_they_are():
    tracked = Tracking().read({"Loss": float("nan"), "GradNorm": [float("inf"), 1.0]})
    assert np.isnan(tracked.scalars["Loss"]) and tracked.scalars["GradNorm"] == float("inf")


def test_metadata_flattens_to_named_strings():
    metadata = {
        **METADATA,
        "world_size": 1,
        "optimizer": {"name": "SGD", "param_groups": [{"lr": 0.1, "nesterov": False}]},
        "note": None,
    }
    assert flat_parameters(metadata, skip=("parameters", "outputs")) == {
        "model": "MLP",
        "world_size": "1",
        "optimizer.name": "SGD",
        "optimizer.param_groups.0.lr": "0.1",
        "optimizer.param_groups.0.nesterov": "False",
    }
