"""The dashboard drawn from full, partial and empty runs: panels, labels and the data drawn."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest
from matplotlib.figure import Figure
from synthetic import synthetic_run, write_run

from avionics.dashboard import plot
from avionics.dashboard.style import ema, save
from avionics.records import RunWriter, read_run
from avionics.records.series import series

matplotlib.use("Agg")

GROUPS = ("STEP SIZE", "GRADIENTS", "CURVATURE")
PANELS = (
    "Alpha distribution",
    "Distance and update size",
    "Gradient norm",
    "Gradient tests",
    "Gradient element histogram",
    "Gradient/parameter histogram",
    "Largest Hessian eigenvalue",
    "Hessian trace",
    "TIC",
    "Hyperparameters",
    "Performance",
)


def panels(fig) -> dict:
    """Panel title (without a trailing "(step t)") -> its axes."""
    return {ax.get_title().split(" (step")[0]: ax for ax in fig.axes if ax.get_title()}


def is_empty(ax) -> bool:
    return any(t.get_text().startswith("no data") for t in ax.texts)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    run = synthetic_run(60)
    path = tmp_path_factory.mktemp("dashboard") / "cockpit.png"
    fig = plot(run, path)
    assert path.read_bytes().startswith(b"\x89PNG")
    return run, fig


def test_full_run_draws_every_panel_with_data(full):
    _, fig = full
    found = panels(fig)
    assert set(GROUPS + PANELS) <= set(found)
    assert not any(is_empty(found[name]) for name in PANELS)
    assert fig._suptitle.get_text() == "Cockpit: live run (SGD), steps 0-59"
    for name in ("Gradient norm", "Hessian trace", "Largest Hessian eigenvalue"):
        assert found[name].get_xlabel() == "step" and found[name].get_ylabel()


def test_series_panels_draw_the_values_and_their_ema(full):
    run, fig = full
    ax = panels(fig)["Gradient norm"]
    steps, norms = series(run, "GradNorm")
    points = ax.collections[0].get_offsets()
    np.testing.assert_allclose(points[:, 0], steps)
    np.testing.assert_allclose(points[:, 1], norms)
    (line,) = ax.get_lines()
    np.testing.assert_allclose(line.get_ydata(), ema(norms))
    assert norms[0] == pytest.approx(math.sqrt(sum(v * v for v in run.steps[0]["GradNorm"])))
    assert ax.get_legend() is not None

    trace = panels(fig)["Hessian trace"].get_lines()[0].get_ydata()
    np.testing.assert_allclose(trace, ema([sum(v["HessTrace"]) for v in run.steps.values()]))
    assert panels(fig)["Largest Hessian eigenvalue"].get_yscale() == "log"


def test_alpha_histograms_hold_all_values_and_the_latest_tenth(full):
    run, fig = full
    ax = panels(fig)["Alpha distribution"]
    parabola = ax.get_lines()[0]
    np.testing.assert_allclose(parabola.get_ydata(), parabola.get_xdata() ** 2)
    density = next(
        other for other in fig.axes if other.bbox.bounds == ax.bbox.bounds and other is not ax
    )
    heights = [p.get_height() for p in density.patches]
    n_bins = len(heights) // 2
    _, alpha = series(run, "Alpha")
    assert len(alpha) == 59  # the last step's alpha never finishes
    assert sum(heights[:n_bins]) == pytest.approx(1.0)
    assert sum(heights[n_bins:]) == pytest.approx(1.0)
    labels = [t.get_text() for t in density.get_legend().get_texts()]
    assert labels[0].startswith("all: 59 steps") and labels[1].startswith("latest 10 %: 5 steps")


def test_histogram_panels_show_the_latest_step(full):
    run, fig = full
    found = panels(fig)
    hist1d = found["Gradient element histogram"]
    assert hist1d.get_title() == "Gradient element histogram (step 59)"
    heights = [p.get_height() for p in hist1d.patches]
    assert heights == run.steps[59]["GradHist1d"]["hist"]
    assert hist1d.get_yscale() == "log"
    joint = next(ax for ax in fig.axes if ax.get_xlabel() == r"parameter $\theta_d$")
    mesh = joint.collections[0].get_array()
    expected = np.log10(1 + np.asarray(run.steps[59]["GradHist2d"]["hist"]))
    np.testing.assert_allclose(np.asarray(mesh).reshape(expected.shape), expected)


def test_gradient_tests_show_latest_values(full):
    run, fig = full
    legend = next(
        ax.get_legend()
        for ax in fig.axes
        if ax.get_legend() and ax.get_legend().get_title().get_text() == "latest values"
    )
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts[0] == f"norm test: {run.steps[59]['NormTest']:.3g}"
    assert texts[2] == f"ortho test: {run.steps[59]['OrthoTest']:.3g}"


def test_performance_and_hyperparameters(full):
    run, fig = full
    found = panels(fig)
    labels = [t.get_text() for t in found["Performance"].get_legend().get_texts()]
    assert labels[:2] == ["mini-batch loss", "mini-batch loss (EMA)"]
    assert "train accuracy (83.0%)" in labels
    lr_line = found["Hyperparameters"].get_lines()[0]
    assert set(lr_line.get_ydata()) == {0.1}
    assert lr_line.get_xdata()[-1] == 59


def notes(fig) -> list[str]:
    """The texts that name the instruments a column left out."""
    return [t.get_text() for t in fig.texts if t.get_text().startswith("Not recorded")]


def test_a_partial_run_leaves_out_the_panels_it_has_no_data_for_and_names_them(tmp_path):
    economy = ("Loss", "GradNorm", "Distance", "UpdateSize", "Alpha", "NormTest", "InnerTest")
    economy += ("OrthoTest", "GradHist1d")
    fig = plot(read_run(write_run(tmp_path / "run", 20, names=economy)), tmp_path / "c.png")
    found = panels(fig)
    left_out = ("Largest Hessian eigenvalue", "Hessian trace", "TIC")
    left_out += ("Gradient/parameter histogram",)
    assert set(PANELS) - set(left_out) <= set(found)
    assert not set(left_out) & set(found)
    assert not any(is_empty(ax) for ax in fig.axes)
    gradients, curvature = notes(fig)  # one note in each column that left a panel out
    assert "Gradient/parameter histogram: GradHist2d" in gradients
    for line in ("Largest Hessian eigenvalue: HessMaxEV", "Hessian trace: HessTrace"):
        assert line in curvature
    assert "TIC: TICDiag or TICTrace" in curvature
    assert not is_empty(found["Gradient norm"]) and not is_empty(found["Alpha distribution"])


def test_an_empty_log_draws_no_instrument_and_names_them_all(tmp_path):
    RunWriter(tmp_path / "run", {}).close()
    fig = plot(tmp_path / "run", tmp_path / "run" / "cockpit.png")
    found = panels(fig)
    assert not set(PANELS[:9]) & set(found)
    assert {"Hyperparameters", "Performance"} <= set(found)
    texts = notes(fig)
    assert len(texts) == 3
    assert "Gradient tests: NormTest or InnerTest or OrthoTest" in texts[1]
    assert fig._suptitle.get_text() == "Cockpit: run, no steps yet"


def test_non_finite_values_are_marked_not_dropped_silently():
    run = synthetic_run(30, names=("Loss", "GradNorm"))
    run.steps[10]["Loss"] = math.nan
    run.steps[20]["GradNorm"] = [math.inf, 1.0, 1.0]
    found = panels(plot(run))
    for name, label in (("Performance", "mini-batch loss"), ("Gradient norm", "gradient norm")):
        labels = [t.get_text() for t in found[name].get_legend().get_texts()]
        assert f"{label}: non-finite" in labels


def test_saves_png_pdf_svg_and_refuses_other_suffixes(tmp_path):
    fig = Figure()
    fig.add_subplot().plot([1, 2])
    for suffix, head in {"png": b"\x89PNG", "pdf": b"%PDF", "svg": b"<?xml"}.items():
        save(fig, tmp_path / f"cockpit.{suffix}")
        assert (tmp_path / f"cockpit.{suffix}").read_bytes().startswith(head)
    with pytest.raises(ValueError, match=r"ending in \.png, \.pdf, \.svg"):
        plot(synthetic_run(2), tmp_path / "cockpit.jpg")
    assert not (tmp_path / "cockpit.jpg").exists()


def test_draws_a_live_cockpit_and_refuses_other_sources():
    class FakeCockpit:
        def get_output(self):
            return {1: {"Loss": 1.0}, 0: {"Loss": 2.0}}

    found = panels(plot(FakeCockpit()))
    np.testing.assert_allclose(found["Performance"].collections[0].get_offsets(), [[0, 2], [1, 1]])
    with pytest.raises(TypeError, match="pass a run directory or log path"):
        plot(42)


def test_ema_uses_weight_two_tenths_and_skips_non_finite():
    np.testing.assert_allclose(ema(np.array([1.0, 2.0, math.nan, 3.0])), [1.0, 1.2, 1.2, 1.56])
    assert math.isnan(ema(np.array([math.nan, 1.0]))[0])
