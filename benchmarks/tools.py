"""The training loops the benchmarks time side by side: plain, avionics, the reference tool.

Each loop owns its copy of a model and its optimizer; ``step(k, X, y)`` runs training step k.
:func:`time_steps` alternates a plain copy's steps with a tool's, so that the noise of a shared
machine hits both alike.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

import torch
from torch import nn

from avionics import Cockpit, quantities
from benchmarks.problems import PROBLEMS

LR = 1e-3


def optimizer(kind: str, params) -> torch.optim.Optimizer:
    """Plain SGD ("sgd") or Adam ("adam") at the benchmarks' learning rate."""
    if kind == "adam":
        return torch.optim.Adam(params, lr=LR)
    return torch.optim.SGD(params, lr=LR)


class Plain:
    """A plain training step: forward, mean loss, backward, update."""

    def __init__(self, model, loss_fn, kind: str = "sgd"):
        self.model, self.loss_fn = model, loss_fn
        self.opt = optimizer(kind, model.parameters())

    def step(self, k, X, y) -> None:
        self.opt.zero_grad()
        self.loss_fn(self.model(X), y).mean().backward()
        self.opt.step()

    def pause(self) -> None:
        """Called before the other copy's plain step runs."""

    def resume(self) -> None:
        """Called after it."""


class Avionics(Plain):
    """A step watched by an avionics cockpit with the quantities ``names`` (names in
    ``avionics.quantities``, or quantities), its steps numbered from ``first_step``."""

    def __init__(self, model, loss_fn, kind: str, names: list, first_step: int = 0):
        super().__init__(model, loss_fn, kind)
        tracked = [getattr(quantities, q)() if isinstance(q, str) else q for q in names]
        self.cockpit = Cockpit(model, tracked, first_step=first_step)
        self.first_step = first_step

    def step(self, k, X, y) -> None:
        step = self.first_step + k
        self.opt.zero_grad()
        losses = self.loss_fn(self.model(X), y)
        loss = losses.mean()
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X),
                "optimizer": self.opt}  # fmt: skip
        with self.cockpit(step, info):
            loss.backward(create_graph=self.cockpit.create_graph(step))
        self.opt.step()

    # The capture is armed between tracked steps; the plain copy's steps run without its hook.
    def pause(self) -> None:
        if self.cockpit._held.capture is not None:
            self.cockpit._held.capture.disarm()

    def resume(self) -> None:
        if self.cockpit._held.capture is not None:
            self.cockpit._held.capture.arm()


class Reference(Plain):
    """cockpit-for-pytorch with its own quantities on a BackPACK-extended model and loss."""

    def __init__(self, model, loss_fn, kind: str, names: list[str]):
        import cockpit
        from backpack import extend
        from cockpit.utils import schedules

        super().__init__(extend(model), loss_fn, kind)
        self.extended_loss = extend(nn.CrossEntropyLoss())
        every = schedules.linear(1)
        qs = [getattr(cockpit.quantities, q)(track_schedule=every) for q in names]
        self.cockpit = cockpit.Cockpit(list(model.parameters()), quantities=qs)

    def step(self, k, X, y) -> None:
        self.opt.zero_grad()
        out = self.model(X)
        loss = self.extended_loss(out, y)
        with torch.no_grad():
            losses = self.loss_fn(out, y)
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X),
                "optimizer": self.opt}  # fmt: skip
        with self.cockpit(k, info=info):
            loss.backward(create_graph=self.cockpit.create_graph(k))
        self.opt.step()


def reference_available() -> str | None:
    """None if cockpit-for-pytorch can be used, else why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import backpack  # noqa: F401
            import cockpit  # noqa: F401
    except Exception as error:  # not installed, or its pkg_resources import fails
        return f"not installed ({type(error).__name__}: {error})"
    return None


def reference_refuses(problem: str) -> str | None:
    """Why the reference tool cannot run a problem (BackPACK's per-sample extensions)."""
    if problem == "gpt":
        return (
            "BackPACK has no per-sample rules for nn.MultiheadAttention, LayerNorm and tied "
            "weights, and its extended CrossEntropyLoss takes [N, C] outputs only"
        )
    return None


def time_steps(
    problem, make_tool, kind, steps, warmup, budget_s, min_steps=5, clock=time.perf_counter
):
    """(median tool step, median plain step, timed steps), the two copies alternating.

    ``problem`` is a name of ``PROBLEMS`` or a builder returning ``(model, X, y, loss_fn)``;
    ``make_tool(model, loss_fn)`` builds the tool; timing stops after ``budget_s`` seconds once
    ``min_steps`` steps are timed. ``clock`` times the steps (wall time by default;
    ``time.process_time`` for this process's CPU time, what a loaded machine leaves
    comparable with one thread).
    """
    model, X, y, loss_fn = (PROBLEMS[problem] if isinstance(problem, str) else problem)()
    plain = Plain(copy.deepcopy(model), loss_fn, kind)
    tool = make_tool(model, loss_fn)
    t_plain, t_tool = [], []
    start = time.perf_counter()
    for k in range(warmup + steps):
        tool.pause()
        t0 = clock()
        plain.step(k, X, y)
        t1 = clock()
        tool.resume()
        tool.step(k, X, y)
        t2 = clock()
        if k >= warmup:
            t_plain.append(t1 - t0)
            t_tool.append(t2 - t1)
            if time.perf_counter() - start > budget_s and len(t_tool) >= min_steps:
                break
    return statistics.median(t_tool), statistics.median(t_plain), len(t_tool)
