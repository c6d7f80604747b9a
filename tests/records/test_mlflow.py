"""The MLflow sink against the real mlflow package and its local file store, read back with
MlflowClient; the histogram summaries it charts against the samples' own quantiles."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trackers import STEPS, bounded, train_into

mlflow = pytest.importorskip(
    "mlflow", reason="the MLflow sink's tests need mlflow (avionics[mlflow])"
)

from avionics.records import MlflowSink  # noqa: E402
from avionics.records.mlflow_sink import mlflow_key  # noqa: E402
from avionics.records.tracking import QUANTILES, histogram_summary  # noqa: E402

TIME_S = 120


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A tracking URI of a file store in ``tmp_path`` (MLflow 3 refuses file stores unless
    told otherwise)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file:{tmp_path / 'mlruns'}"


def history(client, run_id, key) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_the_file_store_holds_each_steps_values_and_histograms(store, tmp_path):
    with bounded(TIME_S):
        sink = MlflowSink(tracking_uri=store, experiment="sweep", run_name="exp1")
        output, metadata = train_into([sink])
    client = mlflow.MlflowClient(tracking_uri=store)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "exp1"
    assert client.get_experiment(run.info.experiment_id).name == "sweep"
    names = list(metadata["parameters"])
    losses = history(client, sink.run_id, "Loss")
    assert losses == pytest.approx({s: output[s]["Loss"] for s in range(STEPS)}, rel=1e-12)
    norms = history(client, sink.run_id, "GradNorm")
    whole = {s: float(np.sqrt(np.sum(np.square(output[s]["GradNorm"])))) for s in range(STEPS)}
    assert norms == pytest.approx(whole, rel=1e-12)
    for k, name in enumerate(names):
        layer = history(client, sink.run_id, f"GradNorm_per_parameter/{name}")
        assert layer == pytest.approx({s: output[s]["GradNorm"][k] for s in range(STEPS)})
    # UpdateSize of step t arrives after step t + 1 was written: it is at step t
    updates = history(client, sink.run_id, f"UpdateSize_per_parameter/{names[0]}")
    assert updates == pytest.approx({s: output[s]["UpdateSize"][0] for s in range(STEPS - 1)})
    for step in range(STEPS):
        hist = output[step]["GradHist1d"]
        for statistic, value in histogram_summary(hist["hist"], hist["edges"]).items():
            logged = history(client, sink.run_id, f"GradHist1d/{statistic}")
            assert logged[step] == pytest.approx(value, rel=1e-12)
        counts = np.asarray(output[step]["GradHist2d"]["hist"])
        xedges = output[step]["GradHist2d"]["edges"][0]
        median = histogram_summary(counts.sum(axis=1), xedges)["p50"]
        logged = history(client, sink.run_id, "GradHist2d/gradient/p50")
        assert logged[step] == pytest.approx(median, rel=1e-12)
        for name in ("GradHist1d", "GradHist2d"):
            path = client.download_artifacts(
                sink.run_id, f"histograms/{name}/step_{step:08d}.json", str(tmp_path / "dl")
            )
            stored = json.loads(open(path).read())
            assert stored == {"step": step, **output[step][name]}  # (JSON floats: exact)
    params = run.data.params
    assert params["model"] == "Sequential" and params["optimizer.name"] == "SGD"
    assert float(params["optimizer.param_groups.0.lr"]) == 0.1
    described = client.download_artifacts(
        sink.run_id, "avionics/metadata.json", str(tmp_path / "dl")
    )
    assert json.loads(open(described).read())["parameters"] == metadata["parameters"]


def test_a_run_of_yours_is_written_to_and_left_open(store):
    client = mlflow.MlflowClient(tracking_uri=store)
    run_id = client.create_run(client.create_experiment("mine")).info.run_id
    with bounded(TIME_S):
        output, _ = train_into([MlflowSink(run_id, tracking_uri=store)])
    assert client.get_run(run_id).info.status == "RUNNING"
    assert history(client, run_id, "Loss")[STEPS - 1] == pytest.approx(
        output[STEPS - 1]["Loss"], rel=1e-12
    )


def test_building_the_sink_leaves_the_store_untouched(store, tmp_path):
    # Under data parallelism every process builds the sink and only rank 0 is handed values.
    # A client built on a file store creates its default experiment, so two processes
    # building clients at once collided on mlruns/0/meta.yaml ("Yaml file ... exists").
    sink = MlflowSink(tracking_uri=store)
    sink.close()
    assert not (tmp_path / "mlruns").exists() and sink.run_id is None


def test_histogram_quantiles_lie_within_a_bin_of_the_samples_quantiles():
    rng = np.random.default_rng(0)
    samples = rng.standard_t(3, size=20_000)
    edges = np.linspace(-6, 6, 61)
    inside = samples[(samples >= -6) & (samples < 6)]
    counts = np.histogram(inside, edges)[0]
    summary = histogram_summary(counts, edges)
    width = edges[1] - edges[0]
    for q in QUANTILES:
        assert abs(summary[f"p{round(q * 100):02d}"] - np.quantile(inside, q)) <= width
    assert abs(summary["mean"] - inside.mean()) <= width / 2


def test_histogram_quantiles_are_exact_for_values_spread_evenly_over_their_bins():
    # 4 bins with counts 1, 0, 3, 4, each bin's values at the midpoints of equal slices
    edges = np.array([0.0, 1.0, 2.0, 4.0, 5.0])
    counts = np.array([100, 0, 300, 400])
    values = np.concatenate(
        [
            lo + (np.arange(c) + 0.5) * (hi - lo) / c
            for lo, hi, c in zip(edges, edges[1:], counts)
            if c
        ]
    )
    summary = histogram_summary(counts, edges)
    for q in QUANTILES:
        assert summary[f"p{round(q * 100):02d}"] == pytest.approx(np.quantile(values, q), abs=0.02)
    assert summary["p25"] == pytest.approx(2 + 2 * (200 - 100) / 300)


def test_names_mlflow_refuses_are_made_names_it_takes(store):
    assert mlflow_key("val acc (%)") == "val acc ___"
    assert mlflow_key("a//b/../c:d") == "a/_/b/_/c_d"
    assert len(mlflow_key("x" * 300)) == 250
    with bounded(TIME_S):
        sink = MlflowSink(tracking_uri=store)
        sink.update_metadata({"note": "n" * 7000, "model": "MLP"})
        sink.write(3, {"val acc (%)": 0.75, "Loss": 0.5})
        sink.close()
    client = mlflow.MlflowClient(tracking_uri=store)
    assert history(client, sink.run_id, "val acc ___") == {3: 0.75}
    assert client.get_run(sink.run_id).data.params["note"] == "n" * 6000
