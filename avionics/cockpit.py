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

import contextlib
import copy
import math
import reprlib
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from avionics.configurations import configuration
from avionics.curvature._data import MathAttention
from avionics.distributed import all_processes, current_world, sum_over_processes, unwrap
from avionics.persample import PerSampleEngine, Request, Statistics
from avionics.persample.capture import ModuleCall, output_edge
from avionics.persample.request import MEAN_GRADIENT
from avionics.persample.step import factorable
from avionics.quantities.base import MicroBatch, Quantity, StepData, TwoStepQuantity
from avionics.quantities.loss import Loss
from avionics.records.encoding import to_python
from avionics.records.sink import Sink
from avionics.version import __version__

STATE_VERSION = 1
# With a log, the steps get_output keeps in memory (the log keeps all of them).
OUTPUT_WINDOW = 1000
# Where each tracked step's learning rate is stored (info["optimizer"]'s, as cockpit.log would).
LEARNING_RATE = "learning_rate"


class Cockpit:
    """Instruments for ``model``'s training.

    Args:
        model: the network being trained.
        quantities: the instruments (``configuration("economy")`` by default); each stored
            under its class name.
        params: the parameters to track (default: every parameter that requires grad).
        log: a run directory; each finished step is appended there as it finishes. With a log,
            :meth:`get_output` keeps only the last ``OUTPUT_WINDOW`` steps in memory (the log
            keeps them all: ``avionics.read_run(log)``).
        exist, fsync: passed to the log's :class:`~avionics.records.RunWriter`: ``exist``
            "append" continues a run that has a log, "error" refuses; ``fsync`` forces each
            line to disk.
        sinks: further destinations of the values (e.g. ``avionics.records.
            TensorBoardWriter(dir)``), each a :class:`~avionics.records.sink.Sink`.
        first_step: the number of the first step the loop will run, when it is known (a run
            resumed at step k); by default the capture is armed for whichever step comes
            first.

    Data parallelism (torch.distributed initialised with several processes, ``model`` plain
    or wrapped in ``DistributedDataParallel``): every value is that of the global batch, the
    concatenation of the processes' batches, and equal on every process (see
    :mod:`avionics.distributed`). Every process must run the same steps. The log and the sinks
    receive the values on rank 0 only; a ``log`` path holding ``{rank}`` gives each process its
    own log (and its sinks the values). Under DDP, a step that differentiates the gradient again
    runs its forward and backward in ``no_sync()``, and the cockpit averages the gradients as
    DDP would, in one all-reduce. Under FSDP (``fully_shard``) the quantities of
    ``SHARDED_QUANTITIES`` are computed from the shards; the others are refused.

    A compiled model (``Cockpit(torch.compile(model))``): the cockpit tracks the module it
    compiles, and the steps whose forward it captures (or differentiates twice) run eagerly,
    under ``torch.compiler.set_stance("force_eager")`` from the end of the step before to
    their own end (the compiled code runs no module hooks); every other step runs compiled.
    """

    def __init__(
        self,
        model: nn.Module,
        quantities: list[Quantity] | None = None,
        params: list[nn.Parameter] | None = None,
        log: str | None = None,
        sinks: tuple[Sink, ...] | list[Sink] = (),
        first_step: int | None = None,
        exist: str = "append",
        fsync: bool = False,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Cockpit(model) needs a torch.nn.Module, got {type(model).__name__}.")
        quantities = configuration("economy") if quantities is None else _as_list(quantities)
        _check_quantities(quantities)
        sinks = list(sinks)
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise TypeError(
                    f"{sink!r} is not a sink: a sink has write(step, values), "
                    "update_metadata(metadata) and close() (see avionics.records.sink)."
                )
        if first_step is not None and not _is_step(first_step):
            raise ValueError(f"first_step must be a non-negative int, got {first_step!r}.")
        if log is not None and (exist, fsync) != ("append", False):
            from avionics.records.writer import EXIST_MODES

            if exist not in EXIST_MODES:
                raise ValueError(f"exist must be one of {EXIST_MODES}, got {exist!r}.")
        # a torch.compile'd module runs eagerly on the tracked steps (see _eager_if)
        self._compiled, model = _uncompiled(model)
        model, self._ddp = unwrap(model)
        compiled_inside, model = _uncompiled(model)
        self._compiled = self._compiled or compiled_inside
        self._eager = None  # the compiler's eager stance, while entered
        self._sharded = _sharded(model, quantities)
        _check_ddp_options(self._ddp, quantities)
        self._world = current_world()
        self.model = model
        self.quantities = quantities
        self.params, self.param_names = _tracked_parameters(model, params)
        self._engine = PerSampleEngine(model, self.params)
        # entered for a step that differentiates the gradient again (see _keep_graph_if)
        self._graph_step = None
        self._no_sync = None
        self._ddp_average: list[Tensor] | None = None
        self._output: dict[int, dict[str, Any]] = defaultdict(dict)
        self._unconverted: list[tuple[int, str]] = []
        self._capture = None
        self._accumulation: _Accumulation | None = None  # the micro-batches seen of a step
        self._described_training = False
        self._last_step: int | None = None  # the last step that finished
        self._restored = False  # whether load_state_dict ran
        self._closed = False
        metadata = self._metadata()
        per_rank = log is not None and "{rank}" in str(log)
        if not per_rank and self._world.rank != 0:
            log, sinks = None, []  # rank 0 writes what every process computes
        if log is not None:
            from avionics.records import RunWriter

            path = str(log).format(rank=self._world.rank) if per_rank else log
            writer = RunWriter(path, metadata=metadata, exist=exist, fsync=fsync)
        for sink in sinks:
            sink.update_metadata(metadata)
        if log is not None:
            sinks.insert(0, writer)
        self._window = OUTPUT_WINDOW if log is not None else None
        self._sinks = sinks
        if first_step is None:
            # the first step is unknown: arm for what any quantity may ask (its request can
            # depend on the step; the output visitors it asks for do not)
            request = Request(
                calls=any(type(q).request is not Quantity.request for q in quantities)
            )
            for q in quantities:
                request = request | q.request(0)
            graph = any(q.create_graph for q in quantities)
            self._arm_with(request)
            self._keep_graph_if(graph)
            self._eager_if(bool(request) or graph)
        else:
            self._arm_for(first_step)

    # ------------------------------------------------------------------ the protocol
    def create_graph(self, step: int) -> bool:
        """Whether ``loss.backward`` must keep its graph at ``step`` (curvature quantities)."""
        return any(q.create_graph and q.is_active(step) for q in self.quantities)

    def __call__(self, step: int, info: dict, *, micro_batch: int = 0, micro_batches: int = 1):
        """Track ``step``: ``with cockpit(step, info):`` entered after the forward, with the
        backward inside the block.

        ``info["loss"]`` is the step's loss (the mean or the sum of
        ``info["individual_losses"]``). The backward may be of any positive multiple
        c * info["loss"] (``(loss / k).backward()``, ``scaler.scale(loss).backward()``): the
        cockpit measures c as the gradient that arrives at ``info["loss"]`` and every value is
        of the gradient of ``info["loss"]`` itself (exact for a power of two c). The block
        holds the backward only: the gradients are read as it left them when the block ends,
        so unscale (``scaler.unscale_``), clip and step after it (GradNorm is the norm before
        clipping; Alpha and UpdateSize use the update the optimizer made).

        Gradient accumulation: one block per micro-batch of an optimiser step,
        ``with cockpit(step, info_i, micro_batch=i, micro_batches=k):`` for i = 0, ..., k-1 in
        order, each around the backward of its own forward (in DDP's ``no_sync()`` or not).
        The step's values are computed when micro-batch k-1 leaves its block, of all the
        step's samples together, exactly as for one batch made of the k micro-batches (whose
        loss is the mean over all their samples when each micro-batch's loss is its mean, the
        sum when each is a sum).

        Everything that can be checked is checked on entering, before the backward: a bad
        ``info``, step or micro-batch raises there and changes nothing. An exception inside the
        block (the user's own, a KeyboardInterrupt) propagates and leaves the cockpit ready for
        the next step (or a retry of this one from micro-batch 0): the interrupted step stores
        nothing, and neither do the two-step values that needed it (UpdateSize and Alpha of the
        tracked step before it). A step whose gradients are not finite after a scaled backward
        (c != 1: a step that ``torch.amp.GradScaler`` skips) stores its Loss only, with a
        warning.
        """
        return self._track(step, info, micro_batch, micro_batches)

    @contextmanager
    def _track(self, step: int, info: dict, micro_batch: int, micro_batches: int):
        """The body of :meth:`__call__` (see there)."""
        self._check_open()
        accumulation = self._check_micro_batch(step, micro_batch, micro_batches)
        if accumulation is None:
            self._check_step(step)
            active = [q for q in self.quantities if q.is_active(step)]
        else:
            active = accumulation.active
        last = micro_batch == micro_batches - 1
        single = micro_batches == 1
        if not active:
            if accumulation is None:
                self._disarm()  # armed for this step, not needed by it
            with self._interruptible(step, None):
                yield self
            if last:
                self._accumulation = None
                self._finish(step, None)
            else:
                self._accumulation = _Accumulation(step, micro_batches, micro_batch, active, [])
            return
        request = Request()
        for q in active:
            request = request | q.request(step)
        if not single and accumulation is None:
            self._check_accumulable(step, info)
        reduction, n = self._validate(step, info, active)
        parts = accumulation.parts if accumulation is not None else []
        if not single:
            _check_micro_batch_info(step, micro_batch, info, reduction, n, parts)
        loss = _at_least_float32(info["loss"].detach())
        if single:
            batch = self._global_batch(loss, reduction, n)
            if self._sharded and len(set(batch.sizes)) > 1:
                raise ValueError(
                    f"Step {step}: the processes' batches have {list(batch.sizes)} samples; "
                    "with FSDP's sharded parameters the cockpit needs equal batches (FSDP "
                    "averages the processes' gradients, which is the global batch's only then)."
                )
            finite = batch.finite
        else:  # decided over every process and micro-batch when the last one ends
            finite = bool(torch.isfinite(loss))
        if finite:
            _check_loss_graphs(step, info, active, self._capture, self.model)
            _validate_forwards(step, info, active, self._capture, self.model, self.params)
        # nothing has changed up to here; from here on the step owns the capture
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.disarm()
        record = bool(request) and (finite or not single)
        if single and record and (capture is None or not capture.calls):
            active, request = self._without_per_sample(step, active)
            record = False
        part = _MicroBatch(info, reduction, n, loss, capture if record else None)
        if record:
            capture.record_gradients()
        handles = [_scale_recorder(info["loss"], part)]
        graph = any(q.create_graph for q in active) and not single
        if record or not single or (self._world.size > 1 and not self._sharded):
            # DDP may overwrite the tensor its hook saw with the average (also when the
            # cockpit was given the module DDP wraps), and a later micro-batch's backward adds
            # into it: keep a copy
            keep = _store_copy_into if self._world.size > 1 or not single else _store_into
            part.gradients = [None] * len(self.params)
            part.graph = [None] * len(self.params) if graph else None
            handles += [
                p.register_hook(keep(part.gradients, k, part.graph))
                for k, p in enumerate(self.params)
            ]
        with self._interruptible(step, capture):
            try:
                yield self
            finally:
                for handle in handles:
                    if handle is not None:
                        handle.remove()
                if capture is not None:
                    capture.stop_recording()
        parts = [*parts, part]
        if not last:  # the next micro-batch's forward comes next
            self._accumulation = _Accumulation(step, micro_batches, micro_batch, active, parts)
            self._arm_with(request)
            return
        self._accumulation = None
        combined = None
        try:
            combined = self._combined(parts, single, any(q.create_graph for q in active))
            if not single:
                batch = self._global_batch(combined.loss, reduction, combined.n)
                finite = batch.finite
            if finite and combined.scaled:
                finite = self._finite_gradients(combined.gradients)
                skipped = "its gradients are not finite after a scaled backward (a step "
                skipped += "torch.amp.GradScaler skips)"
            else:
                skipped = f"the loss is {float(batch.loss)}"
            if finite:
                _check_backward(step, active, self.params)
                if request and any(
                    p.capture is None or not p.capture.calls_by_module() for p in parts
                ):
                    active, request = self._without_per_sample(step, active)
                values = self._compute(step, info, active, request, combined, reduction, batch)
            else:
                self._drop_pending()  # their ends would come two updates later
                warnings.warn(
                    f"Step {step}: {skipped}; recorded the loss and skipped the other "
                    "quantities at this step.",
                    stacklevel=3,
                )
                values = {step: {Loss.__name__: batch.loss}}
            _add_learning_rates(values, step, info)
        except BaseException:
            self._drop_pending()
            raise
        finally:
            if combined is not None:
                self._average_unsynced_gradients(combined.unsynced)
            for p in parts:
                if p.capture is not None:
                    p.capture.release()
            self._finish(step, None)
        self._store(values)

    def log(self, step: int, **metrics) -> None:
        """Store epoch-level metrics (validation loss, accuracy, learning_rate, ...) at step."""
        self._check_open()
        if not _is_step(step):
            raise TypeError(f"cockpit.log(step, ...) needs a non-negative int step, got {step!r}.")
        values = {key: to_python(value) for key, value in metrics.items()}
        for sink in self._sinks:
            sink.write(step, values)
        self._output[step].update(values)
        self._forget_old_steps()

    def get_output(self) -> Output:
        """{step: {quantity or metric name: value}} of everything computed so far, or, with a
        log, of the last ``OUTPUT_WINDOW`` steps (read the log for all of them). A dict whose
        repr abbreviates (histogram counts, many steps), so that printing it stays short."""
        for step, name in self._unconverted:
            self._output[step][name] = to_python(self._output[step][name])
        self._unconverted = []
        return Output({step: dict(values) for step, values in sorted(self._output.items())})

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
        anything changes; a state one quantity refuses leaves every quantity as it was)."""
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
        before = {q.name: q.state_dict() for q in self.quantities}
        try:
            for q in self.quantities:
                q.load_state_dict(saved[q.name])
        except BaseException:  # a state a quantity refuses: the others as they were
            for q in self.quantities:
                q.load_state_dict(before[q.name])
            raise
        self._restored = True

    def close(self) -> None:
        """Remove the capture's hook and close the sinks; later steps raise."""
        if self._capture is not None:
            self._capture.disarm()
            self._capture.release()
            self._capture = None
        for sink in self._sinks:
            sink.close()
        self._keep_graph_if(False)
        self._eager_if(False)
        self._closed = True

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "This cockpit is closed (Cockpit.close() was called): build a new Cockpit to "
                "track further steps (Cockpit(..., log=the same path) continues its log)."
            )

    def _check_step(self, step) -> None:
        self._check_open()
        if not _is_step(step):
            raise TypeError(
                f"cockpit(step, ...) needs the step as a non-negative int, got {step!r}."
            )
        last = self._last_step
        if last is None:
            if step > 1 and not self._restored:  # a loop counting from 1 starts afresh
                self._warn_fresh_start(step)
        elif step == last:
            raise ValueError(
                f"Step {step} was already tracked. A second `with cockpit({step}, ...)` block "
                "would overwrite the first one's values: track each optimizer step once, around "
                "one backward, or, for gradient accumulation over k micro-batches, give each "
                "micro-batch's block micro_batch=i, micro_batches=k."
            )
        elif step < last:
            raise ValueError(
                f"Step {step} comes after step {last}: step numbers must increase (the values "
                "of a step are stored under its number). A resumed run continues from the "
                "checkpoint's next step."
            )

    def _check_micro_batch(self, step, i, k) -> _Accumulation | None:
        """The accumulation that micro-batch ``i`` of ``k`` continues (None for the first);
        raises, before anything changes, where i and k do not follow the protocol."""
        for name, value in (("micro_batch", i), ("micro_batches", k)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"cockpit(step, info, {name}=...) takes an int, got {value!r} "
                    f"({type(value).__name__})."
                )
        if k < 1:
            raise ValueError(
                f"micro_batches={k}: an optimizer step has at least one micro-batch (the "
                "default, 1, is one batch)."
            )
        if not 0 <= i < k:
            raise ValueError(
                f"micro_batch={i} with micro_batches={k}: number the micro-batches of a step "
                f"0, ..., {k - 1}."
            )
        acc = self._accumulation
        if i == 0:
            if acc is not None:
                raise ValueError(
                    f"Step {step}, micro-batch 0: step {acc.step} has had micro-batches "
                    f"0, ..., {acc.index} of {acc.k} so far; enter its micro-batch "
                    f"{acc.index + 1} next (an exception inside a block abandons its step)."
                )
            return None
        if acc is None:
            raise ValueError(
                f"Step {step}, micro-batch {i}: no micro-batch 0 of this step came before; "
                "start each optimizer step at micro_batch=0."
            )
        if (step, k, i) != (acc.step, acc.k, acc.index + 1):
            raise ValueError(
                f"Step {step}, micro-batch {i} of {k}: expected step {acc.step}, micro-batch "
                f"{acc.index + 1} of {acc.k} (the micro-batches of a step come in order, with "
                "the step and micro_batches of its micro-batch 0)."
            )
        return acc

    def _check_accumulable(self, step: int, info: dict) -> None:
        """Micro-batches are of parameters that each process holds whole."""
        if self._sharded:
            raise ValueError(
                f"Step {step}: micro_batches > 1 with FSDP's sharded parameters is not "
                "supported; track one batch per optimizer step (micro_batches=1) under FSDP, "
                "or accumulate under DistributedDataParallel."
            )

    def _combined(self, parts: list[_MicroBatch], single: bool, graph: bool) -> _Combined:
        """What the step's micro-batches add up to: their batch, loss and gradients as if
        they were one batch, each micro-batch's backward scale divided out (``graph``: also
        the gradients with their graph, for the curvature quantities)."""
        params, reduction = self.params, parts[0].reduction
        scales = [part.scale() for part in parts]
        if single:
            (part,), (c,) = parts, scales
            # p.grad with one process; under data parallelism what this process's backward
            # gave each parameter (DDP's average is in p.grad)
            raw = part.gradients
            if raw is None or self._world.size == 1:
                raw = [_local(p.grad).detach() if p.grad is not None else None for p in params]
            gradients = [_unscaled(g, c) for g in raw]
            calls, cast = None, None
            if part.capture is not None:
                calls = part.capture.calls_by_module()
                cast = _in_float32(calls, self._engine)
            return _Combined(
                single=True,
                scale=c,
                loss=part.loss,
                n=part.n,
                individual_losses=_detached_losses(part.info),
                gradients=gradients,
                graph=[_unscaled(p.grad, c) for p in params] if graph else gradients,
                calls=calls,
                # a mean-reduced loss backpropagates c dl_n/dout / N: the factor N / c undoes it
                factor=None if part.n is None else (part.n if reduction == "mean" else 1) / c,
                check=part.gradients,
                check_rtol=_check_rtol(cast),
                unsynced=raw,
            )
        n = sum(part.n for part in parts)
        weights = [part.n / n if reduction == "mean" else 1.0 for part in parts]
        # micro-batch i's g_n is its captured output gradient times f_i (as for one batch)
        factors = [(part.n if reduction == "mean" else 1) / c for part, c in zip(parts, scales)]
        loss = sum(w * part.loss.double() for w, part in zip(weights, parts)).to(parts[0].loss)
        per_unit = [w / c for w, c in zip(weights, scales)]
        gradients = _weighted_sum([part.gradients for part in parts], per_unit)
        graphs = gradients
        if parts[0].graph is not None:
            graphs = _weighted_sum([part.graph for part in parts], per_unit)
        calls, micro_batches, cast = None, None, None
        if all(part.capture is not None for part in parts):
            per_part = [part.capture.calls_by_module() for part in parts]
            for part_calls in per_part:
                _check_inputs_unchanged(part_calls, self._engine)
            micro_batches = [
                MicroBatch(part_calls, part.info["individual_losses"], part.n / n)
                for part_calls, part in zip(per_part, parts)
            ]
            casts = [_in_float32(part_calls, self._engine) for part_calls in per_part]
            cast = next((c for c in casts if c is not None), None)
            calls = _merged_calls(per_part, [part.n for part in parts], factors)
        return _Combined(
            single=False,
            scale=1.0,
            scaled=any(c != 1 for c in scales),
            loss=loss,
            n=n,
            individual_losses=torch.cat([_detached_losses(part.info) for part in parts]),
            gradients=gradients,
            graph=graphs,
            calls=calls,
            factor=1.0,
            check=_weighted_sum([part.gradients for part in parts], factors),
            check_rtol=_check_rtol(cast),
            unsynced=[p.grad.detach() if p.grad is not None else None for p in params],
            micro_batches=micro_batches,
        )

    def _finite_gradients(self, gradients: list[Tensor | None]) -> bool:
        """Whether every process's gradients are finite (one host transfer; one collective
        of a number under data parallelism)."""
        present = [g for g in gradients if g is not None]
        finite = torch.stack(torch._foreach_norm(present)).isfinite().all() if present else True
        flag = torch.tensor([0.0 if bool(finite) else 1.0], dtype=torch.float64)
        if self._world.size > 1:
            (flag,) = sum_over_processes([flag], self._world)
        return bool(flag == 0)

    def _warn_fresh_start(self, step: int) -> None:
        """A run starting at step > 0 without a restored state: say what starts afresh."""
        stateful = [
            q.name for q in self.quantities if type(q).state_dict is not Quantity.state_dict
        ]
        if stateful:
            warnings.warn(
                f"The first tracked step is {step}, but no state was restored: "
                f"{', '.join(stateful)} start afresh here"
                + (
                    f" (Distance measures from step {step}'s parameters)"
                    if "Distance" in stateful
                    else ""
                )
                + ". To continue a resumed run, save Cockpit.state_dict() with the checkpoint "
                "and call load_state_dict on the new cockpit.",
                stacklevel=5,
            )

    @contextmanager
    def _interruptible(self, step: int, capture):
        """On an exception in the user's block: release the step and re-arm, so that the next
        step is tracked as usual; the two-step quantities drop the start that needed it."""
        try:
            yield
        except BaseException:
            if capture is not None:
                capture.release()
            if self._accumulation is not None:  # the step's earlier micro-batches
                for part in self._accumulation.parts:
                    if part.capture is not None:
                        part.capture.release()
                self._accumulation = None
            self._drop_pending()
            # the user may retry this step or go on to the next
            self._arm_with(self._request(step) | self._request(step + 1))
            raise

    def _drop_pending(self) -> None:
        """Forget the two-step quantities' starts: the step that would end them is lost."""
        for q in self.quantities:
            if isinstance(q, TwoStepQuantity):
                q.pending = None

    def _finish(self, step: int, capture) -> None:
        if capture is not None:
            capture.release()
        self._last_step = step
        self._arm_for(step + 1)

    def _without_per_sample(self, step: int, active: list[Quantity]):
        """The step's quantities without those that need per-sample statistics, with a warning
        (the capture saw no forward of the model for this step)."""
        skipped = [q for q in active if q.request(step)]
        for q in skipped:
            if isinstance(q, TwoStepQuantity):
                q.pending = None  # its start would end after two updates
        warnings.warn(
            f"Step {step}: the cockpit captured no forward pass of its model that this step's "
            f"loss was backpropagated through, so {', '.join(q.name for q in skipped)} are not "
            "computed at this "
            "step. The capture is armed after each step for the next one: call the model "
            "after the previous `with cockpit(...)` block (or after building the cockpit), "
            "compute the loss from that forward, and number steps consecutively (a run "
            "resumed at step k: Cockpit(..., first_step=k)).",
            stacklevel=4,
        )
        return [q for q in active if not q.request(step)], Request()

    def _disarm(self) -> None:
        if self._capture is not None:
            self._capture.disarm()
            self._capture.release()
            self._capture = None

    def _request(self, step: int) -> Request:
        """What the quantities active at ``step`` ask of its captured forward and backward."""
        request = Request()
        for q in self.quantities:
            if q.is_active(step):
                request = request | q.request(step)
        return request

    def _arm_for(self, step: int) -> None:
        request = self._request(step)
        self._arm_with(request)
        self._keep_graph_if(self.create_graph(step))
        self._eager_if(bool(request) or self.create_graph(step))

    def _eager_if(self, needed: bool) -> None:
        """A compiled model (``torch.compile``) runs eagerly from the end of the step before a
        step whose forward is captured or differentiated twice to that step's end
        (``torch.compiler.set_stance("force_eager")``: the compiled code calls no module
        hooks and keeps no double backward), and compiled on every other step."""
        if needed and self._compiled and self._eager is None:
            self._eager = torch.compiler.set_stance("force_eager")  # (set on creation)
        elif not needed and self._eager is not None:
            self._eager.__exit__(None, None, None)  # the stance before
            self._eager = None

    def _arm_with(self, request: Request) -> None:
        """Capture the next forward for ``request`` (nothing is hooked when it is empty)."""
        self._disarm()
        if request:
            self._capture = self._engine.capture()
            self._capture.arm(request)

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
        optimizer = info.get("optimizer")
        if optimizer is not None and not callable(getattr(optimizer, "step", None)):
            raise TypeError(
                "info['optimizer'] must be the optimizer that takes the step (a "
                f"torch.optim.Optimizer, or an object with a step() method), got "
                f"{type(optimizer).__name__}."
            )
        n = info.get("batch_size")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise TypeError(
                f"info['batch_size'] must be the number of samples in the batch, a positive "
                f"int; got {n!r} ({type(n).__name__})."
            )
        losses = info.get("individual_losses")
        if losses is None:
            reduction = "mean"
        else:
            if not isinstance(losses, Tensor) or losses.dim() != 1:
                raise ValueError(
                    "info['individual_losses'] must be the per-sample losses, a tensor of shape "
                    f"[N]; got {getattr(losses, 'shape', type(losses).__name__)}."
                )
            if losses.dtype != loss.dtype:
                raise TypeError(
                    f"info['individual_losses'] is {losses.dtype} but info['loss'] is "
                    f"{loss.dtype}: pass the per-sample losses the loss is computed from, as "
                    "they are (losses = criterion(out, y, reduction='none'); loss = "
                    "losses.mean())."
                )
            if n is not None and n != len(losses):
                raise ValueError(
                    f"info['batch_size'] is {n} but info['individual_losses'] has "
                    f"{len(losses)} entries; they must agree."
                )
            reduction, n = _reduction(loss.detach(), losses.detach()), len(losses)
        for q in active:
            q.validate(step, info)
        return reduction, n

    def _describe_training(self, info: dict, batch: _Batch) -> None:
        """Add the optimizer and batch size to the metadata, once they are known."""
        from avionics.records.metadata import describe_optimizer

        optimizer = info.get("optimizer")
        if optimizer is not None:
            update = {"optimizer": describe_optimizer(optimizer), "batch_size": batch.size}
            if self._world.size > 1:
                update["batch_sizes"] = list(batch.sizes)
            for sink in self._sinks:
                sink.update_metadata(update)
            self._described_training = True

    def _compute(self, step, info, active, request, combined: _Combined, reduction, batch):
        """The values of the step's active quantities, {step they belong to: {name: value}},
        computed in float32 or better (outside any autocast region)."""
        with _without_autocast(self.params[0].device.type):
            return self._compute_exactly(step, info, active, request, combined, reduction, batch)

    def _compute_exactly(self, step, info, active, request, combined, reduction, batch):
        n, local_n = batch.size, batch.sizes[self._world.rank]
        if self._sinks and not self._described_training:
            self._describe_training(info, batch)
        grads = self._global_gradients(combined, reduction, batch)
        mean_grad = grads if reduction == "mean" or n is None else [g / n for g in grads]
        data = StepData(
            step=step,
            params=[_local(p).detach() for p in self.params],
            names=self.param_names,
            loss=batch.loss,
            info=info,
            reduction=reduction,
            batch_size=n,
            individual_losses=combined.individual_losses,
            grads=grads,
            mean_grad=mean_grad,
            graph_grads=combined.graph,
            tracked=self.params,
            model=self.model,
            active=tuple(active),
            world=self._world,
            batch_sizes=batch.sizes,
            sharded=self._sharded,
            micro_batches=combined.micro_batches,
        )
        if self._world.size > 1 and not self._sharded:
            data.local_grads = [
                g if g is not None else torch.zeros_like(p)
                for g, p in zip(combined.gradients, self.params, strict=True)
            ]
        if request:
            data.captured = self._engine.step(
                combined.calls,
                local_n,
                combined.factor,
                gradients=combined.check,
                rtol=combined.check_rtol,
            )
        directions = {"grad": mean_grad}
        for q in active:
            directions.update(q.prepare(data))
        values: dict[int, dict[str, Any]] = defaultdict(dict)
        try:
            if request.asks_statistics:
                data.statistics = self._statistics(data.captured, request, directions)
                # keep only the rules that mean_gradient_factors reuses: the others hold
                # scaled copies of the step's output gradients
                data.captured.release_rules(keep=factorable)
            data.totals = self._add_over_processes({q.name: q.sums(data) for q in active})
            for q in active:
                for s, value in q.compute(data).items():
                    values[s][q.name] = value
        finally:
            if data.captured is not None:
                data.captured.release_rules()  # what quantities keep of it is theirs
        return values

    def _statistics(self, captured, request: Request, directions: dict) -> Statistics:
        """The step's per-sample statistics. Under data parallelism "grad" is the global
        batch's mean gradient, not the mean of this process's g_n, which the rules may
        assume of a direction of that name: it is passed under another."""
        if self._world.size == 1 or MEAN_GRADIENT not in request.directions:
            return captured.statistics(request, directions)
        name = f"{MEAN_GRADIENT} (global)"
        renamed = {name if d == MEAN_GRADIENT else d: v for d, v in directions.items()}
        request = replace(
            request,
            directions=frozenset(name if d == MEAN_GRADIENT else d for d in request.directions),
        )
        statistics = captured.statistics(request, renamed)
        statistics.projections[MEAN_GRADIENT] = statistics.projections.pop(name)
        return statistics

    # ------------------------------------------------------------------ data parallelism
    def _global_batch(self, loss: Tensor, reduction: str, n: int | None) -> _Batch:
        """The step's loss, batch size and finiteness over every process (one collective of
        two numbers per process when there are several)."""
        world = self._world
        if world.size == 1:
            return _Batch(loss, n, (n,), bool(torch.isfinite(loss)))
        mine = torch.tensor([float(n or 1), float(loss)], dtype=torch.float64)
        sizes, losses = all_processes(mine, world).unbind(1)
        total = int(sizes.sum())
        if reduction == "mean":  # the mean over all samples: sum_r N_r L_r / N
            global_loss = (sizes * losses).sum() / total
        else:
            global_loss = losses.sum()
        return _Batch(
            global_loss.to(loss),
            total if n is not None else None,
            tuple(int(s) for s in sizes.tolist()),
            bool(torch.isfinite(losses).all()),
        )

    def _global_gradients(self, combined: _Combined, reduction: str, batch: _Batch):
        """The gradient of the global loss (as reduced), per tracked parameter.

        One process: ``p.grad``. Under DDP with equal batches, DDP's average of the
        processes' gradients is the global mean's (a step in no_sync() makes that all-reduce
        itself). Otherwise the processes' gradient sums sum_n grad l_n are added (one
        all-reduce of the parameters' size; with the average that DDP would have made packed
        in, when this step ran in no_sync). Micro-batches: the combined gradient of all of
        them (p.grad holds their c_i-weighted sum). Every gradient is divided by the measured
        backward scale c."""
        world = self._world
        own = combined.single  # p.grad is the gradient of this step's one backward
        if world.size == 1:
            return _zeros_where_none(combined.gradients, self.params)
        local = _zeros_where_none(combined.gradients, self.params)
        synced = self._sharded or (self._ddp is not None and self._no_sync is None)
        if own and synced and len(set(batch.sizes)) == 1:
            averaged = [
                _unscaled(_local(p.grad).detach(), combined.scale)
                if p.grad is not None
                else torch.zeros_like(_local(p))
                for p in self.params
            ]
            return averaged if reduction == "mean" else [g * world.size for g in averaged]
        # DDP's average is packed in only where it is that of the gradients used here
        packed = own and not combined.scaled
        if (
            packed
            and self._ddp is not None
            and self._no_sync is not None
            and len(set(batch.sizes)) == 1
        ):
            # equal batches: the all-reduce DDP skipped gives both (sum_r g_r / W is DDP's
            # average, and the global mean for a mean-reduced loss)
            summed = sum_over_processes(local, world)
            self._ddp_average = summed
            return [g / world.size for g in summed] if reduction == "mean" else summed
        weight = batch.sizes[world.rank] if reduction == "mean" else 1
        sums = [g * weight for g in local]
        if packed and self._ddp is not None and self._no_sync is not None:
            *sums, self._ddp_average = _split(
                sum_over_processes(sums + [torch.cat([g.reshape(-1) for g in local])], world),
                self.params,
            )
        else:
            sums = sum_over_processes(sums, world)
        total = batch.size or sum(batch.sizes)
        return [s / total for s in sums] if reduction == "mean" else sums

    def _average_unsynced_gradients(self, gradients) -> None:
        """A step run in DDP's no_sync(): give each parameter the gradient DDP would have,
        the average over the processes of ``gradients`` (theirs, as backpropagated)."""
        if self._ddp is None or self._no_sync is None:
            return
        average = self._ddp_average
        if average is None:
            local = _zeros_where_none(gradients, self.params)
            average = sum_over_processes(local, self._world)
        else:
            average = list(average)
        self._ddp_average = None
        for p, g in zip(self.params, average):
            p.grad = (g / self._world.size).to(p.dtype).detach()

    def _add_over_processes(self, sums: dict[str, dict[str, Tensor]]):
        """The quantities' sums added over the processes, in one packed all-reduce."""
        if self._world.size == 1:
            return sums
        keys = [(q, name) for q, named in sums.items() for name in named]
        # a tensor that several quantities share (the same object) travels once
        distinct = list({id(sums[q][name]): sums[q][name] for q, name in keys}.values())
        totals = dict(zip(map(id, distinct), sum_over_processes(distinct, self._world)))
        out: dict[str, dict[str, Tensor]] = {q: {} for q in sums}
        for q, name in keys:
            out[q][name] = totals[id(sums[q][name])]
        return out

    def _keep_graph_if(self, needed: bool) -> None:
        """Prepare the next step's forward and backward for a second differentiation, or
        stop: the math kernel of scaled_dot_product_attention (the fused CPU kernels have no
        double backward), and under DDP its no_sync() (DDP refuses create_graph)."""
        if needed and self._graph_step is None:
            self._graph_step = MathAttention()
            self._graph_step.__enter__()
            if self._ddp is not None:
                self._no_sync = self._ddp.no_sync()
                self._no_sync.__enter__()
        elif not needed and self._graph_step is not None:
            if self._no_sync is not None:
                self._no_sync.__exit__(None, None, None)
                self._no_sync = None
            self._graph_step.__exit__(None, None, None)
            self._graph_step = None

    def _store(self, values: dict[int, dict[str, Any]]) -> None:
        """Keep a step's values and hand them to the sinks, converted once.

        Without a sink the conversion waits for :meth:`get_output`, so that a tracked step
        copies nothing to the host (no device synchronisation on the training's hot path).
        """
        _warn_non_finite(values)
        for step, named in sorted(values.items()):
            if self._sinks:
                named = {name: to_python(value) for name, value in named.items()}
                for sink in self._sinks:
                    sink.write(step, named)
            else:
                self._unconverted.extend((step, name) for name in named)
            self._output[step].update(named)
        self._forget_old_steps()

    def _forget_old_steps(self) -> None:
        """With a log, keep only the last OUTPUT_WINDOW steps in memory."""
        if self._window is not None:
            while len(self._output) > self._window:
                del self._output[min(self._output)]

    def _metadata(self) -> dict:
        return {
            "avionics": __version__,
            "torch": torch.__version__,
            "model": type(self.model).__name__,
            "summary": repr(self.model),
            "parameters": {name: list(p.shape) for name, p in zip(self.param_names, self.params)},
            "quantities": [q.describe() for q in self.quantities],
            "outputs": {q.name: q.output.describe() for q in self.quantities},
            "world_size": self._world.size,
        }


class Output(dict):
    """What :meth:`Cockpit.get_output` returns: a plain dict of the full values whose repr
    shows the first steps and the first entries of long lists only."""

    def __repr__(self) -> str:
        return _SHORT.repr(dict(self))


def _short_repr() -> reprlib.Repr:
    short = reprlib.Repr()  # (keyword arguments only from Python 3.12)
    short.maxlevel, short.maxdict, short.maxlist, short.maxtuple = 4, 12, 6, 6
    short.maxstring = short.maxother = 60
    return short


_SHORT = _short_repr()


@dataclass(frozen=True)
class _Batch:
    """The step's batch over every process: the loss as reduced, N (None when unknown), N_r
    per process, and whether every process's loss is finite."""

    loss: Tensor
    size: int | None
    sizes: tuple
    finite: bool


@dataclass
class _MicroBatch:
    """One micro-batch of a step, as its block left it: its info, reduction, N_i and loss,
    its capture (None when nothing was captured), the gradient each parameter received in
    its backward (``gradients``, detached; ``graph`` with its graph, for the curvature
    quantities), and the gradient that arrived at its ``info["loss"]``."""

    info: dict
    reduction: str
    n: int | None
    loss: Tensor
    capture: Any
    gradients: list[Tensor | None] | None = None
    graph: list[Tensor | None] | None = None
    loss_gradient: Tensor | None = None

    def scale(self) -> float:
        """c: the backward was of c * info["loss"] (1 where no gradient reached the loss, as
        in a backward of another tensor)."""
        if self.loss_gradient is None:
            return 1.0
        c = float(self.loss_gradient.reshape(()))
        if not c > 0:
            raise ValueError(
                f"The backward was of {c:g} * info['loss']: backpropagate a positive multiple "
                "of info['loss'] (loss.backward(), (loss / k).backward(), "
                "scaler.scale(loss).backward())."
            )
        return c


@dataclass
class _Accumulation:
    """The micro-batches of ``step`` seen so far: 0, ..., ``index`` of ``k``."""

    step: int
    k: int
    index: int
    active: list
    parts: list[_MicroBatch]


@dataclass
class _Combined:
    """A step's micro-batches as one batch (see :meth:`Cockpit._combined`): the local loss,
    N, per-sample losses and gradients (of the loss itself: the backward scale divided
    out), the gradients with their graph, the captured calls and their output-gradient
    factor, the engine check's gradients (``check`` times ``factor`` is sum_n g_n) and its
    tolerance, and the gradients as backpropagated (what DDP would average)."""

    single: bool
    scale: float
    loss: Tensor
    n: int | None
    individual_losses: Tensor | None
    gradients: list[Tensor | None]
    graph: list[Tensor | None]
    calls: dict | None
    factor: float | None
    check: list[Tensor | None] | None
    check_rtol: float | None
    unsynced: list[Tensor | None]
    micro_batches: list[MicroBatch] | None = None
    scaled: bool | None = None

    def __post_init__(self):
        if self.scaled is None:
            self.scaled = self.scale != 1


def _check_micro_batch_info(step, i, info, reduction, n, parts) -> None:
    """Every micro-batch of a step gives its number of samples and reduces alike."""
    if n is None:
        raise ValueError(
            f"Step {step}, micro-batch {i}: with micro_batches > 1 each micro-batch weighs by "
            "its samples; pass info['batch_size'] or info['individual_losses']."
        )
    if parts and reduction != parts[0].reduction:
        raise ValueError(
            f"Step {step}, micro-batch {i}: info['loss'] is the {reduction} of the per-sample "
            f"losses, micro-batch 0's was their {parts[0].reduction}: reduce every micro-batch "
            "alike (the step's loss is the mean over all its samples, or their sum)."
        )


def _scale_recorder(loss: Tensor, part: _MicroBatch):
    """A hook on ``info["loss"]`` that keeps the gradient arriving there (c of a backward of
    c * loss), or None for a loss without graph."""
    if not loss.requires_grad:
        return None

    def record(grad):
        part.loss_gradient = grad.detach()

    return loss.register_hook(record)


def _unscaled(t: Tensor | None, c: float) -> Tensor | None:
    """t / c (t itself for c = 1, and None for None)."""
    return t if t is None or c == 1 else t / c


def _weighted_sum(lists: list[list[Tensor | None] | None], weights: list[float]) -> list:
    """sum_i w_i t_i per parameter (None where no t_i is)."""
    out = []
    for k in range(len(next(l for l in lists if l is not None))):
        terms = [(w, l[k]) for l, w in zip(lists, weights) if l is not None and l[k] is not None]
        out.append(sum(w * t for w, t in terms) if terms else None)
    return out


def _zeros_where_none(tensors, params) -> list[Tensor]:
    return [
        t if t is not None else torch.zeros_like(_local(p))
        for t, p in zip(tensors, params, strict=True)
    ]


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32 where it is a 16-bit float (autocast), else itself."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def _detached_losses(info: dict) -> Tensor | None:
    losses = info.get("individual_losses")
    return None if losses is None else _at_least_float32(losses.detach())


def _check_inputs_unchanged(calls: dict, engine) -> None:
    for module, module_calls in calls.items():
        for call in module_calls:
            call.check_inputs_unchanged(engine.module_name(module))


def _in_float32(calls: dict, engine) -> torch.dtype | None:
    """Cast the captured inputs and output gradients of 16-bit floats (a forward under
    autocast) to float32, in place, so that every statistic is computed in float32 or better;
    the lowest precision cast, or None."""
    cast = [
        t.dtype
        for module_calls in calls.values()
        for call in module_calls
        for t in [*call.inputs, *call.grad_outputs]
        if t is not None and t.dtype in _LOW_PRECISION
    ]
    if not cast:
        return None
    _check_inputs_unchanged(calls, engine)  # (the cast tensors are new)
    for module_calls in calls.values():
        for call in module_calls:
            call.args, call.kwargs = pytree.tree_map_only(
                Tensor, _at_least_float32, (call.args, call.kwargs)
            )
            call.inputs = [_at_least_float32(t) for t in call.inputs]
            call.input_versions = [t._version for t in call.inputs]
            call.grad_outputs = [
                g if g is None else _at_least_float32(g) for g in call.grad_outputs
            ]
            for out in call.outputs:
                if out.dtype in _LOW_PRECISION:
                    out.dtype = torch.float32
    return max(cast, key=lambda dtype: torch.finfo(dtype).eps)


def _check_rtol(cast: torch.dtype | None) -> float | None:
    """The engine check's tolerance for statistics of tensors captured in ``cast``: the
    backward rounded each product to it."""
    return None if cast is None else 4 * torch.finfo(cast).eps


def _merged_calls(per_part: list[dict], sizes: list[int], factors: list[float]) -> dict:
    """The calls of k micro-batches' forwards as those of one forward of their concatenated
    batch: call j of each module is the concatenation along the batch axis of the
    micro-batches' calls j (tensors that do not carry a micro-batch's samples, such as a
    position table's indices, are taken from the first), micro-batch i's output gradients
    multiplied by f_i, so that the merged calls' output-gradient factor is 1. The merged calls
    have no graph of their own: the curvature quantities read each micro-batch's."""
    modules = list(per_part[0])
    for i, part in enumerate(per_part[1:], start=1):
        if set(part) != set(modules) or any(len(part[m]) != len(per_part[0][m]) for m in modules):
            raise RuntimeError(
                f"Micro-batch {i} called the model's modules differently from micro-batch 0 "
                "(other modules, or a module another number of times): the step's micro-batches "
                "must run the same forward on their own samples."
            )
    return {
        m: [_merged_call(calls, sizes, factors) for calls in zip(*(part[m] for part in per_part))]
        for m in modules
    }


def _merged_call(calls: list[ModuleCall], sizes: list[int], factors: list[float]) -> ModuleCall:
    first = calls[0]
    axis = first.batch_axis

    def batched(ts) -> bool:
        return all(
            t.dim() > axis
            and t.shape[axis] == n
            and t.shape[:axis] + t.shape[axis + 1 :]
            == ts[0].shape[:axis] + ts[0].shape[axis + 1 :]
            for t, n in zip(ts, sizes)
        )

    def merged(values):
        if isinstance(values[0], Tensor) and all(isinstance(v, Tensor) for v in values):
            if batched(values):
                return torch.cat(values, axis)
        return values[0]

    flat = [pytree.tree_flatten((c.args, c.kwargs)) for c in calls]
    spec = flat[0][1]
    args, kwargs = pytree.tree_unflatten(
        [merged(values) for values in zip(*(leaves for leaves, _ in flat))], spec
    )
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    outputs, grad_outputs = [], []
    for j, out in enumerate(first.outputs):
        shapes = [c.outputs[j].shape for c in calls]
        shape = list(out.shape)
        if len(shape) > axis and all(s[axis] == n for s, n in zip(shapes, sizes)):
            shape[axis] = sum(sizes)
        outputs.append(copy.copy(out))
        outputs[-1].shape = torch.Size(shape)
        grads = [c.grad_outputs[j] for c in calls]
        if all(g is None for g in grads):
            grad_outputs.append(None)
            continue
        grad_outputs.append(
            torch.cat(
                [
                    g * f if g is not None else torch.zeros(s, dtype=out.dtype, device=out.device)
                    for g, f, s in zip(grads, factors, shapes)
                ],
                axis,
            )
        )
    call = ModuleCall(
        module=first.module,
        args=args,
        kwargs=kwargs,
        outputs=outputs,
        nodes=first.nodes,  # (only counted: the merged call's graph is not read)
        node_outputs=first.node_outputs,
        batch_axis=axis,
        inputs=inputs,
        input_versions=[t._version for t in inputs],
    )
    call.grad_outputs = grad_outputs
    return call


def _add_learning_rates(values: dict, step: int, info: dict) -> None:
    """Store the learning rate of ``info["optimizer"]`` at ``step`` (under "learning_rate",
    the name the dashboard and the diagnosis read): one number, or one per parameter group
    where the groups' differ, so that a scheduler's rates are in the run's record."""
    groups = getattr(info.get("optimizer"), "param_groups", None)
    if not groups or not all(isinstance(g.get("lr"), (int, float, Tensor)) for g in groups):
        return
    rates = [float(g["lr"]) for g in groups]
    values[step][LEARNING_RATE] = rates[0] if len(set(rates)) == 1 else rates


def _without_autocast(device_type: str):
    """No autocast region (the user's forward may have run in one, with the block inside):
    a region that disables it where it is enabled, else nothing."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.autocast(device_type, enabled=False)
    except RuntimeError:  # a device type without autocast
        pass
    return contextlib.nullcontext()


def _split(flat: list[Tensor], params) -> list:
    """[*per-parameter tensors, per-parameter views of the last (flat) tensor]."""
    *head, packed = flat
    return [
        *head,
        [t.view_as(p) for t, p in zip(packed.split([p.numel() for p in params]), params)],
    ]


def _check_ddp_options(ddp, quantities: list[Quantity]) -> None:
    graph = [q.name for q in quantities if q.create_graph]
    if ddp is not None and getattr(ddp, "static_graph", False) and graph:
        raise ValueError(
            f"{', '.join(graph)} differentiate the gradient again (backward with "
            "create_graph=True), which DistributedDataParallel(static_graph=True) refuses, also "
            'in no_sync() ("a leaf Variable that requires grad is being used in an in-place '
            'operation"). Wrap the model with static_graph=False, or leave these quantities '
            "out."
        )


# What a cockpit computes on parameters FSDP shards (each process holds a shard of each).
SHARDED_QUANTITIES = ("Loss", "GradNorm", "Distance", "UpdateSize", "Time")


def _sharded(model: nn.Module, quantities: list[Quantity]) -> bool:
    """Whether ``model``'s parameters are sharded by FSDP (``fully_shard``); refuse the
    quantities that need whole parameters, and FullyShardedDataParallel's flat parameters."""
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        FullyShardedDataParallel = ()  # noqa: N806
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            "Cockpit: the model is wrapped in FullyShardedDataParallel, whose flattened "
            "parameters the cockpit cannot name. Shard it with "
            "torch.distributed.fsdp.fully_shard instead, or use DistributedDataParallel."
        )
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return False
    unsupported = [q.name for q in quantities if q.name not in SHARDED_QUANTITIES]
    if unsupported:
        raise TypeError(
            f"Cockpit: the model's parameters are sharded by FSDP (fully_shard), and "
            f"{', '.join(unsupported)} need every parameter whole (per-sample gradients, "
            f"second moments, curvature). Under FSDP the cockpit computes "
            f"{', '.join(SHARDED_QUANTITIES)}; for the others, train under "
            "DistributedDataParallel."
        )
    return True


def _uncompiled(model: nn.Module) -> tuple[bool, nn.Module]:
    """(whether ``model`` is a torch.compile'd module, the module it compiles)."""
    # (by name: importing torch._dynamo to compare the class takes seconds)
    if type(model).__name__ == "OptimizedModule" and isinstance(model._orig_mod, nn.Module):
        return True, model._orig_mod
    return False, model


def _local(tensor: Tensor) -> Tensor:
    """This process's part of a (sharded) parameter or gradient."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _is_step(step) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _as_list(quantities) -> list:
    if isinstance(quantities, Quantity):
        raise TypeError(
            f"Cockpit(quantities=...) takes a list of quantities, got a single {quantities.name}: "
            f"pass [{quantities.name}()]."
        )
    try:
        return list(quantities)
    except TypeError:
        raise TypeError(
            "Cockpit(quantities=...) takes a list of quantities such as "
            f"[avionics.quantities.NormTest()] or configuration('economy'), got {quantities!r}."
        ) from None


def _check_loss_graphs(step: int, info: dict, active: list, capture, model: nn.Module) -> None:
    """Before the backward: the per-sample losses of a step whose quantities differentiate
    through them have a graph, and it leads to the captured forward of the model."""
    readers = [
        q.name for q in active if q.create_graph and "individual_losses" in q.required_info(step)
    ]
    if not readers:
        return
    losses = info["individual_losses"]
    if losses.grad_fn is None:
        raise ValueError(
            f"Step {step}: {', '.join(readers)} backpropagate through info['individual_losses'], "
            "which has no graph (detached, or computed under no_grad): pass the per-sample "
            "losses the loss is computed from, as they are."
        )
    roots = [c for c in capture.calls if c.module is model and c.nodes] if capture else []
    if not roots:
        return
    edges = [output_edge(node) for call in roots for node in call.nodes]

    # backwards through the loss function alone: which captured forwards each one comes from
    def reached(tensor):
        grads = torch.autograd.grad(tensor, edges, retain_graph=True, allow_unused=True)
        return {k for k, g in enumerate(grads) if g is not None}

    if not reached(losses.sum()) & reached(info["loss"]):
        raise ValueError(
            f"Step {step}: info['loss'] and info['individual_losses'] do not come from one "
            f"forward pass of the model, which {', '.join(readers)} backpropagate through: "
            "compute both from one forward (out = model(x); losses = criterion(out, y, "
            "reduction='none'); loss = losses.mean())."
        )


def _validate_forwards(step: int, info: dict, active: list, capture, model, params) -> None:
    """Before the backward: each quantity's check of the step's captured forward (e.g. the
    cost of a curvature diagonal, from the model's output), on the latest forward of the
    model (the one the loss comes from, as a rule)."""
    roots = [c for c in capture.calls if c.module is model][-1:] if capture is not None else []
    losses = info.get("individual_losses")
    n = len(losses) if isinstance(losses, Tensor) and losses.dim() == 1 else None
    for q in active:
        q.validate_forward(step, model, params, roots, n)


def _check_backward(step: int, active: list, params: list[Tensor]) -> None:
    """After the backward: it kept the graph that the step's curvature quantities need."""
    readers = [q.name for q in active if q.create_graph]
    if readers and not any(p.grad is not None and p.grad.requires_grad for p in params):
        raise RuntimeError(
            f"Step {step}: {', '.join(readers)} differentiate the gradient again, but the "
            "backward kept no graph: call loss.backward(create_graph=cockpit.create_graph(step)) "
            "inside the `with cockpit(...)` block. Nothing of this step was stored."
        )


def _warn_non_finite(values: dict[int, dict[str, Any]]) -> None:
    """Warn, per step, of the quantities whose values are NaN or infinite (one host
    transfer for all tensor values of the step)."""
    for step, named in values.items():
        tensors = {
            k: v for k, v in named.items() if isinstance(v, Tensor) and v.is_floating_point()
        }
        flags = {}
        if tensors:
            # the scalars in one check, each larger tensor in one of its own
            scalars = [k for k, v in tensors.items() if v.dim() == 0]
            others = [k for k in tensors if tensors[k].dim() > 0]
            checks = []
            if scalars:
                checks.append(torch.isfinite(torch.stack([tensors[k] for k in scalars])))
            checks += [torch.isfinite(tensors[k]).all().reshape(1) for k in others]
            finite = checks[0] if len(checks) == 1 else torch.cat(checks)
            flags = dict(zip(scalars + others, finite.tolist()))
        for name, value in named.items():
            if isinstance(value, float):
                flags[name] = math.isfinite(value)
        bad = [name for name, ok in flags.items() if not ok and name != Loss.__name__]
        if bad:
            warnings.warn(
                f"Step {step}: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} NaN or "
                "infinite (recorded as computed): the step's gradients or curvature were not "
                "finite.",
                stacklevel=5,
            )


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
        seen: dict[int, int] = {}
        for k, p in enumerate(chosen):
            if id(p) in seen:
                raise ValueError(
                    f"params[{k}] is params[{seen[id(p)]}] again ('{named.get(id(p), '?')}'): "
                    "list each parameter once."
                )
            seen[id(p)] = k
            if id(p) not in named:
                raise ValueError(f"params[{k}] is not a parameter of the model.")
            if not p.requires_grad:
                raise ValueError(
                    f"Parameter '{named[id(p)]}' does not require grad, so it has no gradient "
                    "to track. Set requires_grad=True or leave it out of params."
                )
    return chosen, [named[id(p)] for p in chosen]


def _reduction(loss: Tensor, losses: Tensor) -> str:
    """'mean' or 'sum', from how ``loss`` relates to the per-sample ``losses`` (one host
    transfer)."""
    value, total = torch.stack([loss.reshape(()), losses.sum()]).double().tolist()
    mean = total / len(losses)
    # (16-bit losses of a forward under autocast: to their precision)
    rtol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(loss.dtype, 1e-2)
    if not math.isfinite(value) or abs(value - mean) <= 2 * rtol * abs(mean):
        return "mean"
    if abs(value - total) <= 2 * rtol * abs(total):
        return "sum"
    raise ValueError(
        f"info['loss'] = {value:.6g} is neither the mean ({mean:.6g}) nor the sum "
        f"({total:.6g}) of info['individual_losses']. Pass the loss you backpropagate "
        "and the per-sample losses it is the mean or sum of."
    )


def _store_into(slots: list, k: int, graph: list | None = None):
    def store(grad):
        slots[k] = grad.detach()
        if graph is not None:
            graph[k] = grad

    return store


def _store_copy_into(slots: list, k: int, graph: list | None = None):
    def store(grad):
        slots[k] = grad.detach().clone()
        if graph is not None:  # (a backward with create_graph adds out of place)
            graph[k] = grad

    return store
