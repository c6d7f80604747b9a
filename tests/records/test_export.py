"""Exports: CSV of the scalar series, the reference tool's JSON, TensorBoard events."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from synthetic import write_run

from avionics.records import (
    read_cockpit_json,
    read_run,
    to_cockpit_json,
    to_csv,
    to_tensorboard,
)


@pytest.fixture
def run(tmp_path):
    return read_run(write_run(tmp_path / "run", num_steps=12))


def test_csv_has_the_scalar_series_and_per_parameter_columns(run, tmp_path):
    run.steps[3]["Loss"] = math.nan
    with open(to_csv(run, tmp_path / "run.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(run.steps)
    header = list(rows[0])
    for name in ("Loss", "Alpha", "GradNorm", "GradNorm[2]", "HessTrace[0]", "learning_rate"):
        assert name in header
    for name in ("GradHist1d", "GradHist2d", "Parameters"):
        assert not any(h.startswith(name) for h in header)
    assert float(rows[0]["Loss"]) == run.steps[0]["Loss"]
    assert rows[3]["Loss"] == "nan"
    norms = run.steps[5]["GradNorm"]
    assert float(rows[5]["GradNorm"]) == pytest.approx(math.sqrt(sum(v * v for v in norms)))
    assert float(rows[5]["GradNorm[1]"]) == norms[1]
    assert float(rows[5]["HessTrace"]) == pytest.approx(sum(run.steps[5]["HessTrace"]))
    assert rows[11]["Alpha"] == ""  # the last step's alpha never finished
    assert rows[1]["valid_accuracy"] == ""  # logged every 10 steps only


def test_cockpit_json_is_what_json_tricks_reads(run, tmp_path):
    json_tricks = pytest.importorskip("json_tricks")
    run.steps[2]["Alpha"] = math.nan
    with open(to_cockpit_json(run, tmp_path / "run.json")) as f:
        data = json_tricks.load(f)
    assert sorted(data, key=int) == [str(s) for s in run.steps]
    hist1d = data["0"]["GradHist1d"]
    assert isinstance(hist1d["hist"], np.ndarray) and hist1d["hist"].shape == (100,)
    np.testing.assert_array_equal(hist1d["edges"], run.steps[0]["GradHist1d"]["edges"])
    hist2d = data["0"]["GradHist2d"]
    assert hist2d["hist"].shape == (40, 50)
    xedges, yedges = hist2d["edges"]
    assert xedges.shape == (41,) and yedges.shape == (51,)
    assert hist2d["param_groups"] == 3 and hist2d["param_2"]["hist"].shape == (40, 50)
    assert data["0"]["epoch_count"] == 0 and "epoch" not in data["0"]
    assert data["0"]["GradNorm"] == run.steps[0]["GradNorm"]
    assert math.isnan(data["2"]["Alpha"])


def test_cockpit_json_reads_back_into_the_same_run(run, tmp_path):
    back = read_cockpit_json(to_cockpit_json(run, tmp_path / "run.json"))
    assert back.steps == run.steps
    assert read_run(tmp_path / "run.json").steps == run.steps


def test_reference_plotter_draws_our_export(run, tmp_path):
    pytest.importorskip("cockpit")
    import matplotlib

    matplotlib.use("Agg")
    from cockpit import CockpitPlotter

    for values in run.steps.values():
        values.pop("TICTrace")  # the reference's TIC gauge crashes on it (no cmap_backup)
    to_cockpit_json(run, tmp_path / "run.json")
    plotter = CockpitPlotter(secondary_screen=True)
    plotter.plot(str(tmp_path / "run"), show_plot=False, save_plot=True, savedir=str(tmp_path))
    titles = {ax.get_title() for ax in plotter.fig.axes}
    assert {"Alpha Distribution", "Gradient Tests", "Max Eigenvalue", "TIC"} <= titles
    assert (tmp_path / "cockpit__primary.png").stat().st_size > 0
    assert (tmp_path / "cockpit__secondary.png").stat().st_size > 0


def test_tensorboard_events_read_back(run, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    to_tensorboard(run, tmp_path / "tb")
    events = EventAccumulator(
        str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0}
    ).Reload()
    tags = events.Tags()
    loss = events.Scalars("Loss")
    assert [e.step for e in loss] == list(run.steps)
    assert [e.value for e in loss] == pytest.approx([v["Loss"] for v in run.steps.values()])
    assert "GradNorm/param_2" in tags["scalars"] and "valid_accuracy" in tags["scalars"]
    assert {"GradHist1d", "GradHist2d/gradient", "GradHist2d/parameter"} <= set(tags["histograms"])
    first = events.Histograms("GradHist1d")[0]
    assert first.step == 0
    hist = first.histogram_value
    assert hist.num == sum(run.steps[0]["GradHist1d"]["hist"])
    assert list(hist.bucket) == run.steps[0]["GradHist1d"]["hist"]
