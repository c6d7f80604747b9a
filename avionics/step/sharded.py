"""Sharded parameters (FSDP2, ``torch.distributed.fsdp.fully_shard``): the global batch's values
from the shards.

Under FSDP2 process r holds, of every parameter theta^(k) of shape [d_k, ...], the rows of
its shard (``torch.chunk`` over the processes along dim 0, ``DTensor`` with ``Shard(0)``),
and its own samples' whole layer inputs and output gradients: FSDP all-gathers each layer's
parameters before the layer runs, so the per-sample gradients g_n of the process's samples
are whole, whatever the sharding. What differs from data parallelism is only what is
sharded after the backward:

* the gradient: ``p.grad`` is process r's shard of FSDP's average over the processes of their
  gradients, (1/R) sum_r c_r grad L_r. With equal batches it is the shard of the global mean
  gradient g (times the backward scale c). With unequal batches it is not, so the cockpit
  records each process's whole local gradient as its backward makes it (hooks on FSDP's
  unsharded parameters, before FSDP reduce-scatters them) and adds the processes' gradient
  sums sum_{n in r} grad l_n, as under DDP (one all-reduce of the parameters' size); each
  process keeps its shard of the result.
* the directions the per-sample statistics project onto (the mean gradient g of the gradient
  tests, Alpha's update theta_{t+1} - theta_t): g_n . v = sum_k <g_n^(k), v^(k)> needs v
  whole, and process r has the shard of v and the g_n of its own samples only. The shards of
  every direction a statistics call names are all-gathered in one packed collective per call
  (:meth:`ShardLayout.gather`), but for those the call before gathered (:meth:`Sharded.whole`):
  the step's first call also carries the step's mean gradient, so that an economy step
  makes one all-gather of its directions: the mean gradient g_{t+1} with Alpha's update s_t
  (measured at its end step under sharding, not when ``optimizer.step()`` returns), twice
  the parameters' size, beside the all-gathers FSDP makes of them at each forward.
* the parameters themselves, for the few rules of the per-sample engine that read them
  (nn.MultiheadAttention's, the recurrent layers', the generic rule: :func:`reads_parameters`):
  FSDP's ``unshard()`` puts them whole on their modules while the engine runs, and theta_t,
  where Alpha's projection after ``optimizer.step()`` swaps it in, is gathered with the
  directions.

* the curvature quantities' second differentiation (Hessian-vector products, the Hessian
  diagonal's probes, the GGN's columns backpropagated through the forward graph): the
  step's graph reads the layers' unsharded parameters, which FSDP frees after the
  backward. A curvature step keeps them through its backward (:meth:`Sharded.no_sync`:
  FSDP's reshard_after_backward off from the step before, restored after) and reshards
  them when its values are computed (:meth:`Sharded.reshard_kept`). Each process's
  gradient with its graph is recorded at FSDP's unsharded parameters (:meth:`leaves`,
  :attr:`~avionics.quantities.base.StepData.leaves`), so its product is H_r v of its own
  loss, whole; the global loss's H v = sum_r w_r H_r v (w_r = N_r / N for a mean, 1 for a
  sum) is one all-reduce of the parameters' size per product, and a diagonal
  sum_r w_r h_r one per step, exactly as under DDP. PreconditionedSharpness's P^{-1/2} is
  made from the shards of the gradient, parameters and optimizer state and all-gathered
  once per step (:meth:`~avionics.quantities.base.Parallel.whole`).

Norms of parameters and gradients are of the whole parameters, from the shards' squared norms
added over the processes (:func:`avionics.quantities.base.whole_norms`). The quantities whose
computation needs the whole parameters or the mean gradient per coordinate at every step
(GradHist2d, MeanGSNR, ...) are refused by name (:func:`sharded`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from avionics.distributed import World, collective_device, sum_over_processes
from avionics.persample.rules import rule_for
from avionics.persample.rules.attention import AttentionRule
from avionics.persample.rules.generic import GenericRule
from avionics.persample.rules.recurrent import RecurrentRule
from avionics.step.batch import local
from avionics.step.parallel import DataParallel
from avionics.step.values import Batch, Combined

# What a cockpit computes on parameters fully_shard shards: the "economy", "business" and
# "transformer" presets, the noise scales, and the curvature quantities (avionics.quantities
# .curvature, hess_max_ev, preconditioned_sharpness; see Sharded.no_sync).
SHARDED_QUANTITIES = (
    *("Loss", "GradNorm", "Distance", "UpdateSize", "Time", "Alpha", "GradHist1d"),
    *("InnerTest", "NormTest", "OrthoTest", "ActivationHealth", "GradientNoiseScale"),
    *("GradCovTrace", "TrueGradSqNorm", "SimpleNoiseScale", "LossOutliers", "UpdateRatio"),
    *("HessTrace", "TICDiag", "TICTrace", "HessMaxEV", "PreconditionedSharpness"),
)


class ShardLayout:
    """How FSDP2 splits the tracked parameters over the processes of ``world``: parameter k's
    rows [offset_r, offset_r + rows_r) on process r, ``torch.chunk``'s split of its d_k rows
    into ``world.size`` chunks of ceil(d_k / R) rows (the last ones shorter or empty)."""

    def __init__(self, params: list[Tensor], world: World):
        self.world = world
        self.shapes = [tuple(p.shape) for p in params]
        self.rows = [_chunk_rows(shape[0] if shape else 1, world.size) for shape in self.shapes]
        for p, rows in zip(params, self.rows, strict=True):
            own = local(p).shape[0] if local(p).dim() else 1
            if own != rows[world.rank]:
                raise TypeError(
                    f"Cockpit: a parameter of shape {tuple(p.shape)} holds {own} rows on rank "
                    f"{world.rank}, not torch.chunk's {rows[world.rank]}: a shard placement "
                    "fully_shard does not make (shard_placement_fn). Shard dim 0 evenly "
                    "(fully_shard's default)."
                )

    def shard(self, whole: Tensor, k: int) -> Tensor:
        """This process's rows of parameter k's whole tensor ``whole``."""
        rows = self.rows[k]
        start = sum(rows[: self.world.rank])
        return whole[start : start + rows[self.world.rank]]

    def gather(self, shards: list[Tensor], indices: list[int]) -> list[Tensor]:
        """The whole tensors of ``shards`` (shards[i] this process's rows of a tensor shaped
        as parameter ``indices[i]``), by one ``all_gather`` of one packed buffer (padded to
        the longest process's), in the shards' promoted dtype."""
        if not shards:
            return []
        dtype = shards[0].dtype
        for s in shards[1:]:
            dtype = torch.promote_types(dtype, s.dtype)
        row = [math.prod(self.shapes[k][1:]) for k in indices]
        lengths = [
            sum(n * self.rows[k][r] for n, k in zip(row, indices)) for r in range(self.world.size)
        ]
        device = collective_device(dist.get_backend(), shards[0].device)
        mine = torch.zeros(max(lengths), dtype=dtype, device=device)
        if lengths[self.world.rank]:
            mine[: lengths[self.world.rank]] = torch.cat(
                [s.detach().reshape(-1).to(device, dtype) for s in shards]
            )
        # (flat: gloo's all-gather refuses an output of shape [R, L])
        gathered = mine.new_empty(self.world.size * max(lengths))
        _all_gather(gathered, mine)
        gathered = gathered.view(self.world.size, max(lengths))
        pieces = [
            gathered[r, : lengths[r]].split([n * self.rows[k][r] for n, k in zip(row, indices)])
            for r in range(self.world.size)
        ]
        return [
            torch.cat([pieces[r][i] for r in range(self.world.size)])
            .reshape(self.shapes[k])
            .to(shards[i].device, shards[i].dtype)
            for i, k in enumerate(indices)
        ]


def _all_gather(output: Tensor, tensor: Tensor) -> None:
    """Every process's ``tensor``, in rank order, into the flat ``output``
    (``all_gather_single``, which ``all_gather_into_tensor`` became in torch 2.13)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor)


def _chunk_rows(d: int, size: int) -> list[int]:
    """The rows of each of ``size`` chunks of ``d`` rows, as ``torch.chunk`` splits them."""
    chunk = -(-d // size)
    return [max(0, min(chunk, d - r * chunk)) for r in range(size)]


class Sharded(DataParallel):
    """The step over the processes of ``world`` with ``params`` sharded by ``fully_shard``
    (the module docstring): unequal batches allowed, each process's whole local gradient
    recorded on FSDP's unsharded parameters (:meth:`leaves`)."""

    def __init__(self, params: list, world: World, model: nn.Module):
        super().__init__(params, world, None, True)
        self.layout = ShardLayout(params, world)
        self._modules = _fsdp_modules(model)
        self._fsdp = _fsdp_params(self._modules, params)
        # (shard, its version, whole) of the last gather (see whole)
        self._last: list[tuple[Tensor, int, Tensor]] = []
        # the step's mean gradient (shards), until the step's first gather carries it
        self._coming: list[Tensor] = []
        # the FSDP groups' reshard_after_backward while no_sync keeps them unsharded
        self._reshard_after_backward: list[bool] | None = None

    def leaves(self) -> list[Tensor]:
        """The tensors the backward's gradients of the tracked parameters arrive at: FSDP's
        unsharded parameters (each process's whole gradient of its own loss; FSDP
        reduce-scatters them after)."""
        leaves = []
        for p, fsdp_param in zip(self.params, self._fsdp, strict=True):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            leaves.append(p if unsharded is None else unsharded)
        return leaves

    @contextmanager
    def unsharded(self, engine, contributions, values: list[Tensor] | None = None):
        """The whole parameters on their modules while the per-sample engine runs, where a
        rule of ``contributions`` reads them (:func:`reads_parameters`): FSDP's
        ``unshard()`` of every FSDP module (one all-gather per module, as in its forward),
        ``reshard()`` after. With ``values`` (theta_t, whole), those are the parameters'
        values meanwhile. The engine knows the unsharded parameters as the tracked ones they
        stand for. Where no rule reads them: nothing."""
        if not reads_parameters(contributions):
            yield
            return
        # (a curvature step keeps them unsharded past its backward: left so, see no_sync)
        kept = [_unsharded(module) for module in self._modules]
        for module in self._modules:
            module.unshard()
        leaves = self.leaves()
        engine.index.update({id(leaf): k for k, leaf in enumerate(leaves)})
        now = [leaf.data for leaf in leaves] if values is not None else None
        try:
            for leaf, value in zip(leaves, values or [], strict=False):
                leaf.data = value
            yield
        finally:
            for leaf, value in zip(leaves, now or [], strict=False):
                leaf.data = value
            for module, unsharded in zip(self._modules, kept, strict=True):
                if not unsharded:
                    module.reshard()

    def no_sync(self, needed: bool) -> None:
        """Keep the unsharded parameters through the next steps' backwards (a step that
        differentiates the gradient again, whose graph reads them: FSDP's
        ``set_reshard_after_backward(False)`` on every FSDP module, the user's setting kept
        to restore), or stop. Each such step reshards them when its values are computed
        (:meth:`reshard_kept`): FSDP makes no all-gather more, and every process holds the
        whole model from the step's backward to the end of its block."""
        groups = [group for module in self._modules for group in _groups(module)]
        if needed and self._reshard_after_backward is None:
            self._reshard_after_backward = [group.reshard_after_backward for group in groups]
            for group in groups:
                group.reshard_after_backward = False
        elif not needed and self._reshard_after_backward is not None:
            for group, setting in zip(groups, self._reshard_after_backward, strict=True):
                group.reshard_after_backward = setting
            self._reshard_after_backward = None

    def reshard_kept(self) -> None:
        """Reshard the parameters a curvature step kept unsharded past its backward
        (:meth:`no_sync`), once its values are computed or it raised: before the optimizer
        updates the shards, which the next forward all-gathers again."""
        if self._reshard_after_backward is None:
            return
        for module in self._modules:
            if _unsharded(module):
                module.reshard()

    def gradients(self, combined: Combined, reduction: str, batch: Batch) -> list[Tensor]:
        """This process's shard of the global loss's gradient: of FSDP's average in ``p.grad``
        with equal batches; else of the processes' whole gradient sums sum_{n in r} grad l_n
        added (one all-reduce of the parameters' size, as under DDP), divided by N for a
        mean-reduced loss. Divided by the measured backward scale c either way.

        Micro-batches (gradient accumulation): the sums, each process's whole combined
        gradient of its micro-batches (sum_i (w_i / c_i) grad L_i, recorded on the unsharded
        parameters at each backward) times N_r, whatever the sizes: ``p.grad``'s shard is
        not the global mean's where a micro-batch's backward ran with FSDP's gradient sync
        off or the processes' micro-batches differ in size."""
        grads = self._global_gradients(combined, reduction, batch)
        self._coming = grads if reduction == "mean" else []  # the mean gradient itself
        return grads

    def _global_gradients(self, combined: Combined, reduction: str, batch: Batch) -> list:
        """:meth:`gradients`, before the mean gradient is kept for the step's gather."""
        if combined.single and len(set(batch.sizes)) == 1:
            return super().gradients(combined, reduction, batch)
        weight = batch.sizes[self.world.rank] if reduction == "mean" else 1
        sums = [
            g * weight if g is not None else torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            for g, p in zip(combined.gradients, self.params, strict=True)
        ]
        sums = sum_over_processes(sums, self.world)
        total = batch.size or sum(batch.sizes)
        return [
            self.layout.shard(s / total if reduction == "mean" else s, k)
            for k, s in enumerate(sums)
        ]

    def whole(self, shards: list[Tensor], indices: list[int]) -> list[Tensor]:
        """:meth:`ShardLayout.gather` of ``shards``, but for those the last call gathered,
        unchanged since (the same tensor at the same version). The step's mean gradient
        (:meth:`gradients`) travels in the step's first gather, whatever it asks for: Alpha's
        update s_t, gathered at its end step t+1 to project step t's g_n on it, shares that
        all-gather with g_{t+1}, which the step's statistics then find gathered (one
        parameter-sized all-gather per tracked step)."""
        coming, self._coming = self._coming, []
        asked = {id(shard) for shard in shards}
        extra = [k for k, g in enumerate(coming) if id(g) not in asked]
        count = len(shards)
        shards = list(shards) + [coming[k] for k in extra]
        indices = list(indices) + extra
        known = {id(shard): (shard, shard._version, whole) for shard, _, whole in self._last}
        new = [
            i
            for i, shard in enumerate(shards)
            if id(shard) not in known or known[id(shard)][1] != shard._version
        ]
        gathered = dict(
            zip(new, self.layout.gather([shards[i] for i in new], [indices[i] for i in new]))
        )
        wholes = [gathered[i] if i in gathered else known[id(s)][2] for i, s in enumerate(shards)]
        self._last = [(s, s._version, w) for s, w in zip(shards, wholes, strict=True)]
        return wholes[:count]

    def engine(self, engine) -> ShardedEngine:
        """``engine``, whose captured steps project onto directions given as shards."""
        return ShardedEngine(engine, self)


class ShardedEngine:
    """A :class:`~avionics.persample.PerSampleEngine` run with the whole parameters on their
    modules (:meth:`Sharded.unsharded`), whose steps are :class:`ShardedCapturedStep`."""

    def __init__(self, engine, processes: Sharded):
        self._engine, self._processes = engine, processes

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, *args, **kwargs) -> ShardedCapturedStep:
        calls, n = args[:2]
        # (a curvature step's modules hold the unsharded parameters already: no_sync)
        leaves = self._processes.leaves()
        self._engine.index.update({id(leaf): k for k, leaf in enumerate(leaves)})
        contributions = self._engine.contributions(calls, n, captured_backward=True)
        with self._processes.unsharded(self._engine, contributions):
            step = self._engine.step(*args, **kwargs)
        return ShardedCapturedStep(step, self._processes)


class ShardedCapturedStep:
    """A :class:`~avionics.persample.CapturedStep` whose ``statistics`` take the directions
    (and theta_t, where given) as this process's shards: they are gathered whole in one
    collective (:meth:`ShardLayout.gather`) and passed on, with the whole parameters on their
    modules. Every process must call it, in the same order (the quantities do: every process
    runs the same ones)."""

    def __init__(self, captured, processes: Sharded):
        self._captured, self._processes = captured, processes

    def __getattr__(self, name):
        return getattr(self._captured, name)

    def statistics(
        self,
        request,
        directions: dict,
        params: list[Tensor] | None = None,
        sample_mean: str | None = None,
    ):
        engine, contributions = self._captured.engine, self._captured.contributions
        # theta_t (after optimizer.step()) matters only to the rules that read parameters
        params = params if reads_parameters(contributions) else None
        names = sorted(directions)
        count = len(self._processes.params)
        shards = [t for name in names for t in directions[name]] + list(params or [])
        indices = list(range(count)) * (len(shards) // count)
        whole = self._processes.whole(shards, indices)
        wholes = {name: whole[i * count : (i + 1) * count] for i, name in enumerate(names)}
        kept = whole[len(names) * count :] if params is not None else None
        with self._processes.unsharded(engine, contributions, kept):
            return self._captured.statistics(request, wholes, kept, sample_mean)


def reads_parameters(contributions: list[list[tuple[nn.Module, str]]]) -> bool:
    """Whether a rule of the per-sample engine for ``contributions`` (the (module, name)
    pairs of each parameter) reads the parameters' values: the closed forms of
    nn.MultiheadAttention and the recurrent layers, and the generic rule, which re-runs the
    module's forward. The others (Linear, convolutions, normalizations, embeddings, ...)
    need only the captured layer inputs and output gradients."""
    names: dict[nn.Module, list[str]] = {}
    for pairs in contributions:
        for module, name in pairs:
            names.setdefault(module, []).append(name)
    reading = (AttentionRule, GenericRule, RecurrentRule)
    return any(rule_for(module, owned) in reading for module, owned in names.items())


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` made FSDP modules."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _groups(module: nn.Module) -> list:
    """The FSDP parameter groups of an FSDP module."""
    return list(module._get_fsdp_state()._fsdp_param_groups)


def _unsharded(module: nn.Module) -> bool:
    """Whether the FSDP module holds its unsharded parameters now."""
    return any(group.is_unsharded for group in _groups(module))


def _fsdp_params(modules: list[nn.Module], params: list) -> list:
    """The FSDPParam of each tracked parameter (None for one fully_shard does not manage)."""
    owned = {}
    for module in modules:
        for group in _groups(module):
            for fsdp_param in group.fsdp_params:
                owned[id(fsdp_param.sharded_param)] = fsdp_param
    return [owned.get(id(p)) for p in params]


def sharded(model: nn.Module, quantities: list) -> bool:
    """Whether ``model``'s parameters are sharded by FSDP (``fully_shard``); refuse the
    quantities that need whole parameters or the mean gradient per coordinate, and
    FullyShardedDataParallel (FSDP1)."""
    from torch.distributed.tensor import DTensor

    _refuse_fsdp1(model)
    distributed = [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if not distributed:
        return False
    _check_fsdp_placements(model, distributed)
    unsupported = [q.name for q in quantities if q.name not in SHARDED_QUANTITIES]
    if unsupported:
        raise TypeError(
            f"Cockpit: the model's parameters are sharded by FSDP (fully_shard), and "
            f"{', '.join(unsupported)} need every parameter or its second moments whole. "
            f"Under FSDP the cockpit computes {', '.join(SHARDED_QUANTITIES)}; for the "
            "others, train under DistributedDataParallel."
        )
    return True


def _refuse_fsdp1(model: nn.Module) -> None:
    """FullyShardedDataParallel (FSDP1) is refused, ``use_orig_params=True`` too."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return
    wrapped = next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)
    if wrapped is None:
        return
    if wrapped._use_orig_params:
        why = (
            "with use_orig_params=True its parameters keep their names, but each process's "
            "part of one is a piece of a flattened shard cut across parameters (a parameter "
            "may have no element on a process, and its gradient is None there), not rows "
            "of it: a direction, a gradient or a parameter would have to be gathered by "
            "FSDP1's private flat-parameter offsets"
        )
    else:
        why = "its flattened parameters have no names of the model's"
    raise TypeError(
        f"Cockpit: the model is wrapped in FullyShardedDataParallel (FSDP1), which the cockpit "
        f"does not support: {why}. Shard it with torch.distributed.fsdp.fully_shard "
        "(FSDP2) instead, or use DistributedDataParallel."
    )


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
