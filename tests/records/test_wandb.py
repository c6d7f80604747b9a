"""The W&B sink against the real wandb package, offline: the run file it writes, read back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trackers import STEPS, bounded, child_commands, train_into, wandb_history, wandb_records

wandb = pytest.importorskip("wandb", reason="the W&B sink's tests need wandb (avionics[wandb])")

from avionics.records import WandbSink  # noqa: E402
from avionics.records.wandb_sink import at_most_bins  # noqa: E402

TIME_S = 120


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline in ``tmp_path`` (no network, no prompt, no error reports); yields
    ``finished()``, which shuts W&B's service process down (it writes the run file) and
    returns the records of the run file. None of its processes is left behind."""
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONSOLE": "off",
    }.items():
        monkeypatch.setenv(key, value)

    def finished() -> list:
        with bounded(TIME_S):
            wandb.teardown()
        assert "wandb-core" not in child_commands()
        (path,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
        return wandb_records(path)

    yield finished
    finished()


def test_the_offline_run_holds_each_steps_values_and_histograms(offline):
    with bounded(TIME_S):
        output, metadata = train_into([WandbSink(project="avionics", name="exp1")])
    records = offline()
    history = wandb_history(records)
    names = list(metadata["parameters"])
    assert sorted(history) == list(range(STEPS))
    for step in range(STEPS):
        row, values = history[step], output[step]
        assert row["Loss"] == pytest.approx(values["Loss"], rel=1e-12)
        norms = values["GradNorm"]
        assert row["GradNorm"] == pytest.approx(np.sqrt(np.sum(np.square(norms))), rel=1e-12)
        for name, norm in zip(names, norms):
            assert row[f"GradNorm/{name}"] == pytest.approx(norm, rel=1e-12)
        hist = values["GradHist1d"]
        assert row["GradHist1d"]["_type"] == "histogram"
        assert row["GradHist1d"]["values"] == hist["hist"]
        assert row["GradHist1d"]["bins"] == pytest.approx(hist["edges"], rel=1e-12)
        counts = np.asarray(values["GradHist2d"]["hist"])
        assert row["GradHist2d/gradient"]["values"] == counts.sum(axis=1).tolist()
        assert row["GradHist2d/parameter"]["values"] == counts.sum(axis=0).tolist()
        assert row["GradHist2d/parameter"]["bins"] == pytest.approx(
            values["GradHist2d"]["edges"][1], rel=1e-12
        )
    # UpdateSize of step t arrives after step t + 1 was logged: it is at step t all the same
    for step in range(STEPS - 1):
        update = output[step]["UpdateSize"]
        assert history[step][f"UpdateSize/{names[0]}"] == pytest.approx(update[0], rel=1e-12)
    charted = {
        r.metric.name: r.metric.step_metric
        for r in records
        if r.WhichOneof("record_type") == "metric"
    }
    assert charted["UpdateSize"] == charted[f"GradNorm/{names[1]}"] == "step"
    (config,) = [
        item
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
        if item.key == "avionics" and "optimizer" in item.value_json
    ][-1:]
    described = json.loads(config.value_json)
    assert described["parameters"] == metadata["parameters"]
    assert described["optimizer"]["name"] == "SGD"


def test_a_run_of_yours_is_written_to_and_left_open(offline):
    with bounded(TIME_S):
        run = wandb.init(project="avionics", name="mine")
        output, _ = train_into([WandbSink(run)])
        run.log({"step": STEPS, "accuracy": 0.5})  # the user's own values, after the sink's
        run.finish()
    history = wandb_history(offline())
    assert history[STEPS - 1]["Loss"] == pytest.approx(output[STEPS - 1]["Loss"], rel=1e-12)
    assert history[STEPS]["accuracy"] == 0.5


def test_wandb_init_arguments_with_a_run_of_yours_are_refused(offline):
    with bounded(TIME_S):
        run = wandb.init(project="avionics")
        with pytest.raises(TypeError, match="either your run or them"):
            WandbSink(run, project="other")
        run.finish()


def test_more_bins_than_wandb_takes_merge_exactly():
    rng = np.random.default_rng(0)
    samples = rng.normal(size=10_000)
    edges = np.linspace(-4, 4, 1301)
    counts = np.histogram(samples, edges)[0].astype(np.float64)
    merged, merged_edges = at_most_bins(counts, edges, 512)
    assert len(merged) == 434 and len(merged_edges) == 435  # runs of 3 bins
    # the counts of the merged bins are those of binning the samples into them
    assert merged.tolist() == np.histogram(samples, merged_edges)[0].tolist()
    kept, kept_edges = at_most_bins(counts[:512], edges[:513], 512)
    assert len(kept) == 512 and kept_edges[-1] == edges[512]


def test_non_finite_values_reach_the_run_as_they_are(offline):
    with bounded(TIME_S):
        sink = WandbSink(project="avionics", name="diverging")
        sink.update_metadata({"parameters": {"w": [2], "b": [2]}})
        sink.write(0, {"Loss": 1.0, "GradNorm": [1.0, 2.0]})
        sink.write(1, {"Loss": float("nan"), "GradNorm": [float("inf"), 2.0]})
        sink.close()
    history = wandb_history(offline())
    assert history[0]["GradNorm/b"] == 2.0 and history[1]["GradNorm/b"] == 2.0
    assert np.isnan(history[1]["Loss"]) and history[1]["GradNorm/w"] == float("inf")
