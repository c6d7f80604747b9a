"""The tracker sinks under data parallelism (2 gloo processes): every process builds its
sinks, and only rank 0, to which the cockpit hands the values, starts a run."""

from __future__ import annotations

import models
import pytest
import torch
from spawned import on_ranks
from torch import nn

from avionics import Cockpit, quantities
from avionics.records import MlflowSink, WandbSink

mlflow = pytest.importorskip("mlflow", reason="the MLflow sink's tests need mlflow")
wandb = pytest.importorskip("wandb", reason="the W&B sink's tests need wandb")

STEPS = 2


def train_on_rank(rank, world, store):
    """Each rank trains on its 3 of the 6 samples, its cockpit writing to a W&B and an
    MLflow sink that every rank builds; rank 0's per-step losses come back."""
    model, X, y, loss_fn = models.mlp(n=6)
    forward = nn.parallel.DistributedDataParallel(model)
    sinks = [WandbSink(project="avionics", name="ddp"), MlflowSink(tracking_uri=store)]
    cockpit = Cockpit(forward, [quantities.Loss(), quantities.GradNorm()], sinks=sinks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = slice(3 * rank, 3 * rank + 3)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = loss_fn(forward(X[shard]), y[shard])
        with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses}):
            losses.mean().backward()
        optimizer.step()
    cockpit.close()
    wandb.teardown()  # (a spawned process leaves without running atexit hooks)
    started = [sinks[0].run is not None, sinks[1].run_id is not None]
    return started, {step: v["Loss"] for step, v in cockpit.get_output().items()}


def test_only_rank_0_starts_a_run(tmp_path, monkeypatch):
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_CONSOLE": "off",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }.items():
        monkeypatch.setenv(key, value)
    store = f"file:{tmp_path / 'mlruns'}"
    (started0, losses), (started1, _) = on_ranks(train_on_rank, 2, tmp_path, store)
    assert started0 == [True, True] and started1 == [False, False]
    assert len(list(tmp_path.glob("wandb/offline-run-*"))) == 1
    client = mlflow.MlflowClient(tracking_uri=store)
    (experiment,) = [e for e in client.search_experiments() if e.name == "avionics"]
    (run,) = client.search_runs([experiment.experiment_id])
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "Loss")}
    # the global batch's loss, as rank 0's cockpit has it
    assert logged == pytest.approx(losses, rel=1e-12) and sorted(logged) == [0, 1]
    model, X, y, loss_fn = models.mlp(n=6)
    with torch.no_grad():
        assert logged[0] == pytest.approx(float(loss_fn(model(X), y).mean()), rel=1e-12)
