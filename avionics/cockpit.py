"""The Cockpit: instruments read inside the user's own training loop (SPEC section 1).

    with cockpit(step, info={"loss": loss, "individual_losses": losses, ...}):
        loss.backward(create_graph=cockpit.create_graph(step))

The cockpit composes three parts and owns no computation of its own:

* the per-sample engine (:mod:`avionics.persample`): before a step that needs per-sample
  statistics it arms a capture of that step's forward; after the backward it turns the
  captured layer calls into one :class:`~avionics.persample.CapturedStep` and computes the
  merged request of the step's active quantities with one call;
* the quantities (:mod:`avionics.quantities`): ``request``, ``prepare`` and ``compute`` of each
  active one, on one :class:`~avionics.quantities.StepData`;
* the sinks (:mod:`avionics.records.sink`): the run log and any others, which receive each
  finished step's values, converted to plain Python once.

On a step where some quantity is active, ``info`` is validated before any state changes; a
step that needs nothing costs one schedule look-up per quantity.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from avionics.configurations import configuration
from avionics.persample import PerSampleEngine, Request
from avionics.persample.step import factorable
from avionics.quantities.base import Quantity, StepData
from avionics.quantities.loss import Loss
from avionics.records.encoding import to_python
from avionics.records.sink import Sink
from avionics.version import __version__

STATE_VERSION = 1


class Cockpit:
    """Instruments for ``model``'s training.

    Args:
        model: the network being trained.
        quantities: the instruments (``configuration("economy")`` by default); each stored
            under its class name.
        params: the parameters to track (default: every parameter that requires grad).
        log: a run directory; each finished step is appended there as it finishes.
        sinks: further destinations of the values (e.g. ``avionics.records.
            TensorBoardWriter(dir)``), each a :class:`~avionics.records.sink.Sink`.
        first_step: the number of the first step the loop will run, when it is known (a run
            resumed at step k); by default the capture is armed for whichever step comes
            first.
    """

    def __init__(
        self,
        model: nn.Module,
        quantities: list[Quantity] | None = None,
        params: list[nn.Parameter] | None = None,
        log: str | None = None,
        sinks: tuple[Sink, ...] | list[Sink] = (),
        first_step: int | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Cockpit(model) needs a torch.nn.Module, got {type(model).__name__}.")
        quantities = configuration("economy") if quantities is None else list(quantities)
        _check_quantities(quantities)
        sinks = list(sinks)
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise TypeError(
                    f"{sink!r} is not a sink: a sink has write(step, values), "
                    "update_metadata(metadata) and close() (see avionics.records.sink)."
                )
        if first_step is not None and (not isinstance(first_step, int) or first_step < 0):
            raise ValueError(f"first_step must be a non-negative int, got {first_step!r}.")
        self.model = model
        self.quantities = quantities
        self.params, self.param_names = _tracked_parameters(model, params)
        self._engine = PerSampleEngine(model, self.params)
        self._output: dict[int, dict[str, Any]] = defaultdict(dict)
        self._unconverted: list[tuple[int, str]] = []
        self._capture = None
        self._described_training = False
        metadata = self._metadata()
        for sink in sinks:
            sink.update_metadata(metadata)
        if log is not None:
            from avionics.records import RunWriter

            sinks.insert(0, RunWriter(log, metadata=metadata))
        self._sinks = sinks
        if first_step is None:
            self._arm_if(any(type(q).request is not Quantity.request for q in quantities))
        else:
            self._arm_for(first_step)

    # ------------------------------------------------------------------ the protocol
    def create_graph(self, step: int) -> bool:
        """Whether ``loss.backward`` must keep its graph at ``step`` (curvature quantities)."""
        return any(q.create_graph and q.is_active(step) for q in self.quantities)

    @contextmanager
    def __call__(self, step: int, info: dict):
        active = [q for q in self.quantities if q.is_active(step)]
        if not active:
            if self._capture is not None:  # armed for this step, not needed by it
                self._capture.disarm()
                self._capture = None
            yield self
            self._arm_for(step + 1)
            return
        request = Request()
        for q in active:
            request = request | q.request(step)
        reduction, n = self._validate(step, info, active)
        finite = bool(torch.isfinite(info["loss"].detach()))
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.disarm()
        if request and finite and (capture is None or not capture.calls):
            raise RuntimeError(
                f"Step {step} needs per-sample statistics, but the cockpit did not capture its "
                "forward pass. The cockpit arms its capture after each step for the step number "
                "that follows: call it at every step, with consecutive step numbers (a run "
                "resumed at step k: pass Cockpit(..., first_step=k))."
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
                values = self._compute(
                    step, info, active, request, capture, gradients, reduction, n
                )
            else:
                warnings.warn(
                    f"Step {step}: the loss is {float(info['loss'].detach())}; recorded it and "
                    "skipped the other quantities at this step.",
                    stacklevel=3,
                )
                values = {step: {Loss.__name__: info["loss"]}}
            self._store(values)
        finally:
            if capture is not None:
                capture.release()
            self._arm_for(step + 1)

    def log(self, step: int, **metrics) -> None:
        """Store epoch-level metrics (validation loss, accuracy, learning_rate, ...) at step."""
        values = {key: to_python(value) for key, value in metrics.items()}
        self._output[step].update(values)
        for sink in self._sinks:
            sink.write(step, values)

    def get_output(self) -> dict[int, dict[str, Any]]:
        """{step: {quantity or metric name: value}} of everything computed so far."""
        for step, name in self._unconverted:
            self._output[step][name] = to_python(self._output[step][name])
        self._unconverted = []
        return {step: dict(values) for step, values in sorted(self._output.items())}

    @property
    def metadata(self) -> dict:
        """What the run log's first line says of this cockpit (versions, model, parameters,
        quantities and their declared outputs)."""
        return self._metadata()

    def state_dict(self) -> dict:
        """What a run resumed from a checkpoint needs to continue every quantity as if
        uninterrupted (Distance's theta_0, HessMaxEV's warm start, adapted histogram ranges,
        pending two-step starts). Save it with ``torch.save`` after ``optimizer.step()``."""
        return {
            "version": STATE_VERSION,
            "quantities": {q.name: q.state_dict() for q in self.quantities},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a cockpit with the same quantities (checked before
        anything changes)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(
                "Cockpit.load_state_dict takes what Cockpit.state_dict returned (version "
                f"{STATE_VERSION}); got {type(state).__name__}."
            )
        saved, ours = state["quantities"], {q.name for q in self.quantities}
        if set(saved) != ours:
            raise ValueError(
                f"The saved cockpit had the quantities {sorted(saved)}, this one has "
                f"{sorted(ours)}: build the cockpit with the same quantities to resume."
            )
        for q in self.quantities:
            q.load_state_dict(saved[q.name])

    def close(self) -> None:
        """Remove the capture's hook and close the sinks."""
        if self._capture is not None:
            self._capture.disarm()
            self._capture.release()
            self._capture = None
        for sink in self._sinks:
            sink.close()

    # ------------------------------------------------------------------ internals
    def _arm_for(self, step: int) -> None:
        self._arm_if(any(q.is_active(step) and q.request(step) for q in self.quantities))

    def _arm_if(self, needed: bool) -> None:
        if needed:
            self._capture = self._engine.capture()
            self._capture.arm()

    def _validate(self, step, info, active) -> tuple[str, int | None]:
        if not isinstance(info, dict):
            raise TypeError(f"cockpit(step, info=...) needs a dict, got {type(info).__name__}.")
        if "loss" not in info:
            raise KeyError(f"Step {step}: info['loss'] is required on every tracked step.")
        for q in active:
            for key in q.required_info(step):
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
        """Add the optimizer and batch size to the metadata, once they are known."""
        from avionics.records.metadata import describe_optimizer

        optimizer = info.get("optimizer")
        if optimizer is not None:
            update = {"optimizer": describe_optimizer(optimizer), "batch_size": n}
            for sink in self._sinks:
                sink.update_metadata(update)
            self._described_training = True

    def _compute(self, step, info, active, request, capture, gradients, reduction, n):
        """The values of the step's active quantities, {step they belong to: {name: value}}."""
        if self._sinks and not self._described_training:
            self._describe_training(info, n)
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
            graph_grads=[p.grad for p in self.params],
            tracked=self.params,
            model=self.model,
            active=tuple(active),
        )
        if request:
            # a mean-reduced loss backpropagates dl_n/dout / N: the factor N undoes that
            factor = n if reduction == "mean" else 1
            data.captured = self._engine.step(
                capture.calls_by_module(), n, factor, gradients=gradients
            )
        directions = {"grad": mean_grad}
        for q in active:
            directions.update(q.prepare(data))
        values: dict[int, dict[str, Any]] = defaultdict(dict)
        try:
            if request.asks_statistics:
                data.statistics = data.captured.statistics(request, directions)
                # keep only the rules that mean_gradient_factors reuses: the others hold
                # scaled copies of the step's output gradients
                data.captured.release_rules(keep=factorable)
            for q in active:
                for s, value in q.compute(data).items():
                    values[s][q.name] = value
        finally:
            if data.captured is not None:
                data.captured.release_rules()  # what quantities keep of it is theirs
        return values

    def _store(self, values: dict[int, dict[str, Any]]) -> None:
        """Keep a step's values and hand them to the sinks, converted once.

        Without a sink the conversion waits for :meth:`get_output`, so that a tracked step
        copies nothing to the host (no device synchronisation on the training's hot path).
        """
        for step, named in sorted(values.items()):
            if self._sinks:
                named = {name: to_python(value) for name, value in named.items()}
                for sink in self._sinks:
                    sink.write(step, named)
            else:
                self._unconverted.extend((step, name) for name in named)
            self._output[step].update(named)

    def _metadata(self) -> dict:
        return {
            "avionics": __version__,
            "torch": torch.__version__,
            "model": type(self.model).__name__,
            "summary": repr(self.model),
            "parameters": {name: list(p.shape) for name, p in zip(self.param_names, self.params)},
            "quantities": [q.describe() for q in self.quantities],
            "outputs": {q.name: q.output.describe() for q in self.quantities},
        }


def _check_quantities(quantities: list) -> None:
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


def _store_into(slots: list, k: int):
    def store(grad):
        slots[k] = grad.detach()

    return store
