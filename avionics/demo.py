"""The demo: the same small network trained twice on real data, once with a well-chosen and
once with a too-large learning rate, each watched by a full cockpit; both dashboards are
drawn and the diagnosis printed, which tells the two runs apart.

The data are the 8x8 handwritten digits (1797 images, 10 classes) that ship with
scikit-learn; the network is a 64-32-10 ReLU MLP trained with plain SGD, in float64 (the
curvature instruments of a nearly converged float32 classifier meet rounding noise).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from avionics import Cockpit, configuration, quantities
from avionics.dashboard import plot, plot_secondary
from avionics.diagnosis import diagnose, report
from avionics.records import read_run
from avionics.records.series import series
from avionics.schedules import linear

LEARNING_RATES = {"good-lr": 0.5, "too-large-lr": 6.0}
BATCH_SIZE = 64
VALID_SIZE = 360
# the costliest instruments
CURVATURE = (quantities.HessMaxEV, quantities.HessTrace, quantities.TICDiag, quantities.TICTrace)
# not in any preset
SECONDARY = (quantities.CABS, quantities.EarlyStopping, quantities.MeanGSNR, quantities.TICTrace)
SCHEDULES = {"every": 2, "histogram_every": 10, "curvature_every": 50, "eval_every": 20}


def load_digits_data(seed: int = 0):
    """``(X_train, y_train, X_valid, y_valid)``: the 8x8 digits as standardized float64
    vectors of 64 pixels, split at random into 1437 training and 360 validation images."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "The demo trains on the 8x8 digits that ship with scikit-learn: "
            "pip install -c constraints.txt scikit-learn"
        ) from error
    digits = load_digits()
    X = torch.tensor(digits.data / 16.0, dtype=torch.float64)
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
    train, valid = order[VALID_SIZE:], order[:VALID_SIZE]
    mean, std = X[train].mean(0), X[train].std(0) + 0.1  # some pixels are always blank
    X = (X - mean) / std
    return X[train], y[train], X[valid], y[valid]


def demo_quantities(every: int, histogram_every: int, curvature_every: int) -> list:
    """The richest preset, ``full``, plus the secondary screen's instruments, with
    per-parameter 2d histograms: the curvature instruments every ``curvature_every`` steps,
    the histograms every ``histogram_every`` steps and the others every ``every`` steps."""
    chosen = []
    for cls in [type(q) for q in configuration("full")] + list(SECONDARY):
        if cls in {type(c) for c in chosen}:
            continue
        if cls in CURVATURE:
            q = cls(schedule=linear(curvature_every))
        elif cls is quantities.GradHist2d:
            q = cls(schedule=linear(histogram_every), per_parameter=True)
        elif cls.output.histogram:
            q = cls(schedule=linear(histogram_every))
        else:
            q = cls(schedule=linear(every))
        chosen.append(q)
    return chosen


@torch.no_grad()
def accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    """The share of ``X`` that ``model`` classifies as ``y``."""
    return (model(X).argmax(dim=1) == y).float().mean().item()


def train(run_dir: Path, lr: float, data, steps: int, schedules: dict, progress: bool) -> Path:
    """Train the MLP with SGD at ``lr`` for ``steps`` steps under a cockpit logging to
    ``run_dir``; ``schedules`` holds the intervals ``every``, ``histogram_every``,
    ``curvature_every`` of :func:`demo_quantities` and ``eval_every``, the interval at which
    the learning rate, batch size, validation loss and accuracies are logged."""
    X_train, y_train, X_valid, y_valid = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    eval_every = schedules["eval_every"]
    tracked = {k: v for k, v in schedules.items() if k != "eval_every"}
    cockpit = Cockpit(model, quantities=demo_quantities(**tracked), log=run_dir)
    batches = torch.Generator().manual_seed(1)
    bar = tqdm(range(steps), desc=run_dir.name, unit="step", disable=not progress)
    try:
        for step in bar:
            index = torch.randint(0, len(X_train), (BATCH_SIZE,), generator=batches)
            optimizer.zero_grad()
            losses = F.cross_entropy(model(X_train[index]), y_train[index], reduction="none")
            loss = losses.mean()
            info = {
                "loss": loss,
                "individual_losses": losses,
                "batch_size": BATCH_SIZE,
                "optimizer": optimizer,
            }
            with cockpit(step, info=info):
                loss.backward(create_graph=cockpit.create_graph(step))
            optimizer.step()
            if step % eval_every == 0 or step == steps - 1:
                with torch.no_grad():
                    valid_loss = F.cross_entropy(model(X_valid), y_valid).item()
                cockpit.log(
                    step,
                    epoch=step * BATCH_SIZE // len(X_train),
                    learning_rate=lr,
                    batch_size=BATCH_SIZE,
                    valid_loss=valid_loss,
                    train_accuracy=accuracy(model, X_train, y_train),
                    valid_accuracy=accuracy(model, X_valid, y_valid),
                )
                bar.set_postfix(loss=f"{loss.item():.3g}", valid=f"{valid_loss:.3g}")
    finally:
        cockpit.close()
    return run_dir


def run_demo(
    out: str | Path = "avionics-demo",
    steps: int = 200,
    progress: bool = True,
    schedules: dict | None = None,
) -> dict:
    """Train, draw and diagnose both runs under ``out``; print where everything went and the
    two diagnoses. Return ``{run name: findings}``. ``schedules`` overrides
    :data:`SCHEDULES`."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"run_demo(steps=...) needs an integer >= 1, got {steps!r}.")
    if steps < 1:
        raise ValueError(f"run_demo(steps=...) needs an integer >= 1, got {steps!r}.")
    out = Path(out)
    if any((out / name).exists() for name in LEARNING_RATES):
        raise FileExistsError(
            f"{out} already holds demo runs; pass another folder (--out) or remove it."
        )
    started = time.perf_counter()
    data = load_digits_data()
    findings = {}
    for name, lr in LEARNING_RATES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # create_graph's reference-cycle note
            run_dir = train(
                out / name, lr, data, steps, {**SCHEDULES, **(schedules or {})}, progress
            )
        plot(run_dir, run_dir / "cockpit.png", title=f"Cockpit: digits MLP, SGD lr={lr}")
        plot_secondary(run_dir, run_dir / "secondary.png")
        findings[name] = diagnose(run_dir)
        print(
            f"\n{name} (lr={lr}): dashboard {run_dir / 'cockpit.png'}, "
            f"secondary screen {run_dir / 'secondary.png'}"
        )
        print(report(run_dir, findings[name]))
    print("\nThe two runs side by side:")
    for name, lr in LEARNING_RATES.items():
        _, accuracy_series = series(read_run(out / name), "valid_accuracy")
        checks = ", ".join(f.check for f in findings[name]) or "none"
        print(
            f"  {name:13s} lr={lr:<4g} final validation accuracy "
            f"{accuracy_series[-1]:6.1%}; findings: {checks}"
        )
    print(
        f"\nDemo done in {time.perf_counter() - started:.0f} s. Draw or diagnose a run again "
        f"with: avionics plot {out / 'too-large-lr'}; avionics diagnose {out / 'too-large-lr'}"
    )
    return findings


def example_run(quantities: list, steps: int = 2, lr: float = 0.1, seed: int = 0) -> dict:
    """``get_output()`` of a cockpit of ``quantities`` over ``steps`` steps of plain SGD at
    ``lr`` on a 4-8-3 tanh MLP and one fixed batch of 16 random samples, in float64: the
    small run of the ``Example:`` sections of the quantities' docstrings. The loop is the
    protocol of the README::

        with cockpit(step, info={"loss": loss, "individual_losses": losses,
                                 "batch_size": 16, "optimizer": optimizer}):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()

    The model and the data come from ``seed`` alone; the global random number generator is
    left as it was.

    Example:
        >>> from avionics.quantities import Loss
        >>> output = example_run([Loss()], steps=3)
        >>> sorted(output), sorted(output[0])  # (the optimizer's learning rate comes along)
        ([0, 1, 2], ['Loss', 'learning_rate'])
        >>> bool(output[2]["Loss"] < output[0]["Loss"])  # SGD descends
        True
    """
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(16, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (16,), generator=generator)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    cockpit = Cockpit(model, quantities=quantities)
    for step in range(steps):
        optimizer.zero_grad()
        losses = F.cross_entropy(model(X), y, reduction="none")
        loss = losses.mean()
        info = {
            "loss": loss,
            "individual_losses": losses,
            "batch_size": 16,
            "optimizer": optimizer,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    cockpit.close()
    return cockpit.get_output()
