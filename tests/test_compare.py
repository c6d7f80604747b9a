"""``avionics compare``: several runs overlaid, each a colour and a legend label; its figure
(:func:`avionics.dashboard.compare.plot_compare`) and its command line, in process."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from synthetic import PER_STEP, write_run
from test_cli import in_process

from avionics.dashboard.compare import (
    PANELS,
    plot_compare,
    run_colors,
    run_labels,
    symlog_ticks,
    value_scale,
)
from avionics.dashboard.style import ema
from avionics.records import Run, RunWriter, read_run
from avionics.records.series import series

CURVATURE = ("HessMaxEV", "HessTrace", "TICDiag", "TICTrace")
TITLES = {quantity: title for _, quantity, title, _ in PANELS}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> list[Path]:
    """Three runs of a sweep: sweep/lr-0.1, sweep/lr-0.3 and sweep/lr-1, the last without
    the curvature instruments."""
    root = tmp_path_factory.mktemp("sweep") / "sweep"
    without_curvature = tuple(n for n in PER_STEP if n not in CURVATURE)
    return [
        write_run(root / "lr-0.1", num_steps=40, seed=0),
        write_run(root / "lr-0.3", num_steps=50, seed=1),
        write_run(root / "lr-1", num_steps=30, seed=2, names=without_curvature),
    ]


def panels(fig) -> dict:
    """Panel title -> its axes."""
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def legend_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_each_run_is_a_colour_with_its_name_and_each_panel_overlays_them(sweep):
    fig = plot_compare(sweep)
    assert legend_labels(fig) == ["lr-0.1", "lr-0.3", "lr-1"]
    assert fig.legends[0].get_title().get_text() == "Cockpit: 3 runs compared, steps 0-49"
    colours = [tuple(h.get_color()) for h in fig.legends[0].legend_handles]
    assert len(set(colours)) == 3
    found = panels(fig)
    runs = [read_run(path) for path in sweep]
    for quantity in ("Loss", "GradNorm", "Alpha", "NormTest", "MeanGSNR", "HessTrace"):
        lines = found[TITLES[quantity]].get_lines()
        drawn = [run for run in runs if len(series(run, quantity)[0])]
        # one EMA line per run that recorded it, in the run's colour, over its steps
        assert len(lines) == len(drawn)
        for run, line in zip(drawn, lines):
            steps, values = series(run, quantity)
            colour = colours[runs.index(run)]
            assert tuple(line.get_color()) == colour
            np.testing.assert_array_equal(line.get_xdata(), steps)
            np.testing.assert_allclose(line.get_ydata(), ema(values), rtol=1e-12)
    # every panel has data, and those that not every run recorded say which did not
    assert all(ax.get_lines() for ax in found.values())
    for quantity in CURVATURE:
        assert [t.get_text() for t in found[TITLES[quantity]].texts] == ["not recorded by lr-1"]
    assert not found[TITLES["Loss"]].texts
    # the panels in the dashboard's order, the logged metrics too; no bookkeeping panel
    titles = list(found)
    assert titles.index("Mini-batch loss") < titles.index("Gradient norm")
    assert titles.index("Gradient norm") < titles.index("Hessian trace")
    assert "Validation accuracy" in titles and "epoch" not in titles
    # a metric logged every 10 steps: its points joined, not an EMA that lags behind them
    for run, line in zip(runs, found["Validation accuracy"].get_lines()):
        steps, values = series(run, "valid_accuracy")
        assert line.get_marker() == "o" and len(steps) < 20
        np.testing.assert_array_equal(line.get_ydata(), values)
    # wall-clock times start at each run's first step
    since_first = found["Time since the first step"].get_lines()
    assert len(since_first) == 3 and all(line.get_ydata()[0] == 0 for line in since_first)
    # one step axis for all: every panel spans the longest run
    limits = {ax.get_xlim() for ax in found.values()}
    assert len(limits) == 1 and limits.pop()[1] > 49


def test_labels_are_given_or_told_apart_by_their_folders(tmp_path):
    a = write_run(tmp_path / "sweep-a" / "run", num_steps=5)
    b = write_run(tmp_path / "sweep-b" / "run", num_steps=5)
    assert run_labels([read_run(a), read_run(b)]) == ["sweep-a/run", "sweep-b/run"]
    fig = plot_compare([a, b], labels=["adam", "sgd"])
    assert legend_labels(fig) == ["adam", "sgd"]
    with pytest.raises(ValueError, match="give each run its own label"):
        plot_compare([a, b], labels=["adam"])
    with pytest.raises(ValueError, match="give each run its own label"):
        plot_compare([a, b], labels=["adam", "adam"])


def test_a_diverging_run_puts_the_panel_on_a_log_scale_with_readable_labels(tmp_path):
    healthy = {s: {"Loss": 2.0 / (s + 1), "Alpha": 0.1 * math.sin(s)} for s in range(30)}
    diverging = {s: {"Loss": 10.0 ** (s / 2), "Alpha": (-1) ** s * 10.0**s} for s in range(30)}
    diverging[29]["Loss"] = float("nan")
    runs = [Run.from_output(healthy), Run.from_output(diverging)]
    path = tmp_path / "compare.png"
    fig = plot_compare(runs, path)
    assert path.read_bytes().startswith(b"\x89PNG")
    assert legend_labels(fig) == ["run 1", "run 2"]
    found = panels(fig)
    assert found["Mini-batch loss"].get_yscale() == "log"
    assert found["Alpha"].get_yscale() == "symlog"
    # the NaN loss of step 29 is a tick on the step axis, in the run's colour
    ticks = [line for line in found["Mini-batch loss"].get_lines() if line.get_marker() == "|"]
    assert len(ticks) == 1 and list(ticks[0].get_xdata()) == [29]
    # no label outside the figure, no two tick labels of an axis over each other
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    box = fig.bbox
    for ax in found.values():
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label]
        for text in texts:
            extent = text.get_window_extent(renderer)
            assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and extent.y1 <= box.y1
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            shown = [
                t.label1.get_window_extent(renderer)
                for t in axis.get_major_ticks()
                if low <= t.get_loc() <= high and t.label1.get_text()
            ]
            for i, first in enumerate(shown):
                assert not any(first.overlaps(other) for other in shown[i + 1 :])


def test_every_run_has_its_own_colour():
    for count in (2, 10, 11, 20, 25):
        assert len(set(run_colors(count))) == count


def test_the_scale_is_linear_unless_values_span_three_decades():
    assert value_scale(np.array([0.5, 1.0, 300.0])) is None
    assert value_scale(np.array([0.5, 1.0, 3000.0])) == "log"
    assert value_scale(np.array([0.0, 0.5, 3000.0])) == 0.5  # zeros: symlog, linear below 0.5
    # values that cross 0 come near it without spanning decades
    assert value_scale(np.array([-1.8, -0.9, -1e-4, 0.01, 0.2])) is None
    signed = np.array([-1e30, -0.5, -0.1, 0.2, 0.4, 1e20])
    assert value_scale(signed) == pytest.approx(np.percentile(np.abs(signed), 25))


def test_symlog_ticks_keep_clear_of_zero():
    # 72 decades drawn above the threshold 0.1: the nearest tick 6 decades above it
    ticks = symlog_ticks(0.1, -1e34, 1e35)
    assert ticks == [-1e25, -1e15, -1e5, 0.0, 1e5, 1e15, 1e25, 1e35]
    # a decade above the threshold where the values span few decades
    assert symlog_ticks(0.5, 0.0, 3000.0) == [0.0, 10.0, 100.0, 1000.0]


def test_fewer_than_two_runs_a_run_twice_or_nothing_in_common_are_refused(sweep):
    with pytest.raises(ValueError, match="two runs or more, got 1"):
        plot_compare(sweep[:1])
    with pytest.raises(ValueError, match="is given twice"):
        plot_compare([sweep[0], sweep[1], sweep[0]])
    losses = Run.from_output({0: {"Loss": 1.0}, 1: {"Loss": 0.5}})
    noise = Run.from_output({0: {"MeanGSNR": 0.1}})
    with pytest.raises(ValueError, match=r"no series in common.*run 1: Loss; run 2: MeanGSNR"):
        plot_compare([losses, noise])


# ----------------------------------------------------------------- the command line


def test_compare_writes_the_figure_to_the_runs_common_folder(capsys, sweep):
    result = in_process(capsys, "compare", *sweep)
    assert result.returncode == 0, result.stderr
    output = sweep[0].parent / "compare.png"
    assert result.stdout == f"comparison of 3 runs written to {output}\n"
    assert output.read_bytes().startswith(b"\x89PNG")


def test_compare_takes_an_output_labels_and_a_title(capsys, sweep, tmp_path):
    output = tmp_path / "figures" / "sweep.svg"
    result = in_process(
        capsys, "compare", sweep[0], sweep[2], "-o", output, "--labels", "small,large"
    )
    assert result.returncode == 0, result.stderr
    assert "<svg" in output.read_text()[:500]
    assert "small" in output.read_text() and "large" in output.read_text()
    help_text = in_process(capsys, "--help").stdout
    assert "compare" in help_text


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["MISSING"], "no run log at"),
        ([], "compare needs two runs or more, got 1"),
        (["SECOND", "-o", "out.gif"], "use a file name ending in .png, .pdf, .svg"),
        (["SECOND", "--labels", "a,b,c"], "3 label(s)"),
    ],
)
def test_compare_errors_are_one_line_naming_what_to_do(
    capsys, sweep, tmp_path, arguments, message
):
    stand_ins = {"MISSING": tmp_path / "missing", "SECOND": sweep[1]}
    arguments = [stand_ins.get(a, a) for a in arguments]
    result = in_process(capsys, "compare", sweep[0], *arguments)
    assert result.returncode == 1
    assert result.stderr.startswith("avionics compare: error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_compare_of_runs_with_nothing_in_common_says_what_each_has(capsys, tmp_path):
    for name, values in (("a", {"Loss": 1.0}), ("b", {"HessTrace": [2.0, 1.0]})):
        with RunWriter(tmp_path / name, {}) as writer:
            writer.write(0, values)
    result = in_process(capsys, "compare", tmp_path / "a", tmp_path / "b")
    assert result.returncode == 1
    assert "no series in common, so nothing overlays (a: Loss; b: HessTrace)" in result.stderr
    assert not (tmp_path / "compare.png").exists()
