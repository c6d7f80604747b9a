"""README's "Your own instrument": the example runs, equals brute force, and shows up in the
CSV and TensorBoard exports and on the secondary screen of `avionics plot`."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import models
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics import Cockpit
from avionics.cli import main as avionics_main
from avionics.records import read_run, to_csv, to_tensorboard

README = Path(__file__).parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("### Your own instrument") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def example(tmp_path, monkeypatch, capsys):
    """Run the README's example in a fresh directory; return its namespace."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(readme_example(), str(README), "exec"), namespace)
    capsys.readouterr()
    return namespace


def brute_force_noise_scales(model, X, y, loss_fn) -> list[float]:
    per_sample = models.per_sample_gradients(model, X, y, loss_fn)
    scales = []
    for g in per_sample:
        flat = g.reshape(len(g), -1).double()
        mean = flat.mean(0)
        n = len(flat)
        scales.append(float(((flat - mean).pow(2).sum() / (n - 1)) / mean.pow(2).sum()))
    return scales


def test_the_example_equals_brute_force_in_float64(example):
    LayerNoiseScale = example["LayerNoiseScale"]
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    X, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))

    def loss_fn(out, target):
        return F.cross_entropy(out, target, reduction="none")

    cockpit = Cockpit(model, [LayerNoiseScale()])
    losses = loss_fn(model(X), y)
    with cockpit(0, info={"loss": losses.sum(), "individual_losses": losses}):
        losses.sum().backward()
    ours = cockpit.get_output()[0]["LayerNoiseScale"]
    assert ours == pytest.approx(brute_force_noise_scales(model, X, y, loss_fn), rel=1e-12)


def test_the_example_needs_the_per_sample_losses_it_did_not_declare(example):
    """A request implies info['individual_losses']: a clear error before any work."""
    model = example["model"]
    cockpit = Cockpit(model, [example["LayerNoiseScale"]()])
    loss = F.cross_entropy(model(example["X"]), example["y"])
    with pytest.raises(KeyError, match="LayerNoiseScale reads info\\['individual_losses'\\]"):
        with cockpit(0, info={"loss": loss}):
            loss.backward()
    assert cockpit.get_output() == {}


def test_the_example_shows_up_in_the_exports_and_the_dashboard(example, tmp_path):
    run = read_run(tmp_path / "runs" / "own")
    assert run.output("LayerNoiseScale").reduce == "mean"
    scales = run.steps[4]["LayerNoiseScale"]
    with open(to_csv(run, tmp_path / "own.csv")) as f:
        rows = list(csv.DictReader(f))
    assert float(rows[4]["LayerNoiseScale"]) == pytest.approx(sum(scales) / len(scales))
    assert float(rows[4]["LayerNoiseScale[2.bias]"]) == scales[3]  # named as in the model

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    to_tensorboard(run, tmp_path / "tb")
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0}).Reload()
    assert events.Scalars("LayerNoiseScale/param_1")[4].value == pytest.approx(scales[1])

    from avionics.dashboard import plot_secondary

    titles = [ax.get_title() for ax in plot_secondary(run).axes]
    assert "LayerNoiseScale" in titles and "YOUR INSTRUMENTS" in titles
    code = avionics_main(
        ["plot", str(tmp_path / "runs" / "own"), "-o", str(tmp_path / "own.png"),
         "--secondary", str(tmp_path / "own-secondary.png")]
    )  # fmt: skip
    assert code == 0 and (tmp_path / "own-secondary.png").stat().st_size > 0
