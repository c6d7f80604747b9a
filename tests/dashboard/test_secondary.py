"""The secondary screen: the layers x steps heat-maps of every preset's per-parameter
quantities, MeanGSNR, CABS, EarlyStopping and the gradient noise scale where recorded, what is
not recorded with the quantity that adds it, and one 2d histogram per parameter."""

from __future__ import annotations

import matplotlib
import models
import numpy as np
import pytest
import torch
from synthetic import synthetic_run

from avionics import Cockpit, configuration, quantities, read_run
from avionics.dashboard import plot_secondary
from avionics.dashboard.secondary import NOT_RECORDED, TO_ADD
from avionics.dashboard.style import ema
from avionics.records import Run
from avionics.records.series import per_module, series

matplotlib.use("Agg")
SERIES = (
    "Mean gradient signal-to-noise ratio",
    "CABS batch-size suggestion",
    "Early-stopping criterion",
    "Gradient noise scale",
)
FRAMES = ("PER LAYER", "AUXILIARY", "PER PARAMETER", "YOUR INSTRUMENTS")


def titles(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def not_recorded(fig) -> str:
    """The text of the panel that lists what is not recorded, its wrapped lines joined."""
    return titles(fig)[NOT_RECORDED].texts[0].get_text().replace("\n    ", " ")


def preset_run(tmp_path, preset: str, instead=()) -> Run:
    """Three steps of the MLP watched by ``preset`` (with the quantities ``instead`` in place
    of those of the same names), read from its log."""
    model, X, y, loss_fn = models.mlp(n=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    replaced = {q.name: q for q in instead}
    chosen = [replaced.get(q.name, q) for q in configuration(preset)]
    cockpit = Cockpit(model, chosen, log=tmp_path / preset)
    for step in range(3):
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 6}
        with cockpit(step, info={**info, "optimizer": opt}):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        opt.step()
    cockpit.close()
    return read_run(tmp_path / preset)


@pytest.mark.parametrize("preset", ["economy", "business", "full"])
def test_every_preset_draws_heatmaps_and_says_what_is_not_recorded(tmp_path, preset):
    run = preset_run(tmp_path, preset)
    if preset == "full":  # (writing a PNG takes seconds: once)
        path = tmp_path / "secondary.png"
        fig = plot_secondary(run, path)
        assert path.read_bytes().startswith(b"\x89PNG")
    else:
        fig = plot_secondary(run)
    found = titles(fig)
    heatmaps = {"GradNorm": "Gradient norm", "UpdateSize": "Update size", "Distance": "Distance"}
    if preset != "economy":
        heatmaps["HessTrace"] = "HessTrace"
    for name, label in heatmaps.items():
        ax = found[f"{label} per module"]
        (mesh,) = ax.collections
        expected = per_module(run, name)
        assert expected.labels == ["0", "2", "4"]
        assert [t.get_text() for t in ax.get_yticklabels()] == expected.labels
        # (a zero, Distance at step 0, has no logarithm: drawn as the smallest value)
        drawn = np.maximum(expected.values, mesh.norm.vmin)
        np.testing.assert_allclose(mesh.get_array().ravel(), drawn.ravel())
        assert not np.ma.getmaskarray(mesh.get_array()).any()
    # no preset has the auxiliary instruments: one panel lists them with what to add
    assert not any(title in found for title in SERIES)
    text = not_recorded(fig)
    for what in ("MeanGSNR", "CABS", "EarlyStopping", "GradientNoiseScale"):
        assert f"{what}: {TO_ADD[what]}" in text
    # full's GradHist2d keeps no per-parameter histograms by default
    assert "per-parameter histograms: quantities.GradHist2d(per_parameter=True)" in text
    assert "PER PARAMETER" not in found


def test_per_layer_quantities_get_a_heatmap_and_leave_the_list(tmp_path):
    run = preset_run(tmp_path, "economy", [quantities.NormTest(per_layer=True)])
    fig = plot_secondary(run)
    ax = titles(fig)["NormTest per parameter"]
    assert [t.get_text() for t in ax.get_yticklabels()] == run.parameter_names
    (mesh,) = ax.collections
    expected = [run.steps[step]["NormTest"]["per_parameter"] for step in range(3)]
    np.testing.assert_allclose(mesh.get_array(), np.transpose(expected))
    assert "per-layer gradient tests" not in not_recorded(fig)


def test_full_synthetic_run_draws_series_and_named_per_parameter_histograms(tmp_path):
    run = synthetic_run(20)
    run.metadata["parameters"] = {"0.weight": [2, 2], "0.bias": [2], "1.weight": [1, 2]}
    fig = plot_secondary(run, tmp_path / "secondary.png")
    assert (tmp_path / "secondary.png").read_bytes().startswith(b"\x89PNG")
    found = titles(fig)
    assert {"PER LAYER", "AUXILIARY", "PER PARAMETER", *SERIES[:3]} <= set(found)
    for name in run.metadata["parameters"]:
        assert f"{name} (step 19)" in found
    steps, cabs = series(run, "CABS")
    ax = found["CABS batch-size suggestion"]
    np.testing.assert_allclose(ax.collections[0].get_offsets()[:, 1], cabs)
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), ema(cabs))
    stop_line = found["Early-stopping criterion"].get_lines()[-1]
    assert stop_line.get_label() == "stop above this line"
    assert list(stop_line.get_ydata()) == [0, 0]
    joints = [ax for ax in fig.axes if ax.get_xlabel() == r"parameter $\theta_d$"]
    assert len(joints) == 3
    expected = np.log10(1 + np.asarray(run.steps[19]["GradHist2d"]["param_hist"][1]))
    np.testing.assert_allclose(np.asarray(joints[1].collections[0].get_array()), expected)
    # GradNorm's module "0" is the RSS of its two parameters' norms
    (mesh,) = found["Gradient norm per module"].collections
    first = run.steps[0]["GradNorm"]
    assert mesh.get_array()[0, 0] == pytest.approx(np.hypot(first[0], first[1]))
    assert not_recorded(fig).count("\n") >= 3  # the noise scale and per-layer tests lack


def test_a_run_without_its_quantities_draws_labelled_empty_heatmaps_and_the_list():
    fig = plot_secondary(Run.from_output({0: {"Loss": 1.0}}))
    found = titles(fig)
    for title in ("Gradient norm per parameter", "Update size per parameter"):
        assert found[title].texts[0].get_text().startswith("no data")
        assert found[title].get_xlabel() and found[title].get_ylabel()
    text = not_recorded(fig)
    for what, to_add in TO_ADD.items():
        assert f"{what}: {to_add}" in text


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
