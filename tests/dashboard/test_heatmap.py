"""The layers x steps heat-map: the values drawn per module (or parameter), the log colour,
the module names on the axis (thinned out for many layers) and the steps to scale."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from matplotlib.colors import LogNorm, SymLogNorm
from matplotlib.figure import Figure

from avionics.dashboard.heatmap import MAX_LABELS, heatmap_panel, label_rows, step_edges
from avionics.dashboard.style import save
from avionics.quantities import GradNorm
from avionics.records import Run

matplotlib.use("Agg")
MODULES = 60
STEPS = [0, 1, 2, 4, 7, 12, 20, 33, 54, 90]  # a logarithmic schedule


def norm(module: int, step: int) -> float:
    return 10.0 ** (-module / 12) * (1 + step / 100)


def ratio(parameter: int, step: int) -> float:
    return 0.1 + 0.01 * parameter


def deep_run(test=ratio) -> Run:
    """GradNorm of a 60-module network (a weight and a bias each) and NormTest per layer."""
    names = [f"layers.{m}.{kind}" for m in range(MODULES) for kind in ("weight", "bias")]
    metadata = {
        "parameters": {name: [2] for name in names},
        "outputs": {"GradNorm": GradNorm.output.describe(), "NormTest": {"kind": "per_layer"}},
    }
    steps = {}
    for step in STEPS:
        norms = [norm(m, step) * share for m in range(MODULES) for share in (0.8, 0.6)]
        tests = {"global": 0.3, "per_parameter": [test(k, step) for k in range(len(names))]}
        steps[step] = {"GradNorm": norms, "NormTest": tests}
    return Run.from_output(steps, metadata)


def panel(run, name, label=None):
    fig = Figure(figsize=(10, 12))
    return fig, heatmap_panel(fig, fig.add_gridspec(1, 1)[0], run, name, label)


def test_a_deep_network_s_gradient_norms_per_module_with_log_colour(tmp_path):
    run = deep_run()
    fig, ax = panel(run, "GradNorm", "Gradient norm")
    path = save(fig, tmp_path / "heatmap.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    assert ax.get_title() == "Gradient norm per module"
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "module"
    (mesh,) = ax.collections
    # rows: modules, the RSS of their weight's and bias's norms; columns: steps
    expected = [[norm(m, s) for s in STEPS] for m in range(MODULES)]
    np.testing.assert_allclose(mesh.get_array().reshape(MODULES, len(STEPS)), expected)
    assert isinstance(mesh.norm, LogNorm)
    assert mesh.norm.vmin == pytest.approx(10.0 ** (-59 / 12)) and mesh.norm.vmax == 1.9
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) <= MAX_LABELS and labels[:2] == ["layers.0", "layers.2"]
    assert ax.get_ylim() == (MODULES, 0)  # the first module on top
    edges = mesh.get_coordinates()[0, :, 0]
    np.testing.assert_allclose(edges, step_edges(np.array(STEPS)))


def test_a_per_layer_ratio_is_drawn_per_parameter():
    run = deep_run()
    _, ax = panel(run, "NormTest")
    assert ax.get_title() == "NormTest per parameter" and ax.get_ylabel() == "parameter"
    (mesh,) = ax.collections
    column = [ratio(k, STEPS[3]) for k in range(2 * MODULES)]
    np.testing.assert_allclose(mesh.get_array().reshape(2 * MODULES, len(STEPS))[:, 3], column)
    assert ax.get_yticklabels()[0].get_text() == "layers.0.weight"


def test_negative_values_get_a_symmetric_log_colour_and_non_finite_ones_none():
    def test(parameter, step):
        return float("nan") if parameter == 3 else (-1) ** parameter * 10.0 ** (parameter % 5)

    _, ax = panel(deep_run(test), "NormTest")
    (mesh,) = ax.collections
    assert isinstance(mesh.norm, SymLogNorm)
    assert (mesh.norm.vmin, mesh.norm.vmax, mesh.norm.linthresh) == (-1e4, 1e4, 1)
    values = mesh.get_array().reshape(2 * MODULES, len(STEPS))
    assert values.mask[3].all() and not values.mask[4].any()
    assert (values[6, 0], values[7, 0]) == (10, -100)


def test_without_per_parameter_values_the_panel_says_what_it_needs():
    _, ax = panel(Run.from_output({0: {"Loss": 1.0}}), "UpdateSize", "Update size")
    assert ax.get_title() == "Update size per parameter"
    assert ax.texts[0].get_text() == "no data\n(needs UpdateSize)"


def test_step_edges_and_label_rows():
    np.testing.assert_allclose(step_edges(np.array([0, 2, 6])), [-1, 1, 4, 8])
    np.testing.assert_allclose(step_edges(np.array([5])), [4.5, 5.5])
    assert label_rows(10) == list(range(10))
    assert label_rows(120) == list(range(0, 120, 4))
