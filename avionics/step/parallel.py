"""Data parallelism: every value of the global batch, the concatenation of the processes'.

:class:`DataParallel` has the methods of :class:`~avionics.step.batch.OneProcess`, each
over every process: the global batch's loss and sizes (carried by the step's agreement,
:class:`Agreement`, made when each block ends, through which every process learns of one
that failed: no collective of their own), the global gradient (DDP's average where it is the
global mean's, else the processes' gradient sums, carried by the same agreement), the
quantities' sums (under DDP with equal batches, in that agreement too, held for them:
:meth:`DataParallel.defer`; so a tracked economy step makes one collective, docs/cockpit.md
"One collective a tracked step under DDP"), and, for a step run in DDP's ``no_sync()`` (one
that differentiates the gradient again, which DDP refuses), DDP's average made by the
cockpit. Parameters sharded by FSDP2 (``fully_shard``): :class:`avionics.step.sharded.Sharded`,
which extends it.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import suppress
from functools import partial

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from avionics.distributed import World, messages_of_processes, sum_over_processes
from avionics.step.batch import local, zeros_where_none
from avionics.step.precision import all_finite, unscaled
from avionics.step.values import Batch, Combined, Entry, Part


class Skipped(Exception):
    """A step whose values every process skips but for its loss, learnt from its agreement:
    the global batch's ``loss`` and the ``reason`` (for the warning)."""

    def __init__(self, loss: Tensor, reason: str):
        super().__init__(reason)
        self.loss, self.reason = loss, reason


class DataParallel:
    """The step over the processes of ``world``: ``model`` plain or wrapped in ``ddp`` (a
    ``DistributedDataParallel``, or None), its parameters whole or ``sharded`` by FSDP."""

    def __init__(self, params: list, world: World, ddp, sharded: bool):
        self.params, self.world, self.ddp, self.sharded = params, world, ddp, sharded
        self._no_sync = None  # DDP's no_sync(), while entered
        self._ddp_average: list[Tensor] | None = None
        self._gradient_sums: Tensor | None = None  # carried by the step's closing agreement
        self._gradient_carried = False  # whether the last closing agreement carried them
        # whether the processes' batches were equal at the last single-batch step whose
        # agreement every process made (None before the first): what the next step's
        # agreement is laid out for, before any process knows the others' N_r
        self._equal: bool | None = None
        # float64 numbers of the quantities' sums at the last step of each set of active
        # quantities that every process finished: the room its closing agreement keeps for them
        self._sums_room: dict[tuple[str, ...], int] = {}
        self._deferred: tuple[Agreement, Entry, Part] | None = None  # a closing held for add
        self._riding: Tensor | None = None  # the sums packed into the closing being made
        self._agreed_batch: Batch | None = None  # learnt from the held agreement, for agreed

    def agreement(self, entry: Entry, since: float, syncing: bool) -> Agreement:
        """The agreement of ``entry``'s block (its micro-batch under its step): made when the
        block ends, and under FSDP also when its backward starts (before FSDP's pre-backward
        all-gathers, which a process that raised before its backward would not make).
        ``syncing``: whether the others may wait in a collective of the backward (DDP's
        all-reduces) that a process which raised before its backward never makes."""
        agreement = Agreement(
            entry.step,
            entry.index,
            self.params,
            self.world,
            entry.loss,
            entry.n,
            since,
            at_backward=self.sharded,
            syncing=syncing,
            error=entry.failure,
        )
        agreement.closing = partial(self.closing, entry)
        return agreement

    def leaves(self) -> list[Tensor]:
        """The tensors the backward's gradients of the tracked parameters arrive at."""
        return self.params

    def parameters(self) -> list[Tensor]:
        """The tracked parameters' values (this process's shards under FSDP), detached."""
        return [local(p).detach() for p in self.params]

    def batch(self, loss: Tensor, reduction: str, n: int | None) -> Batch:
        """This process's loss, batch size and finiteness (no collective: the global batch
        comes with the step's agreement, :meth:`global_batch`)."""
        return Batch(loss, n, (n,), bool(torch.isfinite(loss)))

    def global_batch(self, parts: list[Part], reduction: str, like: Tensor) -> Batch:
        """The step's batch over every process, from the rows its micro-batches' agreements
        gathered (:data:`ROW`; no further collective). Where the agreement is held for the
        quantities' sums (:meth:`defer`), the batch it was laid out for: every process's N_r
        this one's (equal batches, as at the step before), the loss and its finiteness this
        process's until the agreement is made (:meth:`agreed`)."""
        if self._deferred is not None:
            n = parts[0].n
            sizes = (n or 1,) * self.world.size
            return Batch(like, None if n is None else sum(sizes), sizes, None)
        batch = _batch_of([part.ranks for part in parts], reduction, parts, like)
        if len(parts) == 1:
            self._equal = len(set(batch.sizes)) == 1
        return batch

    def agreed(self, data) -> None:
        """Give ``data`` (the step's :class:`~avionics.quantities.StepData`) the global loss
        and every process's row, learnt from the held agreement that carried the sums."""
        batch, self._agreed_batch = self._agreed_batch, None
        if batch is not None:
            data.loss = batch.loss
            data.parallel = dataclasses.replace(data.parallel, ranks=batch.ranks)

    def gradients(self, combined: Combined, reduction: str, batch: Batch) -> list[Tensor]:
        """The gradient of the global loss (as reduced), per tracked parameter.

        Under DDP with equal batches, DDP's average of the processes' gradients is the global
        mean's (a step in no_sync() makes that all-reduce itself). Otherwise the processes'
        gradient sums sum_n grad l_n are added (carried by the block's agreement, or one
        all-reduce of the parameters' size; with the average that DDP would have made packed
        in, when this step ran in no_sync). Micro-batches: the combined gradient of all of
        them (p.grad holds their c_i-weighted sum). Every gradient is divided by the measured
        backward scale c."""
        world, params = self.world, self.params
        carried, self._gradient_sums = self._gradient_sums, None
        own = combined.single  # p.grad is the gradient of this step's one backward
        local_gradients = zeros_where_none(combined.gradients, params)
        if world.size == 1:
            return local_gradients
        equal = len(set(batch.sizes)) == 1
        synced = self.sharded or (self.ddp is not None and self._no_sync is None)
        if own and synced and equal:
            averaged = [
                unscaled(local(p.grad).detach(), combined.scale)
                if p.grad is not None
                else torch.zeros_like(local(p))
                for p in params
            ]
            return averaged if reduction == "mean" else [g * world.size for g in averaged]
        # DDP's average is packed in only where it is that of the gradients used here
        packed = own and not combined.scaled and self.ddp is not None and self._no_sync is not None
        if packed and equal:
            # equal batches: the all-reduce DDP skipped gives both (sum_r g_r / W is DDP's
            # average, and the global mean for a mean-reduced loss)
            summed = sum_over_processes(local_gradients, world)
            self._ddp_average = summed
            return [g / world.size for g in summed] if reduction == "mean" else summed
        weight = batch.sizes[world.rank] if reduction == "mean" else 1
        sums = [g * weight for g in local_gradients]
        if carried is not None:  # added by the block's closing agreement
            parts = carried.split([g.numel() for g in sums])
            sums = [t.view_as(g).to(g.device, g.dtype) for t, g in zip(parts, sums, strict=True)]
        elif packed:
            flat = torch.cat([g.reshape(-1) for g in local_gradients])
            *sums, self._ddp_average = _split(sum_over_processes(sums + [flat], world), params)
        else:
            sums = sum_over_processes(sums, world)
        total = batch.size or sum(batch.sizes)
        return [s / total for s in sums] if reduction == "mean" else sums

    def closing(self, entry: Entry, part: Part | None) -> list[Tensor]:
        """What a block's closing agreement carries besides the rows (``part`` None from a
        process that raised, which sends zeros of the same sizes; every process decides
        alike, before any knows the others' N_r: from whether the batches were equal at the
        last single-batch step, :attr:`_equal`, and the step's active quantities):

        * the gradient sums sum_n grad l_n (N_r g_r for a mean; c divided out), one flat
          float64 tensor, at a single-batch step outside no_sync whose global gradient may
          not be DDP's average (no DDP; the batches unequal at the last step, or no last
          step), so that the gradient needs no all-reduce of its own;
        * at a step whose closing can wait for the quantities' sums (:meth:`_can_ride`),
          the room for them: as many float64 numbers as the sums of the last step with the
          same active quantities (:meth:`add` packs them in where they fit)."""
        single = entry.single and not self.sharded and self._no_sync is None
        self._gradient_carried = single and (self.ddp is None or self._equal is not True)
        carried = []
        if self._gradient_carried:
            carried.append(self._gradient_sum(entry, part))
        if self._can_ride(entry):
            room = self._sums_room.get(_names(entry), 0)
            riding = self._riding if part is not None else None
            if riding is None:
                device = local(self.params[0]).device
                riding = torch.zeros(room, dtype=torch.float64, device=device)
            carried.append(riding)
        return carried

    def _gradient_sum(self, entry: Entry, part: Part | None) -> Tensor:
        """This process's gradient sums, flat float64 (zeros from a process that raised)."""
        if part is None:
            count = sum(local(p).numel() for p in self.params)
            return torch.zeros(count, dtype=torch.float64, device=local(self.params[0]).device)
        c = part.scale()
        weight = (part.n or 1) if entry.reduction == "mean" else 1  # N_r, as its row says
        gradients = zeros_where_none([unscaled(g, c) for g in part.gradients], self.params)
        return torch.cat([(g * weight).reshape(-1).to(torch.float64) for g in gradients])

    def _can_ride(self, entry: Entry) -> bool:
        """Whether the step's quantities' sums can travel in its closing agreement: a single
        batch under DDP outside no_sync, the batches equal at the last step (the gradient is
        then DDP's average, and no collective comes before the sums: :meth:`agreed` checks
        that they still are), no quantity that differentiates the gradient again or adds over
        the processes itself."""
        if not entry.single or self.sharded or self.ddp is None or self._no_sync is not None:
            return False
        if self._equal is not True:
            return False
        return not any(q.create_graph or q.adds_over_processes for q in entry.active)

    def defer(self, agreement: Agreement, entry: Entry, part: Part) -> bool:
        """Hold the block's closing agreement for :meth:`add` (which then carries the sums in
        it) where the sums can ride (:meth:`_can_ride`); the step makes no collective before
        it. False: make it now."""
        if not self._can_ride(entry):
            return False
        self._deferred = agreement, entry, part
        return True

    def settle(self, raised: bool, skipped: bool = False) -> Skipped | None:
        """Make the held closing agreement, if :meth:`add` did not (a step whose values were
        skipped here, ``skipped``, or that raised here, ``raised``: which the others learn),
        with its room for the sums empty. Returns the skip every process learnt from it, if
        any (:meth:`_learnt`)."""
        if self._deferred is None:
            return None
        agreement, entry, part = self._deferred
        self._deferred = None
        if raised:  # (the error that raised goes on; the group may be broken already)
            with suppress(Exception):
                agreement.agree(True)
            return None
        agreement.skipped = skipped
        agreement.raise_if_failed(agreement.agree(False, part))
        return self._learnt(agreement, entry, part)

    def _learnt(self, agreement: Agreement, entry: Entry, part: Part) -> Skipped | None:
        """What the held agreement told every process: the global batch (kept for
        :meth:`agreed`), and whether the step's values are skipped, every process alike: a
        loss not finite, a process that skipped them (gradients not finite after a scaled
        backward), or batches no longer equal (the sums were made for equal ones)."""
        part.ranks = agreement.ranks
        batch = _batch_of([agreement.ranks], entry.reduction, [part], part.loss)
        assumed = (part.n or 1,) * self.world.size
        self._equal = len(set(batch.sizes)) == 1
        self._agreed_batch = batch
        skipping = [rank for rank, skipped in enumerate(agreement.skips) if skipped]
        if not batch.finite:
            reason = f"the loss is {float(batch.loss)}"
        elif skipping:
            reason = (
                f"the gradients of rank {', '.join(map(str, skipping))} are not finite after "
                "a scaled backward (a step torch.amp.GradScaler skips)"
            )
        elif batch.sizes != assumed:
            reason = (
                f"the processes' batch sizes {batch.sizes} are unequal, where they were equal "
                "at the tracked step before: its per-sample sums, made for equal batches, do "
                "not hold (the next steps carry the gradient sums for unequal ones)"
            )
        else:
            return None
        self._agreed_batch = None
        return Skipped(batch.loss, reason)

    def carried(self, summed: list[Tensor]) -> None:
        """Keep the gradient sums the block's closing agreement carried (see :meth:`closing`;
        none: the step all-reduces them itself)."""
        self._gradient_sums = summed[0] if summed and self._gradient_carried else None

    def local_gradients(self, combined: Combined) -> list[Tensor] | None:
        """This process's gradient of its own loss, before any all-reduce (None where the
        parameters are sharded)."""
        if self.world.size == 1 or self.sharded:
            return None
        return [
            g if g is not None else torch.zeros_like(p)
            for g, p in zip(combined.gradients, self.params, strict=True)
        ]

    def finite(self, gradients: list[Tensor | None]) -> bool:
        """Whether every process's gradients are finite (one host transfer; one collective
        of a number, after the held closing agreement), or, where the closing agreement is
        held for the sums, this process's (its row there says whether it skips the step)."""
        finite = all_finite(gradients)
        if self.world.size == 1 or self._deferred is not None:
            return finite
        flag = torch.tensor([0.0 if finite else 1.0], dtype=torch.float64)
        (flag,) = sum_over_processes([flag], self.world)
        return bool(flag == 0)

    def add(self, sums: dict[str, dict[str, Tensor]]) -> dict[str, dict[str, Tensor]]:
        """The quantities' sums added over the processes: in the step's closing agreement
        where it was held for them (:meth:`defer`) and they fit in its room, else in one
        packed all-reduce of their own (after the held agreement, with its room empty).
        Raises :class:`Skipped` where the held agreement says every process skips the
        step's values (:meth:`_learnt`)."""
        if self.world.size == 1:
            return sums
        keys = [(q, name) for q, named in sums.items() for name in named]
        # a tensor that several quantities share (the same object) travels once
        distinct = list({id(sums[q][name]): sums[q][name] for q, name in keys}.values())
        totals = dict(zip(map(id, distinct), self._summed(distinct)))
        out: dict[str, dict[str, Tensor]] = {q: {} for q in sums}
        for q, name in keys:
            out[q][name] = totals[id(sums[q][name])]
        return out

    def _summed(self, tensors: list[Tensor]) -> list[Tensor]:
        """``tensors`` added over the processes, in the held closing agreement where they fit
        (the room of their active quantities then grows to their size for the next step)."""
        count = sum(t.numel() for t in tensors)
        if self._deferred is None:
            return sum_over_processes(tensors, self.world)
        agreement, entry, part = self._deferred
        key = _names(entry)
        space = self._sums_room.get(key, 0)
        if count > space:
            skip = self.settle(False)
            if skip is not None:
                raise skip
            self._sums_room[key] = count  # every process finished the step alike
            return sum_over_processes(tensors, self.world)
        self._deferred = None
        device = local(self.params[0]).device
        room = torch.zeros(space, dtype=torch.float64, device=device)
        if count:
            room[:count] = torch.cat([t.detach().reshape(-1).to(room) for t in tensors])
        self._riding = room
        try:
            agreement.raise_if_failed(agreement.agree(False, part))
        finally:
            self._riding = None
        skip = self._learnt(agreement, entry, part)
        if skip is not None:
            raise skip
        flat = agreement.carried[-1]
        out, start = [], 0
        for t in tensors:
            out.append(flat[start : start + t.numel()].view(t.shape).to(t.device, t.dtype))
            start += t.numel()
        return out

    def average_unsynced(self, gradients) -> None:
        """A step run in DDP's no_sync(): give each parameter the gradient DDP would have,
        the average over the processes of ``gradients`` (theirs, as backpropagated)."""
        if self.ddp is None or self._no_sync is None:
            return
        average = self._ddp_average
        if average is None:
            average = sum_over_processes(zeros_where_none(gradients, self.params), self.world)
        else:
            average = list(average)
        self._ddp_average = None
        for p, g in zip(self.params, average):
            p.grad = (g / self.world.size).to(p.dtype).detach()

    def no_sync(self, needed: bool) -> None:
        """Run the next steps' forwards and backwards in DDP's ``no_sync()`` (for a step that
        differentiates the gradient again: DDP refuses create_graph), or stop."""
        if needed and self.ddp is not None and self._no_sync is None:
            self._no_sync = self.ddp.no_sync()
            self._no_sync.__enter__()
        elif not needed and self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
            self._no_sync = None


def _batch_of(rows: list[Tensor], reduction: str, parts: list[Part], like: Tensor) -> Batch:
    """The step's batch from its micro-batches' ``rows`` (each [W, 3]: :data:`ROW`'s batch size,
    loss and seconds): N_r = sum_i N_ri, the loss sum_r sum_i N_ri L_ri / N for a mean
    (sum_r sum_i L_ri for a sum), finite when every L_ri is, and per process (N_r, L_r, its
    time) for the per-rank view."""
    sizes = sum(r[:, 0] for r in rows)
    if reduction == "mean":  # L_r = sum_i N_ri L_ri / N_r, the loss sum_r N_r L_r / N
        totals = sum(r[:, 0] * r[:, 1] for r in rows)
        losses, loss = totals / sizes, totals.sum() / sizes.sum()
    else:
        losses = sum(r[:, 1] for r in rows)
        loss = losses.sum()
    finite = torch.isfinite(torch.stack([r[:, 1] for r in rows])).all()
    known = all(part.n is not None for part in parts)
    counts = [int(s) for s in sizes.tolist()]
    return Batch(
        loss.to(like),
        sum(counts) if known else None,
        tuple(counts),
        bool(finite),
        ranks=torch.stack([sizes, losses, sum(r[:, 2] for r in rows)], 1),
    )


def _names(entry: Entry) -> tuple[str, ...]:
    """The step's active quantities, by name: what the room for their sums is kept under."""
    return tuple(q.name for q in entry.active)


def _split(flat: list[Tensor], params) -> list:
    """[*per-parameter tensors, per-parameter views of the last (flat) tensor]."""
    *head, packed = flat
    return [
        *head,
        [t.view_as(p) for t, p in zip(packed.split([p.numel() for p in params]), params)],
    ]


def check_ddp_options(ddp, quantities: list) -> None:
    """DDP's options allow the quantities (static_graph refuses a second differentiation)."""
    graph = [q.name for q in quantities if q.create_graph]
    if ddp is not None and getattr(ddp, "static_graph", False) and graph:
        raise ValueError(
            f"{', '.join(graph)} differentiate the gradient again (backward with "
            "create_graph=True), which DistributedDataParallel(static_graph=True) refuses, also "
            'in no_sync() ("a leaf Variable that requires grad is being used in an in-place '
            'operation"). Wrap the model with static_graph=False, or leave these quantities '
            "out."
        )


# What each process sends at a tracked micro-batch's first agreement: one row of the slots
# (:meth:`~avionics.distributed.World.slots`), the same size whether its block raised or not;
# a later agreement (under FSDP, the block's end after the backward's start) sends the first
# column only (every process knows it took part in the first one). L_i finite is read from the
# sums (a non-finite L_i leaves its own slot so). "skipped": this process skips the step's
# values (its gradients not finite after a scaled backward), so every process does.
ROW = ("raised", "batch size N_i", "loss L_i", "seconds since the last block", "skipped")


class Agreement:
    """Whether every process got through micro-batch ``index`` of ``step``'s block: each
    process takes part in the same small collective (a row of :data:`ROW` per process,
    summed) when its block ends, normally or by an exception, and under FSDP (``at_backward``)
    also when its backward starts (the gradient of the loss, :meth:`hooks`: before FSDP's
    pre-backward all-gathers); a process that has learnt of a failure takes part in no further
    one. So the processes still running learn which rank failed, at which step, and its
    error's message, instead of a collective mismatch.

    An error of the cockpit's own found before the backward (``error``: a bad ``info`` on one
    process) is not raised there: the process's block runs with the cockpit's hooks quiet (its
    backward makes DDP's all-reduces as usual) and its agreement says it failed, so that every
    process raises together. An error of the user's code before the backward is the user's:
    where the others may wait in a collective of that backward (``syncing``: DDP's all-reduces),
    the process makes no agreement and the others wait as they would without the cockpit.

    The same collective carries the micro-batch's size N_i and loss L_i (``loss``, ``n``) and
    the seconds from ``since`` (the end of the process's previous block) to its backward's
    start (its optimizer step, data loading and forward, which no collective of the step waits
    in). ``ranks``: every process's (N_i, L_i, seconds), [W, 3], from the first agreement; the
    step's global batch is made of them (no collective of its own)."""

    def __init__(
        self,
        step: int,
        index: int,
        params: list,
        world: World,
        loss: Tensor | None,
        n: int | None,
        since: float,
        *,
        at_backward: bool,
        syncing: bool,
        error: BaseException | None,
    ):
        self.step, self.index, self.world = step, index, world
        self.device = local(params[0]).device
        self.loss, self.n, self.since = loss, n, since
        self.at_backward, self.syncing, self.error = at_backward, syncing, error
        self.message = ""  # this process's error, as the others read it, once it raised
        self.skipped = False  # whether this process skips the step's values
        self.began: float | None = None  # when the backward's first gradient arrived
        self.failed: list[int] | None = None  # the ranks that raised, once learnt
        self.messages: list[str] = []  # every process's message, once a failure is learnt
        self.ranks: Tensor | None = None
        self.skips: list[bool] = []  # every process's "skipped", from the first agreement
        self.closing = None  # what the closing agreement carries (see agree)
        self.carried: list[Tensor] = []

    def agree(self, raised: bool, part: Part | None = None) -> list[int]:
        """The ranks whose block raised (this one's ``raised``, or its ``error``, included);
        [] where none.

        The closing agreement also carries what ``closing(part)`` gives (``part`` None from a
        process that raised; :meth:`DataParallel.closing`), added over the processes into
        ``carried``. Where a process failed, every process's message follows in a second
        collective (on that path only)."""
        if self.failed is not None:
            return self.failed
        raised = raised or self.error is not None
        first = self.ranks is None
        closes = self.closing is not None and not (first and self.at_backward)
        carried = self.closing(None if raised else part) if closes else []
        table, *self.carried = sum_over_processes(
            [self.world.slots(self._row(raised)), *carried], self.world
        )
        head = table.tolist() if first else table[:, :1].tolist()  # one host transfer
        if first:
            self.ranks = table[:, 1:4]
            self.skips = [bool(row[4]) for row in head]
        failed = [rank for rank, (flag, *_) in enumerate(head) if flag]
        if failed:
            self.failed = failed
            self.messages = messages_of_processes(self._message(raised), self.world, self.device)
        return failed

    def _message(self, raised: bool) -> str:
        """This process's error as the others read it ("" where it did not raise)."""
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        return self.message if raised else ""

    def _row(self, raised: bool) -> Tensor:
        """This process's row of :data:`ROW` on the parameters' device (its first column only
        once the first agreement has been made)."""
        if self.ranks is not None:
            return torch.tensor([float(raised)], dtype=torch.float64, device=self.device)
        seconds = (self.began or time.perf_counter()) - self.since
        loss = torch.zeros(1) if self.loss is None else self.loss.detach().reshape(1)
        head = torch.tensor([float(raised), float(self.n or 1)], dtype=torch.float64)
        tail = torch.tensor([seconds, float(self.skipped)], dtype=torch.float64)
        parts = (head, loss.to(torch.float64), tail)
        return torch.cat([t.to(self.device) for t in parts])

    def hooks(self, loss, leaves: list[Tensor]) -> list[RemovableHandle]:
        """Note when the backward starts (and under FSDP make the first agreement there, and
        raise there if a process failed): when its gradient arrives at ``loss`` (the block's
        ``info["loss"]``), before any other hook on it runs, so before the backward reaches a
        layer and before every collective of the backward (FSDP's pre-backward all-gathers,
        whose hook sits on ``loss`` itself where the loss is an output of a fully_shard'ed
        module); else, for a backward of another tensor than ``loss``, at the first gradient
        of a tracked parameter (``leaves``: where the gradients arrive; under FSDP its
        pre-backward all-gathers come before: backpropagate a multiple of ``info["loss"]``
        itself)."""
        handles = [leaf.register_hook(self._at_backward) for leaf in leaves]
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            return handles
        handle = loss.register_hook(self._at_backward)
        hooks = loss._backward_hooks  # the hooks run in its insertion order: ours first
        others = [(key, hooks.pop(key)) for key in list(hooks) if key != handle.id]
        hooks.update(others)
        return [handle, *handles]

    def _at_backward(self, grad: Tensor) -> None:
        """The backward's start, once (see :meth:`hooks`)."""
        if self.began is None:
            self.began = time.perf_counter()
            if self.at_backward:
                self.raise_if_failed(self.agree(False))

    def on_error(self, error: BaseException) -> None:
        """The user's block raised ``error``: tell the others, where they cannot be waiting
        in a collective of the backward that this process does not make (a backward begun,
        under FSDP the agreement at its start, or none that synchronises)."""
        if self.at_backward or self.began is not None or not self.syncing:
            self.message = f"{type(error).__name__}: {error}"
            with suppress(Exception):  # (the process group may be broken already)
                self.agree(True)

    def raise_if_failed(self, failed: list[int]) -> None:
        if not failed:
            return
        told = "; ".join(
            f"rank {rank}: {self.messages[rank]}" if self.messages[rank] else f"rank {rank}"
            for rank in failed
        )
        raise RuntimeError(
            f"Step {self.step}, micro-batch {self.index}: the process(es) of rank "
            f"{', '.join(map(str, failed))} raised inside their `with cockpit(...)` block "
            f"(rank {self.world.rank} here; {told}; see that process's traceback). The step "
            "is abandoned on every process, nothing stored. Under data parallelism every "
            "process runs every tracked step: handle an error on every process alike (stop "
            "the run, or retry the step on all of them)."
        ) from self.error
