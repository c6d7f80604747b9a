"""The cockpit's sinks: each finished step reaches every sink once, as plain Python, with the
metadata that says how each quantity's value reads."""

from __future__ import annotations

import models
import pytest
import torch

from avionics import Cockpit, quantities
from avionics.records import TensorBoardWriter, read_run


class ListSink:
    def __init__(self):
        self.records, self.metadata, self.closed = [], {}, False

    def write(self, step, values):
        self.records.append((step, values))

    def update_metadata(self, metadata):
        self.metadata.update(metadata)

    def close(self):
        self.closed = True


def train(cockpit, steps=3):
    model = cockpit.model
    X, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        losses = torch.nn.functional.cross_entropy(model(X), y, reduction="none")
        with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses,
                                 "optimizer": opt}):  # fmt: skip
            losses.mean().backward()
        opt.step()


def test_every_sink_gets_each_step_once_as_plain_python(tmp_path):
    model = models.mlp()[0]
    sink = ListSink()
    cockpit = Cockpit(
        model,
        [quantities.Loss(), quantities.GradNorm(), quantities.UpdateSize()],
        log=tmp_path / "run",
        sinks=[sink],
    )
    train(cockpit)
    cockpit.close()
    assert sink.closed
    assert sink.metadata["outputs"]["GradNorm"] == {"kind": "per_parameter", "reduce": "rss"}
    assert sink.metadata["optimizer"]["name"] == "SGD"
    # one record per step and target step: step t's own values (with the optimiser's
    # learning rate), then UpdateSize of t - 1
    assert [(s, sorted(v)) for s, v in sink.records] == [
        (0, ["GradNorm", "Loss", "learning_rate"]),
        (0, ["UpdateSize"]),
        (1, ["GradNorm", "Loss", "learning_rate"]),
        (1, ["UpdateSize"]),
        (2, ["GradNorm", "Loss", "learning_rate"]),
    ]
    step0 = sink.records[0][1]
    assert isinstance(step0["Loss"], float) and isinstance(step0["GradNorm"], list)
    output = cockpit.get_output()
    assert output[0]["GradNorm"] == step0["GradNorm"]
    logged = read_run(tmp_path / "run")
    assert logged.steps[1] == output[1]
    assert logged.output("GradNorm").reduce == "rss"


def test_tensorboard_is_a_live_sink(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = models.mlp()[0]
    cockpit = Cockpit(
        model,
        [quantities.Loss(), quantities.GradNorm()],
        sinks=[TensorBoardWriter(tmp_path / "tb")],
    )
    train(cockpit)
    cockpit.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0}).Reload()
    norms = cockpit.get_output()[2]["GradNorm"]
    second = [name for name, _ in model.named_parameters()][1]  # named as in the model
    assert events.Scalars(f"GradNorm/{second}")[2].value == pytest.approx(norms[1])
    assert events.Scalars("GradNorm")[2].value == pytest.approx(sum(v * v for v in norms) ** 0.5)


def test_an_object_that_is_not_a_sink_is_refused():
    with pytest.raises(TypeError, match="is not a sink"):
        Cockpit(models.mlp()[0], [quantities.Loss()], sinks=[object()])
