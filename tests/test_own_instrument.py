"""README's "Your own instrument": the example runs, equals brute force (also under data
parallelism, where the same formula without its sums is refused), and shows up in the CSV and
TensorBoard exports and on the secondary screen of `avionics plot`."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import models
import pytest
import torch
from spawned import on_ranks
from torch import nn
from torch.nn import functional as F

from avionics import Cockpit
from avionics.cli import main as avionics_main
from avionics.quantities import Quantity, Request, per_parameter
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
    second = run.parameter_names[1]  # named as in the model, as in the CSV
    assert events.Scalars(f"LayerNoiseScale/{second}")[4].value == pytest.approx(scales[1])

    from avionics.dashboard import plot_secondary

    titles = [ax.get_title() for ax in plot_secondary(run).axes]
    assert "LayerNoiseScale" in titles and "YOUR INSTRUMENTS" in titles
    code = avionics_main(
        ["plot", str(tmp_path / "runs" / "own"), "-o", str(tmp_path / "own.png"),
         "--secondary", str(tmp_path / "own-secondary.png")]
    )  # fmt: skip
    assert code == 0 and (tmp_path / "own-secondary.png").stat().st_size > 0


class PerProcessNoiseScale(Quantity):
    """The example in one formula, from the statistics in compute, without sums: right on one
    process, this process's share of the batch under data parallelism (hence refused there)."""

    output = per_parameter("mean")

    def request(self, step):
        return Request(sq_norms=True)

    def compute(self, data):
        n, total = data.batch_size, torch.stack([s.sum() for s in data.statistics.sq_norms])
        g_sq = torch.stack([g.square().sum() for g in data.mean_grad])
        return {data.step: (total - n * g_sq) / ((n - 1) * g_sq)}


def _double_batch(n: int):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    X, y = torch.randn(n, 5, dtype=torch.float64), torch.randint(0, 3, (n,))
    return model, X, y


def _losses(out, target):
    return F.cross_entropy(out, target, reduction="none")


def _one_step(quantity, model, X, y) -> list[float]:
    cockpit = Cockpit(model, [quantity])
    losses = _losses(model(X), y)
    with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses}):
        losses.mean().backward()
    return cockpit.get_output()[0][quantity.name]


def test_one_formula_without_sums_is_right_on_one_process():
    model, X, y = _double_batch(9)
    ours = _one_step(PerProcessNoiseScale(), model, X, y)
    assert ours == pytest.approx(brute_force_noise_scales(model, X, y, _losses), rel=1e-12)


def _example_on_rank(rank, world, sizes):
    """The README's instrument on this process's share of one batch, and the message that
    refuses its one-formula form."""
    namespace: dict = {"__name__": "readme_example"}
    classes = readme_example().split("\ntorch.manual_seed(")[0]  # (not the training loop)
    exec(compile(classes, str(README), "exec"), namespace)
    model, X, y = _double_batch(sum(sizes))
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    value = _one_step(namespace["LayerNoiseScale"](), model, X[mine], y[mine])
    try:
        Cockpit(model, [PerProcessNoiseScale()])
    except TypeError as error:
        return value, str(error)
    return value, None


def test_under_data_parallelism_the_example_is_the_global_batch_s_and_one_formula_is_refused(
    tmp_path,
):
    """Real torch.distributed (gloo, 2 spawned processes, unequal shares of the batch): the
    README's sums/compute instrument equals brute force on the whole batch on every process;
    the same formula without sums is refused by name, on every process, when the cockpit is
    built."""
    sizes = (3, 6)
    results = on_ranks(_example_on_rank, 2, tmp_path, sizes)
    model, X, y = _double_batch(sum(sizes))
    expected = brute_force_noise_scales(model, X, y, _losses)
    for value, refused in results:
        assert value == pytest.approx(expected, rel=1e-10)
        assert refused is not None
        assert refused.startswith("PerProcessNoiseScale read this process's per-sample")
        assert "data.totals['PerProcessNoiseScale']" in refused
        assert "2 processes" in refused
