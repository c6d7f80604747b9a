"""The secondary screen: MeanGSNR, CABS, EarlyStopping, the gradient noise scale and one 2d
histogram per parameter."""

from __future__ import annotations

import matplotlib
import numpy as np
from synthetic import synthetic_run

from avionics.dashboard import plot_secondary
from avionics.dashboard.style import ema
from avionics.records import Run
from avionics.records.series import series

matplotlib.use("Agg")
SERIES = (
    "Mean gradient signal-to-noise ratio",
    "CABS batch-size suggestion",
    "Early-stopping criterion",
    "Gradient noise scale",
)


def titles(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def test_full_run_draws_series_and_named_per_parameter_histograms(tmp_path):
    run = synthetic_run(20)
    run.metadata["parameters"] = {"0.weight": [2, 2], "0.bias": [2], "1.weight": [1, 2]}
    fig = plot_secondary(run, tmp_path / "secondary.png")
    assert (tmp_path / "secondary.png").read_bytes().startswith(b"\x89PNG")
    found = titles(fig)
    assert {"AUXILIARY", "PER PARAMETER", *SERIES} <= set(found)
    for name in run.metadata["parameters"]:
        assert f"{name} (step 19)" in found
    steps, cabs = series(run, "CABS")
    ax = found["CABS batch-size suggestion"]
    np.testing.assert_allclose(ax.collections[0].get_offsets()[:, 1], cabs)
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), ema(cabs))
    stop_line = found["Early-stopping criterion"].get_lines()[-1]
    assert stop_line.get_label() == "stop above this line" and list(stop_line.get_ydata()) == [
        0,
        0,
    ]
    joints = [ax for ax in fig.axes if ax.get_xlabel() == r"parameter $\theta_d$"]
    assert len(joints) == 3
    expected = np.log10(1 + np.asarray(run.steps[19]["GradHist2d"]["param_hist"][1]))
    np.testing.assert_allclose(np.asarray(joints[1].collections[0].get_array()), expected)


def test_run_without_its_quantities_draws_empty_labelled_panels():
    fig = plot_secondary(Run.from_output({0: {"Loss": 1.0}}))
    found = titles(fig)
    for title in SERIES + ("Gradient/parameter histogram per parameter",):
        assert any(t.get_text().startswith("no data") for t in found[title].texts), title
        assert found[title].get_xlabel() and found[title].get_ylabel()


def test_noise_scale_panel_draws_the_smoothed_values_against_the_batch_size():
    run = synthetic_run(20)
    for step, values in run.steps.items():
        values["GradientNoiseScale"] = 10.0 * 1.3**step
    ax = titles(plot_secondary(run))["Gradient noise scale"]
    steps, values = series(run, "GradientNoiseScale")
    np.testing.assert_allclose(ax.collections[0].get_offsets(), np.column_stack([steps, values]))
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "step"
    assert ax.get_lines() == []  # the batch size is not known: no reference line

    run.metadata["batch_size"] = 32
    ax = titles(plot_secondary(run))["Gradient noise scale"]
    (line,) = ax.get_lines()
    assert line.get_label() == "batch size (32)" and list(line.get_ydata()) == [32, 32]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["smoothed noise scale", "batch size (32)"]
