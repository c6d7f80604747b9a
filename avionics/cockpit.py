"""The Cockpit: instruments read inside the user's own training loop (SPEC section 1).

    with cockpit(step, info={"loss": loss, "individual_losses": losses, ...}):
        loss.backward(create_graph=cockpit.create_graph(step))

On a step where some quantity is active, the cockpit validates ``info`` before it touches any
state, hooks the autograd nodes of the forward it captured (see
:mod:`avionics.persample.capture`), lets the backward run, computes the per-sample statistics
the active quantities asked for, and stores each quantity's values. Before a step that needs
per-sample statistics it arms the capture for that step's forward; a step that needs nothing
costs one schedule look-up per quantity.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from avionics.persample import PerSampleEngine, Request
from avionics.quantities.base import Quantity, StepData


class Cockpit:
    """Instruments for ``model``'s training.

    Args:
        model: the network being trained.
        quantities: the instruments (``configuration("economy")`` by default); each stored
            under its class name.
        params: the parameters to track (default: every parameter that requires grad).
        log: a run directory; each finished step is appended there as it finishes.
    """

    def __init__(
        self,
        model: nn.Module,
        quantities: list[Quantity] | None = None,
        params: list[nn.Parameter] | None = None,
        log: str | None = None,
    ):
        from avionics.configurations import configuration

        if not isinstance(model, nn.Module):
            raise TypeError(f"Cockpit(model) needs a torch.nn.Module, got {type(model).__name__}.")
        quantities = configuration("economy") if quantities is None else list(quantities)
        names = set()
        for q in quantities:
            if not isinstance(q, Quantity):
                raise TypeError(
                    f"{q!r} is not a quantity. Pass instances such as "
                    "avionics.quantities.NormTest(), or configuration('economy')."
                )
            if q.name in names:
                raise ValueError(
                    f"Two {q.name} quantities: each quantity is stored under its class name, so "
                    "a cockpit takes one of each."
                )
            names.add(q.name)
        self.model = model
        self.quantities = quantities
        self.params, self.param_names = _tracked_parameters(model, params)
        self._engine = PerSampleEngine(model, self.params)
        self._output: dict[int, dict[str, Any]] = defaultdict(dict)
        self._unconverted: list[tuple[int, str]] = []
        self._capture = None
        self._writer = None
        self._described_training = False
        if log is not None:
            from avionics.records import RunWriter

            self._writer = RunWriter(log, metadata=self._metadata())
        self._arm_if_needed(next_step=None)

    # ------------------------------------------------------------------ the protocol
    def create_graph(self, step: int) -> bool:
        """Whether ``loss.backward`` must keep its graph at ``step`` (curvature quantities)."""
        return any(q.create_graph and q.is_active(step) for q in self.quantities)

    @contextmanager
    def __call__(self, step: int, info: dict):
        active = [q for q in self.quantities if q.is_active(step)]
        if not active:
            if self._capture is not None:  # armed before the first step, not needed by it
                self._capture.disarm()
                self._capture = None
            yield self
            self._arm_if_needed(next_step=step + 1)
            return
        request = Request()
        for q in active:
            request = request | q.request(step)
        reduction, n = self._validate(step, info, active, request)
        finite = bool(torch.isfinite(info["loss"].detach()))
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.disarm()
        if request and finite and (capture is None or not capture.calls):
            raise RuntimeError(
                f"Step {step} needs per-sample statistics, but the cockpit did not capture its "
                "forward pass. The cockpit arms its capture after each step for the step number "
                "that follows: call it at every step, with consecutive step numbers."
            )
        gradients: list[Tensor | None] = [None] * len(self.params)
        handles = []
        if request and finite:
            capture.record_gradients()
            handles = [
                p.register_hook(_store_into(gradients, k)) for k, p in enumerate(self.params)
            ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            if capture is not None:
                capture.stop_recording()
        try:
            if finite:
                self._compute(step, info, active, request, capture, gradients, reduction, n)
            else:
                warnings.warn(
                    f"Step {step}: the loss is {float(info['loss'].detach())}; recorded it and "
                    "skipped the other quantities at this step.",
                    stacklevel=3,
                )
                self._store(step, "Loss", info["loss"])
        finally:
            if capture is not None:
                capture.release()
            self._arm_if_needed(next_step=step + 1)

    def log(self, step: int, **metrics) -> None:
        """Store epoch-level metrics (validation loss, accuracy, learning_rate, ...) at step."""
        values = {key: _to_python(value) for key, value in metrics.items()}
        self._output[step].update(values)
        if self._writer is not None:
            self._writer.write(step, values)

    def get_output(self) -> dict[int, dict[str, Any]]:
        """{step: {quantity or metric name: value}} of everything computed so far."""
        for step, name in self._unconverted:
            self._output[step][name] = _to_python(self._output[step][name])
        self._unconverted = []
        return {step: dict(values) for step, values in sorted(self._output.items())}

    def close(self) -> None:
        """Remove the capture's hook and close the log."""
        if self._capture is not None:
            self._capture.disarm()
            self._capture.release()
            self._capture = None
        if self._writer is not None:
            self._writer.close()

    # ------------------------------------------------------------------ internals
    def _arm_if_needed(self, next_step: int | None) -> None:
        if next_step is None:  # before the first step: its number is not known yet
            needed = any(q.request(0) or q.request(1) for q in self.quantities)
        else:
            needed = any(q.is_active(next_step) and q.request(next_step) for q in self.quantities)
        if needed:
            self._capture = self._engine.capture()
            self._capture.arm()

    def _validate(self, step, info, active, request) -> tuple[str, int | None]:
        if not isinstance(info, dict):
            raise TypeError(f"cockpit(step, info=...) needs a dict, got {type(info).__name__}.")
        if "loss" not in info:
            raise KeyError(f"Step {step}: info['loss'] is required on every tracked step.")
        for q in active:
            for key in q.info_keys:
                if key not in info:
                    raise KeyError(
                        f"Step {step}: {q.name} reads info['{key}'], which is missing. Pass it "
                        f"in cockpit(step, info={{..., '{key}': ...}}) or remove {q.name}."
                    )
        loss = info["loss"]
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"info['loss'] must be a scalar tensor, got {loss!r}.")
        losses = info.get("individual_losses")
        n = info.get("batch_size")
        if losses is None:
            return "mean", n
        if not isinstance(losses, Tensor) or losses.dim() != 1:
            raise ValueError(
                "info['individual_losses'] must be the per-sample losses, a tensor of shape "
                f"[N]; got {getattr(losses, 'shape', type(losses).__name__)}."
            )
        if n is not None and n != len(losses):
            raise ValueError(
                f"info['batch_size'] is {n} but info['individual_losses'] has {len(losses)} "
                "entries; they must agree."
            )
        return _reduction(loss.detach(), losses.detach()), len(losses)

    def _describe_training(self, info: dict, n: int | None) -> None:
        """Add the optimizer and batch size to the log's metadata, once they are known."""
        from avionics.records.metadata import describe_optimizer

        optimizer = info.get("optimizer")
        if optimizer is not None:
            self._writer.update_metadata(
                {"optimizer": describe_optimizer(optimizer), "batch_size": n}
            )
            self._described_training = True

    def _compute(self, step, info, active, request, capture, gradients, reduction, n):
        if self._writer is not None and not self._described_training:
            self._describe_training(info, n)
        scale = n if reduction == "mean" else 1
        grads = [
            p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in self.params
        ]
        mean_grad = grads if reduction == "mean" or n is None else [g / n for g in grads]
        losses = info.get("individual_losses")
        data = StepData(
            step=step,
            params=[p.detach() for p in self.params],
            names=self.param_names,
            loss=info["loss"].detach(),
            info=info,
            reduction=reduction,
            batch_size=n,
            individual_losses=losses.detach() if losses is not None else None,
            grads=grads,
            mean_grad=mean_grad,
        )
        # For curvature quantities: p.grad with its graph (create_graph=True), the model, the
        # step's active quantities (to share work), and (below) the captured calls and the
        # engine, to backpropagate other output gradients.
        data.extra.update(
            graph_grads=[p.grad for p in self.params],
            tracked=self.params,
            model=self.model,
            quantities=active,
        )
        if request:
            calls = capture.calls_by_module()
            if self._engine.needs_check(calls):
                self._engine.check(calls, gradients, n, scale)
            directions = {"grad": mean_grad}
            for q in active:
                directions.update(q.directions(data))
            if request.statistics:
                data.statistics = self._engine.statistics(
                    calls, request, directions, n, scale, keep_rules=True
                )
            data.extra.update(calls=calls, engine=self._engine)
            data.extra["mean_gradient_factors"] = lambda: self._engine.mean_gradient_factors(
                calls, n, scale
            )
            data.per_sample = _bound_statistics(self._engine, self.params, calls, n, scale)
        try:
            for q in active:
                for s, value in q.compute(data).items():
                    self._store(s, q.name, value)
        finally:
            self._engine.release()  # the step's rules: what is kept, quantities keep

    def _store(self, step: int, name: str, value) -> None:
        """Keep a value; it becomes plain Python when written to the log or read back.

        Without a log the conversion waits for :meth:`get_output`, so that a tracked step
        copies nothing to the host (no device synchronisation on the training's hot path).
        """
        if self._writer is not None:
            value = _to_python(value)
            self._writer.write(step, {name: value})
        else:
            self._unconverted.append((step, name))
        self._output[step][name] = value

    def _metadata(self) -> dict:
        import avionics

        return {
            "avionics": avionics.__version__,
            "torch": torch.__version__,
            "model": type(self.model).__name__,
            "summary": repr(self.model),
            "parameters": {name: list(p.shape) for name, p in zip(self.param_names, self.params)},
            "quantities": [q.describe() for q in self.quantities],
        }


def _tracked_parameters(model: nn.Module, params) -> tuple[list[nn.Parameter], list[str]]:
    named = {id(p): name for name, p in model.named_parameters()}
    if params is None:
        chosen = [p for p in model.parameters() if p.requires_grad]
        if not chosen:
            raise ValueError("The model has no parameter that requires grad; nothing to track.")
    else:
        chosen = list(params)
        for k, p in enumerate(chosen):
            if id(p) not in named:
                raise ValueError(f"params[{k}] is not a parameter of the model.")
            if not p.requires_grad:
                raise ValueError(
                    f"Parameter '{named[id(p)]}' does not require grad, so it has no gradient "
                    "to track. Set requires_grad=True or leave it out of params."
                )
    return chosen, [named[id(p)] for p in chosen]


def _reduction(loss: Tensor, losses: Tensor) -> str:
    """'mean' or 'sum', from how ``loss`` relates to the per-sample ``losses``."""
    mean, total = losses.mean(), losses.sum()
    rtol = 1e-10 if loss.dtype == torch.float64 else 1e-4
    if not torch.isfinite(loss) or torch.isclose(loss, mean, rtol=rtol, atol=rtol * abs(mean)):
        return "mean"
    if torch.isclose(loss, total, rtol=rtol, atol=rtol * abs(total)):
        return "sum"
    raise ValueError(
        f"info['loss'] = {float(loss):.6g} is neither the mean ({float(mean):.6g}) nor the sum "
        f"({float(total):.6g}) of info['individual_losses']. Pass the loss you backpropagate "
        "and the per-sample losses it is the mean or sum of."
    )


def _bound_statistics(engine: PerSampleEngine, tracked: list[nn.Parameter], calls, n, scale):
    """``StepData.per_sample``: statistics of one step's captured calls, on demand.

    Holds ``calls`` (that step's layer inputs and output gradients; the capture's gradient
    hooks are already removed) for as long as a quantity keeps the returned function.
    """

    def per_sample(request: Request, directions: dict, params: list[Tensor] | None = None):
        if params is None:
            return engine.statistics(calls, request, directions, n, scale)
        now = [p.data for p in tracked]
        try:
            for p, value in zip(tracked, params, strict=True):
                p.data = value
            return engine.statistics(calls, request, directions, n, scale)
        finally:
            for p, value in zip(tracked, now, strict=True):
                p.data = value

    return per_sample


def _store_into(slots: list, k: int):
    def store(grad):
        slots[k] = grad.detach()

    return store


def _to_python(value):
    """Plain Python (floats, lists, dicts) for the output and the log."""
    if isinstance(value, Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_python(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value
