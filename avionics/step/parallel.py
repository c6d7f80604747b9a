"""Data parallelism: every value of the global batch, the concatenation of the processes'.

:class:`DataParallel` has the methods of :class:`~avionics.step.batch.OneProcess`, each
over every process: the global batch's loss and size (one collective of two numbers per
process), the global gradient (DDP's average where it is the global mean's, else one
all-reduce of the processes' gradient sums), the quantities' sums added in one packed
all-reduce, and, for a step run in DDP's ``no_sync()`` (one that differentiates the gradient
again, which DDP refuses), DDP's average made by the cockpit. Under FSDP (``fully_shard``) the
quantities of :data:`SHARDED_QUANTITIES` are computed from the shards (:func:`sharded`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from avionics.distributed import World, all_processes, sum_over_processes
from avionics.step.batch import local, zeros_where_none
from avionics.step.precision import all_finite, unscaled
from avionics.step.values import Batch, Combined

# What a cockpit computes on parameters FSDP shards (each process holds a shard of each).
SHARDED_QUANTITIES = ("Loss", "GradNorm", "Distance", "UpdateSize", "Time")


class DataParallel:
    """The step over the processes of ``world``: ``model`` plain or wrapped in ``ddp`` (a
    ``DistributedDataParallel``, or None), its parameters whole or ``sharded`` by FSDP."""

    def __init__(self, params: list, world: World, ddp, sharded: bool):
        self.params, self.world, self.ddp, self.sharded = params, world, ddp, sharded
        self._no_sync = None  # DDP's no_sync(), while entered
        self._ddp_average: list[Tensor] | None = None

    def parameters(self) -> list[Tensor]:
        """The tracked parameters' values (this process's shards under FSDP), detached."""
        return [local(p).detach() for p in self.params]

    def batch(self, loss: Tensor, reduction: str, n: int | None) -> Batch:
        """The step's loss, batch size and finiteness over every process (one collective of
        two numbers per process when there are several)."""
        world = self.world
        if world.size == 1:
            return Batch(loss, n, (n,), bool(torch.isfinite(loss)))
        mine = torch.tensor([float(n or 1), float(loss)], dtype=torch.float64)
        sizes, losses = all_processes(mine, world).unbind(1)
        total = int(sizes.sum())
        if reduction == "mean":  # the mean over all samples: sum_r N_r L_r / N
            global_loss = (sizes * losses).sum() / total
        else:
            global_loss = losses.sum()
        return Batch(
            global_loss.to(loss),
            total if n is not None else None,
            tuple(int(s) for s in sizes.tolist()),
            bool(torch.isfinite(losses).all()),
        )

    def check_batch(self, step: int, batch: Batch) -> None:
        """With FSDP's sharded parameters, the processes' batches are equal."""
        if self.sharded and len(set(batch.sizes)) > 1:
            raise ValueError(
                f"Step {step}: the processes' batches have {list(batch.sizes)} samples; "
                "with FSDP's sharded parameters the cockpit needs equal batches (FSDP "
                "averages the processes' gradients, which is the global batch's only then)."
            )

    def gradients(self, combined: Combined, reduction: str, batch: Batch) -> list[Tensor]:
        """The gradient of the global loss (as reduced), per tracked parameter.

        Under DDP with equal batches, DDP's average of the processes' gradients is the global
        mean's (a step in no_sync() makes that all-reduce itself). Otherwise the processes'
        gradient sums sum_n grad l_n are added (one all-reduce of the parameters' size; with
        the average that DDP would have made packed in, when this step ran in no_sync).
        Micro-batches: the combined gradient of all of them (p.grad holds their c_i-weighted
        sum). Every gradient is divided by the measured backward scale c."""
        world, params = self.world, self.params
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
        if packed:
            flat = torch.cat([g.reshape(-1) for g in local_gradients])
            *sums, self._ddp_average = _split(sum_over_processes(sums + [flat], world), params)
        else:
            sums = sum_over_processes(sums, world)
        total = batch.size or sum(batch.sizes)
        return [s / total for s in sums] if reduction == "mean" else sums

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
        of a number)."""
        flag = torch.tensor([0.0 if all_finite(gradients) else 1.0], dtype=torch.float64)
        if self.world.size > 1:
            (flag,) = sum_over_processes([flag], self.world)
        return bool(flag == 0)

    def add(self, sums: dict[str, dict[str, Tensor]]) -> dict[str, dict[str, Tensor]]:
        """The quantities' sums added over the processes, in one packed all-reduce."""
        if self.world.size == 1:
            return sums
        keys = [(q, name) for q, named in sums.items() for name in named]
        # a tensor that several quantities share (the same object) travels once
        distinct = list({id(sums[q][name]): sums[q][name] for q, name in keys}.values())
        totals = dict(zip(map(id, distinct), sum_over_processes(distinct, self.world)))
        out: dict[str, dict[str, Tensor]] = {q: {} for q in sums}
        for q, name in keys:
            out[q][name] = totals[id(sums[q][name])]
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


def sharded(model: nn.Module, quantities: list) -> bool:
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
    distributed = [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if not distributed:
        return False
    _check_fsdp_placements(model, distributed)
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


def _check_fsdp_placements(model: nn.Module, distributed: list) -> None:
    """The DTensor parameters are FSDP's (``fully_shard``: each Shard(0) over a mesh of one
    dimension); tensor parallelism (``parallelize_module``: Replicate, Shard(1), or Shard(0)
    without fully_shard) and HSDP's two-dimensional meshes are refused by name: their
    gradients are not the processes' batches' (a replicated parameter's would count twice)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    remedy = (
        "The cockpit supports FSDP's sharding only (torch.distributed.fsdp.fully_shard, "
        "Shard(0) over one mesh dimension): train under fully_shard alone or "
        "DistributedDataParallel, or leave the cockpit out of a tensor-parallel run."
    )
    for name, p in distributed:
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise TypeError(
                f"Cockpit: the parameter '{name}' is a DTensor with placements "
                f"{tuple(p.placements)} over a mesh of {p.device_mesh.ndim} dimension(s): "
                f"tensor parallelism (parallelize_module) or HSDP is not supported. {remedy}"
            )
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        name, p = distributed[0]
        raise TypeError(
            f"Cockpit: the parameter '{name}' is a DTensor (placements {tuple(p.placements)}) "
            f"but no module of the model is sharded by fully_shard: tensor parallelism "
            f"(parallelize_module, distribute_module) is not supported. {remedy}"
        )


class Agreement:
    """Whether every process got through micro-batch ``index`` of ``step``'s block: each
    process takes part in the same small collectives (a flag per process, summed), once at its
    backward's first gradient of a tracked parameter (before DDP's collectives of that
    backward) and once when its block ends, normally or by an exception; a process that has
    learnt of a failure takes part in no further one. So the processes still running learn
    which rank raised, at which step, instead of a collective mismatch."""

    def __init__(self, step: int, index: int, params: list, world: World):
        self.step, self.index, self.world = step, index, world
        self.device = local(params[0]).device
        self.failed: list[int] | None = None  # the ranks that raised, once learnt
        self.backward_agreed = False

    def agree(self, raised: bool) -> list[int]:
        """The ranks whose block raised (this one's ``raised`` included); [] where none."""
        if self.failed is not None:
            return self.failed
        mine = torch.tensor([float(raised)], dtype=torch.float64, device=self.device)
        flags = all_processes(mine, self.world)[:, 0].tolist()
        failed = [rank for rank, flag in enumerate(flags) if flag]
        if failed:
            self.failed = failed
        return failed

    def first_gradient(self, grad: Tensor) -> None:
        """A hook on each tracked parameter: at the backward's first gradient of one (before
        DDP's hook of that parameter can start an all-reduce), raise if a process failed."""
        if not self.backward_agreed:
            self.backward_agreed = True
            self.raise_if_failed(self.agree(False))

    def raise_if_failed(self, failed: list[int]) -> None:
        if failed:
            raise RuntimeError(
                f"Step {self.step}, micro-batch {self.index}: the process(es) of rank "
                f"{', '.join(map(str, failed))} raised inside their `with cockpit(...)` block "
                f"(rank {self.world.rank} here; see that process's traceback for the error). "
                "The step is abandoned on every process, nothing stored. Under data "
                "parallelism every process runs every tracked step: handle an error on every "
                "process alike (stop the run, or retry the step on all of them)."
            )
