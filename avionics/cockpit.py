"""The Cockpit: instruments read inside the user's own training loop (docs/cockpit.md, section 1).

    with cockpit(step, info={"loss": loss, "individual_losses": losses, ...}):
        loss.backward(create_graph=cockpit.create_graph(step))

The cockpit composes three parts and owns no computation of its own:

* the per-sample engine (:mod:`avionics.persample`): before a step that needs per-sample
  statistics it arms a capture of that step's forward; after the backward it turns the
  captured layer calls into one :class:`~avionics.persample.CapturedStep` and computes the
  merged request of the step's active quantities with one call;
* the quantities (:mod:`avionics.quantities`): the four hooks ``request``, ``prepare``,
  ``sums`` and ``compute`` of each active one, on one :class:`~avionics.quantities.StepData`;
* the sinks (:mod:`avionics.records.sink`): the run log and any others, which receive each
  finished step's values, converted to plain Python once.

On a step where some quantity is active, ``info`` is validated before any state changes; a
step that needs nothing costs one schedule look-up per quantity.

This module is the class: construction, the protocol (``__call__`` and its stages, in order),
state, ``log``, ``get_output``, ``close``, and arming the capture for the next step. Each
stage's work is in :mod:`avionics.step`, one concern per module.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from avionics.configurations import configuration
from avionics.curvature._data import MathAttention
from avionics.distributed import current_world, unwrap
from avionics.persample import PerSampleEngine, Request
from avionics.quantities.base import Quantity, TwoStepQuantity, check_data_parallel
from avionics.quantities.histograms import load_histogram_kernels
from avionics.quantities.loss import Loss
from avionics.records.sink import Sink
from avionics.step import checks
from avionics.step.accumulation import accumulated
from avionics.step.batch import (
    OneProcess,
    one_batch,
    record_fresh_gradients,
    record_gradients,
    settled,
    with_finiteness,
)
from avionics.step.compute import compute
from avionics.step.hold import Held, forget_pending, release_hooks, uncompiled
from avionics.step.output import (
    LEARNING_RATE,
    StepValues,
    Storage,
    add_learning_rates,
    opened_sinks,
)
from avionics.step.parallel import Agreement, DataParallel, Skipped, check_ddp_options
from avionics.step.precision import at_least_float32, scale_recorder, without_autocast
from avionics.step.sharded import SHARDED_QUANTITIES, Sharded, sharded
from avionics.step.state import check_state, state_of
from avionics.step.values import Accumulation, Combined, Entry, Part
from avionics.version import __version__

# With a log, the steps get_output keeps in memory (the log keeps all of them).
OUTPUT_WINDOW = 1000

__all__ = ["LEARNING_RATE", "OUTPUT_WINDOW", "SHARDED_QUANTITIES", "Cockpit", "StepValues"]


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
    DDP would, in one all-reduce. Under FSDP2 (``fully_shard``), equal or unequal batches, the
    quantities of ``SHARDED_QUANTITIES`` are computed from the shards and each process's own
    samples (:mod:`avionics.step.sharded`); the others are refused by name.

    A compiled model (``Cockpit(torch.compile(model))``): the cockpit tracks the module it
    compiles, and the steps whose forward it captures (or differentiates twice) run eagerly,
    under ``torch.compiler.set_stance("force_eager")`` from the end of the step before to
    their own end (the compiled code runs no module hooks); every other step runs compiled.

    With a histogram quantity (GradHist1d, GradHist2d; economy has one) and parameters on the
    CPU, construction loads the histogram kernels (numba) for the parameters' dtype, once per
    process: 0.3-2 s from numba's on-disk cache, 4-20 s where they must be compiled (said on
    stderr; BENCHMARKS.md, "First tracked step"), so that the first step does not pay them.
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
        quantities = configuration("economy") if quantities is None else checks.as_list(quantities)
        checks.check_quantities(quantities)
        sinks = list(sinks)
        checks.check_sinks(sinks, log, exist, fsync)
        if first_step is not None and not checks.is_step(first_step):
            raise ValueError(f"first_step must be a non-negative int, got {first_step!r}.")
        # a torch.compile'd module runs eagerly on the tracked steps (see _eager_if)
        self._compiled, model = uncompiled(model)
        model, self._ddp = unwrap(model)
        compiled_inside, model = uncompiled(model)
        self._compiled = self._compiled or compiled_inside
        # what the cockpit holds of the process's global state: released by close(), or when
        # the cockpit is garbage-collected without it
        self._held = Held()
        weakref.finalize(self, self._held.release)
        self._sharded = sharded(model, quantities)
        check_ddp_options(self._ddp, quantities)
        self._world = current_world()
        check_data_parallel(quantities, self._world)
        self.model = model
        self.quantities = quantities
        self.params, self.param_names = checks.tracked_parameters(model, params)
        self._every_parameter = params is None
        load_histogram_kernels(quantities, self.params)
        self._engine = PerSampleEngine(model, self.params)
        if self._sharded:
            self._processes = Sharded(self.params, self._world, model)
            self._engine = self._processes.engine(self._engine)
        elif self._world.size == 1 and self._ddp is None:
            self._processes = OneProcess(self.params, self._world)
        else:
            self._processes = DataParallel(self.params, self._world, self._ddp, False)
        self._since = time.perf_counter()  # when the last block ended (the per-rank view)
        self._accumulation: Accumulation | None = None  # the micro-batches seen of a step
        self._last_step: int | None = None  # the last step that finished
        self._restored = False  # whether load_state_dict ran
        self._closed = False
        sinks, logged = opened_sinks(log, sinks, self._metadata(), self._world.rank, exist, fsync)
        self._storage = Storage(sinks, OUTPUT_WINDOW if logged else None)
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
        tracked step before it); with several processes, the others raise a RuntimeError
        naming the rank and step (every process must run every tracked step), except for an
        exception before the backward under DDP, which leaves the others waiting in DDP's
        all-reduces as without the cockpit. With several processes a check that fails on
        entering is raised when the block ends instead, on every process together (the
        block's backward and DDP's all-reduces run as usual): docs/cockpit.md, "One
        collective a tracked step under DDP". A step whose
        micro-batch 0 begins while the step before has had fewer micro-batches than it
        declared skips that step, with a warning. A model changed since the cockpit was built
        (a tracked parameter replaced, removed or frozen) is refused on entering, naming what
        changed. A step whose gradients are not finite after a scaled backward
        (c != 1: a step that ``torch.amp.GradScaler`` skips) stores its Loss only, with a
        warning.
        """
        return self._track(step, info, micro_batch, micro_batches)

    @contextmanager
    def _track(self, step: int, info: dict, micro_batch: int, micro_batches: int):
        """The body of :meth:`__call__` (see there), in four stages: enter (every check;
        nothing changes before it returns), the backward (the user's block, with the hooks
        that record it), leave, and, after the step's last micro-batch, finish."""
        entry = self._enter(step, info, micro_batch, micro_batches)
        capture, part, handles = self._record(entry)
        agreement = None
        if entry.active and self._world.size > 1:  # the processes learn of one that raises
            ddp = self._ddp
            syncing = ddp is None or getattr(ddp, "require_backward_grad_sync", True)
            agreement = self._processes.agreement(entry, self._since, syncing)
            loss = entry.info.get("loss") if isinstance(entry.info, dict) else None
            handles += agreement.hooks(loss, self._processes.leaves())
        with self._interruptible(step, capture, agreement):
            try:
                yield self
            finally:
                for handle in handles:
                    if handle is not None:
                        handle.remove()
                if capture is not None:
                    capture.stop_recording()
            if agreement is not None:
                if entry.failure is not None:  # every process raises, with its message
                    agreement.raise_if_failed(agreement.agree(True))
                # (held for the quantities' sums where they can travel in it: DataParallel.defer)
                if not self._processes.defer(agreement, entry, part):
                    agreement.raise_if_failed(agreement.agree(False, part))
                    self._processes.carried(agreement.carried)
                    part.ranks = agreement.ranks
        self._leave(entry, part)

    # ------------------------------------------------------------------ the stages
    def _enter(self, step: int, info: dict, i: int, k: int) -> Entry:
        """Micro-batch ``i`` of ``k`` of ``step`` after every check (raising changes nothing):
        its active quantities and, where some are, what ``info`` says of the batch."""
        self._check_open()
        acc = self._accumulation
        if i == 0 and acc is not None and checks.is_step(step) and step > acc.step:
            self._skip_short_step(step)
        accumulation = checks.check_micro_batch(self._accumulation, step, i, k)
        if accumulation is None:
            checks.check_step(step, self._last_step, self._restored, self.quantities)
            entry = Entry(step, info, i, k, [q for q in self.quantities if q.is_active(step)])
        else:
            entry = Entry(step, info, i, k, accumulation.active, accumulation.parts)
        if entry.active and self._world.size > 1:
            # raised when the block ends, with every process (before the backward the others
            # may wait in DDP's all-reduces, which this process then makes as usual)
            try:
                self._check_batch(entry)
            except Exception as error:
                entry.failure = error
        elif entry.active:
            self._check_batch(entry)
        return entry

    def _check_batch(self, entry: Entry) -> None:
        """Check ``entry``'s info and loss graphs, and set its request, reduction, N, loss
        and (for one batch) the global batch."""
        step, info, active = entry.step, entry.info, entry.active
        if entry.index == 0:
            checks.check_model_unchanged(
                step,
                self.model,
                self.params,
                self.param_names,
                self._every_parameter,
                self._sharded,
            )
        for q in active:
            entry.request = entry.request | q.request(step)
        entry.reduction, entry.n = checks.check_info(step, info, active)
        if not entry.single:
            checks.check_micro_batch_info(
                step, entry.index, info, entry.reduction, entry.n, entry.parts
            )
        entry.loss = at_least_float32(info["loss"].detach())
        # this process's; over every process it is decided when the step's last block ends
        # (its agreement carries every process's loss and N_i)
        entry.batch = self._processes.batch(entry.loss, entry.reduction, entry.n)
        if not entry.single or checks.reads_forward(step, active):  # (on a finite loss only)
            entry.batch = with_finiteness(entry.batch)
        entry.finite = entry.batch.finite  # (None on one process until read after the backward)
        if entry.finite is not False:
            capture = self._held.capture
            checks.check_loss_graphs(step, info, active, capture, self.model)
            checks.validate_forwards(step, info, active, capture, self.model, self.params)

    def _record(self, entry: Entry):
        """Before the backward: the step takes the capture, and hooks record what its
        backward gives (the capture's gradients, the parameters' where p.grad will not keep
        them, the scale of the loss). Returns (the capture, the micro-batch's record, the
        hooks' handles)."""
        if not entry.active:
            if entry.index == 0:
                self._disarm()  # armed for this step, not needed by it
            return None, None, []
        capture, self._held.capture = self._held.capture, None
        if capture is not None:
            capture.disarm()
        if entry.failure is not None:  # the block runs with the cockpit's hooks quiet
            if capture is not None:
                capture.release()
            return None, None, []
        single, several = entry.single, self._world.size > 1
        record = bool(entry.request) and capture is not None
        record = record and (entry.finite is not False or not single)
        if single and record and (capture is None or not capture.calls):
            entry.active, entry.request = self._without_per_sample(entry.step, entry.active, 5)
            record = False
        part = Part(entry.info, entry.reduction, entry.n, entry.loss, capture if record else None)
        if record:
            capture.record_gradients()
        handles = [scale_recorder(entry.info["loss"], part)]
        # (under FSDP too: whether the batches are equal, which makes p.grad's shards the
        # global gradient's, is learnt only from the block's agreement)
        if not single or several or (record and self._sharded):
            # DDP may overwrite the tensor its hook saw with the average (also when the
            # cockpit was given the module DDP wraps), and a later micro-batch's backward adds
            # into it: keep a copy. Under FSDP each process's whole gradient arrives at the
            # unsharded parameters.
            # (under FSDP p.grad is the reduce-scattered shard, without the graph)
            graph = any(q.create_graph for q in entry.active) and (self._sharded or not single)
            leaves = self._processes.leaves() if self._sharded else self.params
            handles += record_gradients(part, leaves, several or not single, graph)
        elif record:  # (the engine's check reads the backward's own gradients)
            handles += record_fresh_gradients(part, self.params)
        return capture, part, handles

    def _leave(self, entry: Entry, part: Part | None) -> None:
        """After the block: keep a micro-batch that is not the step's last (and capture the
        next one's forward), else finish the step."""
        parts = entry.parts if part is None else [*entry.parts, part]
        if not entry.last:  # the next micro-batch's forward comes next
            self._since = time.perf_counter()
            self._accumulation = Accumulation(
                entry.step, entry.k, entry.index, entry.active, parts, entry.request
            )
            if entry.active:
                self._arm_with(entry.request)
            return
        self._accumulation = None
        if not entry.active:
            self._done(entry.step)
            return
        self._storage.store(self._finish_step(entry, parts), stacklevel=5)

    def _finish_step(self, entry: Entry, parts: list[Part]) -> dict:
        """The step's values, from its micro-batches (the last one has left its block); the
        cockpit armed for the next step, also when this one raises."""
        combined, raised = None, True
        try:
            if entry.single:
                graph = any(q.create_graph for q in entry.active)
                several = self._world.size > 1
                combined = one_batch(parts[0], self.params, graph, several)
            else:
                combined = accumulated(parts, self.params, self._engine)
            values = self._values(entry, parts, combined)
            add_learning_rates(values, entry.step, entry.info)
            raised = False
        except BaseException:
            self._drop_pending()
            raise
        finally:
            if combined is not None:
                self._processes.average_unsynced(combined.unsynced)
            for p in parts:
                if p.capture is not None:
                    p.capture.release()
            self._done(entry.step)
            if self._world.size > 1:  # the closing agreement, where no add made it
                self._processes.settle(raised)
            if self._sharded:
                self._processes.reshard_kept()
        return values

    def _values(self, entry: Entry, parts: list[Part], combined: Combined) -> dict:
        """The active quantities' values, or the loss alone at a step whose loss or
        gradients are not finite."""
        step, active, request = entry.step, entry.active, entry.request
        if self._world.size > 1:
            batch = self._processes.global_batch(parts, entry.reduction, combined.loss)
        elif entry.single:
            batch = entry.batch
        else:
            batch = self._processes.batch(combined.loss, entry.reduction, combined.n)
        batch = settled(batch, combined)
        skipped = None if batch.finite else f"the loss is {float(batch.loss)}"
        finite = combined.gradients_finite
        if skipped is None and combined.scaled and finite is None:
            finite = self._processes.finite(combined.gradients)
        if skipped is None and combined.scaled and not finite:
            skipped = "its gradients are not finite after a scaled backward (a step "
            skipped += "torch.amp.GradScaler skips)"
        if skipped is not None and self._world.size > 1:  # (the others learn of it)
            skip = self._processes.settle(False, skipped=True)
            if skip is not None:
                batch, skipped = dataclasses.replace(batch, loss=skip.loss), skip.reason
        if skipped is not None:
            return self._loss_only(step, batch.loss, skipped)
        checks.check_backward(step, active, combined.graph)
        if request and any(p.capture is None or not p.capture.calls_by_module() for p in parts):
            active, request = self._without_per_sample(step, active, 7)
        self._storage.describe_training(entry.info, batch, self._world.size)
        # computed in float32 or better, outside any autocast region
        try:
            with without_autocast(self.params[0].device.type):
                return compute(
                    entry,
                    active,
                    request,
                    combined,
                    batch,
                    model=self.model,
                    params=self.params,
                    names=self.param_names,
                    engine=self._engine,
                    processes=self._processes,
                )
        except Skipped as skip:  # learnt from the agreement that carried the sums
            return self._loss_only(step, skip.loss, skip.reason)

    def _loss_only(self, step: int, loss: Tensor, skipped: str) -> dict:
        """The loss alone, at a step whose values are skipped for the reason ``skipped``."""
        self._drop_pending()  # their ends would come two updates later
        warnings.warn(
            f"Step {step}: {skipped}; recorded the loss and skipped the other "
            "quantities at this step.",
            stacklevel=7,
        )
        return {step: {Loss.__name__: loss}}

    # ------------------------------------------------------------------ the rest of the protocol
    def log(self, step: int, **metrics) -> None:
        """Store epoch-level metrics (validation loss, accuracy, learning_rate, ...) at step."""
        self._check_open()
        if not checks.is_step(step):
            raise TypeError(f"cockpit.log(step, ...) needs a non-negative int step, got {step!r}.")
        self._storage.log(step, metrics)

    def get_output(self) -> StepValues:
        """{step: {quantity or metric name: value}} of everything computed so far, or, with a
        log, of the last ``OUTPUT_WINDOW`` steps (read the log for all of them). A dict whose
        repr abbreviates (histogram counts, many steps), so that printing it stays short."""
        return self._storage.output()

    @property
    def metadata(self) -> dict:
        """What the run log's first line says of this cockpit (versions, model, parameters,
        quantities and their declared outputs)."""
        return self._metadata()

    def state_dict(self) -> dict:
        """What a run resumed from a checkpoint needs to continue every quantity as if
        uninterrupted (Distance's theta_0, HessMaxEV's warm start, adapted histogram ranges,
        pending two-step starts). Save it with ``torch.save`` after ``optimizer.step()``."""
        return state_of(self.quantities, self.param_names, self.params)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a cockpit with the same quantities on the same
        model (version, tracked parameters and their shapes, quantities and the shapes of
        their saved tensors checked before anything changes; a state one quantity refuses
        leaves every quantity as it was)."""
        check_state(state, self.quantities, self.param_names, self.params)
        saved = state["quantities"]
        before = {q.name: q.state_dict() for q in self.quantities}
        # the pending starts themselves: a rollback keeps them, hooks included
        pending = {q: q.pending for q in self.quantities if isinstance(q, TwoStepQuantity)}
        failing = None
        try:
            for failing in self.quantities:
                failing.load_state_dict(saved[failing.name])
        except BaseException as error:  # a state a quantity refuses: the others as they were
            for q in self.quantities:
                q.load_state_dict(before[q.name])
            for q, start in pending.items():
                q.pending = start
            if isinstance(error, (KeyError, TypeError, AttributeError, IndexError)):
                raise ValueError(
                    f"The saved cockpit state of {failing.name} is corrupt "
                    f"({type(error).__name__}: {error}): load the state that "
                    "Cockpit.state_dict() gave for this model and these quantities."
                ) from error
            raise
        release_hooks([start for start in pending.values() if start is not None])
        self._restored = True

    def close(self) -> None:
        """Remove the capture's hook and close the sinks; later steps raise."""
        self._disarm()
        self._storage.close()
        self._keep_graph_if(False)
        self._eager_if(False)
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "This cockpit is closed (Cockpit.close() was called): build a new Cockpit to "
                "track further steps (Cockpit(..., log=the same path) continues its log)."
            )

    @contextmanager
    def _interruptible(self, step: int, capture, agreement: Agreement | None):
        """On an exception in the user's block: release the step and re-arm, so that the next
        step is tracked as usual; the two-step quantities drop the start that needed it. With
        several processes, the others learn of it (``agreement``)."""
        try:
            yield
        except BaseException as error:
            if agreement is not None:
                agreement.on_error(error)
            if capture is not None:
                capture.release()
            if self._sharded:  # (what a curvature step kept unsharded)
                self._processes.reshard_kept()
            if self._accumulation is not None:  # the step's earlier micro-batches
                for part in self._accumulation.parts:
                    if part.capture is not None:
                        part.capture.release()
                self._accumulation = None
            self._drop_pending()
            # the user may retry this step or go on to the next
            self._arm_with(self._request(step) | self._request(step + 1))
            raise

    def _skip_short_step(self, step: int) -> None:
        """Micro-batch 0 of ``step`` began while the step before had fewer micro-batches than
        it declared (an epoch's remainder): that step is skipped, with a warning, and
        ``step`` is tracked. Its forward was captured for the skipped step's request: where
        ``step`` needs more, its per-sample quantities are skipped (with the usual warning)."""
        acc, self._accumulation = self._accumulation, None
        for part in acc.parts:
            if part.capture is not None:
                part.capture.release()
        self._drop_pending()
        self._last_step = acc.step
        if self._request(step) | acc.request != acc.request:
            self._disarm()
        warnings.warn(
            f"Step {acc.step} had the micro-batches 0, ..., {acc.index} of the {acc.k} it "
            f"declared when step {step} began: it is skipped (nothing is stored for it, nor "
            "UpdateSize and Alpha of the tracked step before it). Give each micro-batch of a "
            "step the step's true number of micro-batches (micro_batches=2 for an epoch's "
            "last 2 batches).",
            stacklevel=5,
        )

    def _drop_pending(self) -> None:
        """Forget the two-step quantities' starts: the step that would end them is lost."""
        for q in self.quantities:
            if isinstance(q, TwoStepQuantity):
                forget_pending(q)

    def _done(self, step: int) -> None:
        """``step`` is over (stored or not): arm for the next."""
        self._since = time.perf_counter()
        self._last_step = step
        self._arm_for(step + 1)

    def _without_per_sample(self, step: int, active: list[Quantity], stacklevel: int):
        """The step's quantities without those that need per-sample statistics, with a warning
        (the capture saw no forward of the model for this step; ``stacklevel``: the user's
        frame, counted from here)."""
        skipped = [q for q in active if q.request(step)]
        for q in skipped:
            if isinstance(q, TwoStepQuantity):
                forget_pending(q)  # its start would end after two updates
        warnings.warn(
            f"Step {step}: the cockpit captured no forward pass of its model that this step's "
            f"loss was backpropagated through, so {', '.join(q.name for q in skipped)} are not "
            "computed at this "
            "step. The capture is armed after each step for the next one: call the model "
            "after the previous `with cockpit(...)` block (or after building the cockpit), "
            "compute the loss from that forward, and number steps consecutively (a run "
            "resumed at step k: Cockpit(..., first_step=k)).",
            stacklevel=stacklevel,
        )
        return [q for q in active if not q.request(step)], Request()

    def _disarm(self) -> None:
        if self._held.capture is not None:
            self._held.capture.disarm()
            self._held.capture.release()
            self._held.capture = None

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
        if needed and self._compiled and self._held.eager is None:
            self._held.eager = torch.compiler.set_stance("force_eager")  # (set on creation)
        elif not needed and self._held.eager is not None:
            self._held.eager.__exit__(None, None, None)  # the stance before
            self._held.eager = None

    def _arm_with(self, request: Request) -> None:
        """Capture the next forward for ``request`` (nothing is hooked when it is empty)."""
        self._disarm()
        if request:
            self._held.capture = self._engine.capture()
            self._held.capture.arm(request)

    def _keep_graph_if(self, needed: bool) -> None:
        """Prepare the next step's forward and backward for a second differentiation, or
        stop: the math kernel of scaled_dot_product_attention (the fused CPU kernels have no
        double backward), and under DDP its no_sync() (DDP refuses create_graph)."""
        if needed and self._held.graph_step is None:
            self._held.graph_step = MathAttention()
            self._held.graph_step.__enter__()
            self._processes.no_sync(True)
        elif not needed and self._held.graph_step is not None:
            self._processes.no_sync(False)
            self._held.graph_step.__exit__(None, None, None)
            self._held.graph_step = None

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
