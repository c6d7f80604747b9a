"""Curvature-diagonal instruments: HessTrace, TICDiag, TICTrace (docs/definitions.md, section 9).

HessMaxEV has its own module, :mod:`avionics.quantities.hess_max_ev`. All three set
``create_graph = True``: pass ``loss.backward(create_graph=cockpit.create_graph(step))``. The
exact Hessian diagonal of a network that is not piecewise linear differentiates the gradient
again; the GGN diagonals (and diag_h of piecewise-linear networks, which equals the GGN's) only
backpropagate loss-Hessian-root columns through the forward graph of
``info['individual_losses']``, but a backward without ``create_graph`` frees that graph, and
the protocol has no other way to keep it (``create_graph=True`` implies ``retain_graph``); what
that costs is in BENCHMARKS.md.

With h the curvature diagonal of the mean loss over the batch, also when the user's loss is
their sum (selectable, see :mod:`avionics.curvature.step`: ``"auto"``, the default, chosen
at the first step by its cost (:func:`choose_variant`); ``"diag_h"`` exact Hessian diagonal,
``"diag_ggn_exact"``, ``"diag_ggn_mc"`` seedable) and m2_d = mean_n g_{n,d}^2, g_n
the gradient of the per-sample loss l_n:

    HessTrace = per parameter sum_d h_d
    TICDiag   = sum_d m2_d / (h_d + eps),                eps = 1e-7
    TICTrace  = (sum_d m2_d) / (sum_d h_d + eps)

(For a sum-reduced loss, the Hessian of the user's loss is N times that of the mean: HessMaxEV,
which follows the user's reduction, is then on N times HessTrace's scale.)

HessTrace and TICTrace read only the sums of h per parameter. When no TICDiag with the same
settings runs at the step, only those sums are computed: for the GGN diagonals they come from
per-sample squared norms, which Linear layers have in closed form (much cheaper than the
diagonal itself, see :func:`~avionics.curvature.step.ggn_diagonal.ggn_diagonal`).

None of them touches the global random number generator.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor, nn

from avionics.curvature.step import VARIANTS
from avionics.curvature.step.ggn_diagonal import ggn_diagonal
from avionics.curvature.step.hessian_diagonal import (
    MAX_PROBES,
    hessian_diagonal_by_probes,
    not_piecewise_linear,
)
from avionics.curvature.step.loss_root import MAX_OUTPUT_SIZE, recognised_loss
from avionics.persample import Request
from avionics.quantities.arguments import checked_int, checked_seed
from avionics.quantities.base import (
    MicroBatch,
    Quantity,
    StepData,
    flat_sum_sq,
    per_parameter_rows,
    per_parameter_sums,
    user_stacklevel,
)
from avionics.quantities.outputs import PER_LAYER, per_parameter
from avionics.schedules import Schedule

PER_SAMPLE_KEYS = ("individual_losses",)


def _graph_grads(data: StepData) -> list[Tensor]:
    """``p.grad`` with its graph per parameter, zeros where none arrived (the cockpit has
    checked on leaving the block that the backward kept a graph)."""
    return [
        g if g is not None and g.grad_fn is not None else torch.zeros_like(p)
        for g, p in zip(data.graph_grads, data.leaves, strict=True)
    ]


AUTO = "auto"
# The budget of "auto", per step: the exact Hessian diagonal while its Hessian-vector products
# (one per parameter element, batched) stay this few,
AUTO_MAX_PROBES = 2048
# except through a recurrent module (nn.RNNBase), where each product counts as one backward
# pass (its double backward re-runs the recurrent kernel per product: measured at 0.3 passes
# a product for the real-model tests' packed GRU, 6.5 for their LSTM LM, BENCHMARKS.md) and
# the D products must fit AUTO_MAX_COLUMNS;
# else the exact GGN diagonal while a sample's output has this few entries (one backward pass
# of the network each); else the Monte-Carlo GGN diagonal (mc_samples backward passes). Where
# none of them fits (the GGN diagonals cannot run and the Hessian diagonal needs more products)
# "auto" refuses the step on entering it.
AUTO_MAX_COLUMNS = 64


def output_entries(roots: list, n: int) -> int | None:
    """M, the entries of one sample's output, from the captured calls of the model itself in
    the step's forward (``roots``); None when the GGN diagonals cannot run (not one forward
    with one output, N entries on one of its axes)."""
    if len(roots) != 1 or len(roots[0].nodes) != 1:
        return None
    root = roots[0]
    shape = root.outputs[root.node_outputs[0]].shape
    # (on any axis: the root call's batch_axis is its input's; the GGN diagonal finds the
    # output's, avionics.curvature.step.ggn_diagonal._output_batch_axis)
    if n not in shape:
        return None
    return shape.numel() // n


def step_output_entries(data: StepData) -> int | None:
    """:func:`output_entries` of the step's captured forward."""
    roots = data.captured.calls.get(data.model, []) if data.captured is not None else []
    return output_entries(roots, len(data.individual_losses))


def ggn_obstacle(roots: list, n: int | None, losses: Tensor | None) -> str | None:
    """Why the GGN diagonals cannot run on this step's forward, or None when they can: they
    need one output tensor of the model with the batch on one axis, and a loss Hessian w.r.t. it
    that is recognised (:func:`~avionics.curvature.step.loss_root.recognised_loss`, checked
    here only where the dense one is out of reach: more than MAX_OUTPUT_SIZE entries)."""
    m = output_entries(roots, n)
    if m is None:
        return "the model's forward gives not one output tensor with the batch on one axis"
    if m > MAX_OUTPUT_SIZE and (losses is None or recognised_loss(losses, roots[0]) is None):
        return (
            "the loss is not recognised as softmax cross-entropy or squared error (per "
            f"sample or per token), and its dense Hessian w.r.t. a sample's {m} output "
            f"entries is beyond the limit of {MAX_OUTPUT_SIZE}"
        )
    return None


def ggn_variants_that_work(m: int | None, obstacle: str | None = None) -> list[str]:
    """The GGN diagonal variants a model whose samples have M output entries allows."""
    if m is None or obstacle is not None:
        return []
    return ["diag_ggn_exact", "diag_ggn_mc"] if m <= MAX_OUTPUT_SIZE else ["diag_ggn_mc"]


def recurrent_modules(model: nn.Module) -> list[str]:
    """Names of the recurrent modules (nn.RNN, nn.LSTM, nn.GRU) of ``model``."""
    return [
        f"'{name or 'the model'}' ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, nn.RNNBase)
    ]


def choose_variant(
    model: nn.Module, params: list[Tensor], m: int | None, obstacle: str | None = None
) -> tuple[str, str]:
    """(variant, why) for curvature="auto", by the cost of a step, within the budget of
    :data:`AUTO_MAX_PROBES` Hessian-vector products or :data:`AUTO_MAX_COLUMNS` backward
    passes: the exact Hessian diagonal costs one Hessian-vector product per parameter element
    unless the network is piecewise linear (then it is the exact GGN diagonal's M backward
    passes, M the entries of a sample's output), and through a recurrent module each product
    counts as a backward pass; the Monte-Carlo GGN diagonal costs mc_samples passes whatever
    M. ``obstacle``: why the GGN diagonals cannot run
    (:func:`ggn_obstacle`), None when they can. A ValueError where nothing fits the budget,
    naming what works and its cost."""
    dim = sum(p.numel() for p in params)
    bad = not_piecewise_linear(model)
    if obstacle is not None:
        m = None
    columns = min(AUTO_MAX_COLUMNS, MAX_OUTPUT_SIZE)  # (the exact GGN diagonal's reach)
    if not bad:
        if m is not None and m <= columns:
            return "diag_h", (
                f"the network is piecewise linear in each weight, so the exact Hessian "
                f"diagonal is the GGN's, {m} backward passes per step"
            )
        if m is None and dim <= AUTO_MAX_PROBES:
            return "diag_h", (
                f"the GGN diagonals cannot run ({obstacle}); the exact Hessian diagonal takes "
                f"{dim} Hessian-vector products"
            )
    recurrent = recurrent_modules(model)
    # (where no GGN diagonal runs, the products are the only way: the budget in products)
    in_passes = bool(recurrent) and m is not None
    if bad and dim <= AUTO_MAX_PROBES and not (in_passes and dim > AUTO_MAX_COLUMNS):
        return "diag_h", f"the exact Hessian diagonal takes {dim} Hessian-vector products"
    if bad and in_passes and dim <= AUTO_MAX_PROBES:
        exact_hessian = (
            f"the exact Hessian diagonal would take {dim} Hessian-vector products per step, "
            f"each about a backward pass or more through the double backward of "
            f"{', '.join(recurrent[:3])}: beyond the budget of {AUTO_MAX_COLUMNS} backward passes"
        )
    elif bad:
        exact_hessian = (
            f"the exact Hessian diagonal would take {dim} Hessian-vector products per step "
            f"(not piecewise linear: {', '.join(bad[:3])})"
        )
    else:
        exact_hessian = "the exact Hessian diagonal is the GGN's here"
    if m is None:
        raise ValueError(
            f"curvature='auto' finds no curvature diagonal within its budget "
            f"({AUTO_MAX_PROBES} Hessian-vector products or {AUTO_MAX_COLUMNS} backward passes "
            f"per step): the GGN diagonals cannot run ({obstacle}), and the exact Hessian "
            f"diagonal of this network takes {dim} Hessian-vector products per step. What "
            f"works for this model: curvature='diag_h'"
            + (f" with max_probes={dim}" if dim > MAX_PROBES else "")
            + f" (its {dim} products per step)."
        )
    if m <= columns:
        return "diag_ggn_exact", f"{exact_hessian}; the exact GGN diagonal takes {m}"
    return "diag_ggn_mc", (
        f"{exact_hessian}; the exact GGN diagonal would take {m} backward passes (one per "
        "entry of a sample's output), the Monte-Carlo one takes mc_samples"
    )


class _Curvature(Quantity):
    """Shared: the curvature diagonal h of the mean loss over the batch (also for a
    sum-reduced loss), computed once per step (global: see :meth:`_global`).

    Args:
        schedule: the steps to track (default every step).
        curvature: ``"auto"`` (default: chosen at the first step by its cost, see
            :func:`choose_variant`, and said once), ``"diag_h"`` (exact Hessian diagonal),
            ``"diag_ggn_exact"`` or ``"diag_ggn_mc"`` (see :mod:`avionics.curvature.step`).
        mc_samples: draws per step of the MC GGN diagonal, >= 1.
        seed: the MC draws' seed (with the step number; the global RNG is untouched), in
            [0, 2**32).
        max_probes: the most Hessian-vector products the exact Hessian diagonal may take,
            >= 1.
        per_layer: TICDiag and TICTrace: also keep the value of each tracked parameter k
            alone, over its coordinates d in k (HessTrace is per parameter already).
    """

    info_keys = PER_SAMPLE_KEYS
    create_graph = True
    adds_over_processes = True  # the diagonal of the global batch, in _global
    eps = 1e-7

    def __init__(
        self,
        schedule: Schedule | None = None,
        curvature: str = AUTO,
        mc_samples: int = 1,
        seed: int = 0,
        max_probes: int = MAX_PROBES,
        per_layer: bool = False,
    ):
        super().__init__(schedule, per_layer)
        if curvature not in (AUTO, *VARIANTS):
            raise ValueError(
                f"{self.name}(curvature={curvature!r}): choose one of "
                f"{', '.join(map(repr, (AUTO, *VARIANTS)))}."
            )
        self.curvature = curvature
        self._chosen: str | None = None  # what "auto" chose, at the first step
        self._losses = None  # info["individual_losses"] from validate to validate_forward
        self._probed: bool | None = None  # this step's diag_h by probes (not the GGN's)
        self.mc_samples = checked_int(
            self.name, "mc_samples", mc_samples, 1, "draws per step of the MC GGN diagonal"
        )
        self.seed = checked_seed(self.name, seed)
        self.max_probes = checked_int(
            self.name,
            "max_probes",
            max_probes,
            1,
            "the most Hessian-vector products of the exact Hessian diagonal",
        )

    # HessTrace needs the captured calls only; TICDiag and TICTrace also sum_n g_{n,d}^2
    needs_sum_sq = True

    def request(self, step: int) -> Request:
        return Request(sum_sq=self.needs_sum_sq, calls=True)

    def describe(self) -> str:
        return f"{super().describe()[:-1]}, curvature={self.curvature!r})"

    # Whether the quantity reads the diagonal itself, not only its sums per parameter
    needs_diagonal = False

    def validate(self, step: int, info: dict) -> None:
        # the per-sample losses, for recognising the loss in validate_forward (a weak
        # reference: nothing of the step is kept if the cockpit stops before it)
        losses = info.get("individual_losses")
        self._losses = weakref.ref(losses) if isinstance(losses, Tensor) else None

    def validate_forward(self, step: int, model: nn.Module, params: list, roots: list, n: int):
        """On entering the step, before its backward: choose the "auto" variant (said once),
        and refuse a variant whose cost is beyond its budget or that cannot run on this
        model (a GGN diagonal: no single output tensor, or an unrecognised loss whose dense
        Hessian is too large), with the cost and only the variants that work for it."""
        losses = self._losses() if self._losses is not None else None
        self._losses = None
        m = output_entries(roots, n)
        bad = not_piecewise_linear(model)
        # (recognising the loss runs two products through it: only where a GGN may run)
        asked = self._chosen or self.curvature
        obstacle = ggn_obstacle(roots, n, losses) if asked != "diag_h" or not bad else None
        dim = sum(p.numel() for p in params)
        if self.curvature == AUTO and self._chosen is None:
            try:
                self._chosen, why = choose_variant(model, params, m, obstacle)
            except ValueError as error:
                raise ValueError(f"Step {step}: {self.name}: {error}") from None
            warnings.warn(
                f"{self.name}(curvature='auto') computes {self._chosen!r} for this model: {why}. "
                "Pass curvature= to choose (said once).",
                stacklevel=user_stacklevel(),
            )
        variant = self._chosen or self.curvature
        # the exact Hessian diagonal of a piecewise-linear network is the GGN's where that runs
        self._probed = variant == "diag_h" and (bool(bad) or obstacle is not None)
        if self._probed and dim > self.max_probes:
            obstacle = obstacle or ggn_obstacle(roots, n, losses)
            working = [f"curvature={v!r}" for v in ggn_variants_that_work(m, obstacle)]
            why = (
                f"because these modules are not piecewise linear in each weight: "
                f"{', '.join(bad[:8])}"
                if bad
                else f"because the GGN diagonal cannot run: {obstacle}"
            )
            raise ValueError(
                f"Step {step}: {self.name}(curvature='diag_h'): the exact Hessian diagonal of "
                f"this network needs {dim} Hessian-vector products per step (more than "
                f"max_probes={self.max_probes}), {why}. What works for this model: "
                f"{', or '.join([*working, f'max_probes={dim} to accept the cost'])}."
            )
        if variant in ("diag_ggn_exact", "diag_ggn_mc") and obstacle is not None:
            raise ValueError(
                f"Step {step}: {self.name}(curvature={variant!r}): the GGN diagonal cannot run "
                f"on this step: {obstacle}. What works for this model: curvature='diag_h' "
                f"({dim} Hessian-vector products per step"
                + (f", with max_probes={dim}" if dim > self.max_probes else "")
                + ")."
            )
        if variant == "diag_ggn_exact" or (variant == "diag_h" and not self._probed):
            if m is not None and m > MAX_OUTPUT_SIZE:
                raise ValueError(
                    f"Step {step}: {self.name}(curvature={variant!r}): the exact GGN diagonal "
                    f"takes one backward pass per entry of a sample's output, {m} here (more "
                    f"than {MAX_OUTPUT_SIZE}). What works for this model: "
                    "curvature='diag_ggn_mc' (mc_samples passes per step)."
                )

    def variant(self, data: StepData) -> str:
        """The variant computed: the one asked for, or what "auto" chose on entering the
        first step (:meth:`validate_forward`; chosen here when a step came without it)."""
        if self.curvature != AUTO:
            return self.curvature
        if self._chosen is None:
            self._chosen, _ = choose_variant(data.model, data.tracked, step_output_entries(data))
        return self._chosen

    def _key(self, data: StepData) -> tuple:
        return ("curvature_diagonal", self.variant(data), self.mc_samples, self.seed)

    def _cached(self, data: StepData, diagonal: bool) -> dict:
        """This step's {"sums": per-parameter sums of h} and, where a curvature quantity with
        the same settings reads it (among ``data.active``, or ``diagonal``), {"h": the
        diagonal}: computed once per step and shared."""
        key = self._key(data)
        entry = data.cache.curvature_diagonals.get(key)
        if entry is None or (diagonal and "h" not in entry):
            diagonal = diagonal or any(
                isinstance(q, _Curvature) and q.needs_diagonal and q._key(data) == key
                for q in data.active
            )
            if diagonal:
                h = self._global(data, self._diagonal(data))
                entry = {"h": h, "sums": torch.stack([d.sum() for d in h])}
            else:  # the GGN's sums alone are cheaper (squared norms instead of squares)
                (sums,) = self._global(data, [torch.stack(self._diagonal(data, traces=True))])
                entry = {"sums": sums}
            data.cache.curvature_diagonals[key] = entry
        return entry

    def _global(self, data: StepData, local: list[Tensor]) -> list[Tensor]:
        """The global batch's diagonal (or sums) from this process's, of the mean over its
        N_r samples: sum_r (N_r / N) h_r, in one collective."""
        if data.parallel.world.size == 1:
            return local
        weight = data.parallel.batch_sizes[data.parallel.world.rank] / data.batch_size
        return data.parallel.sum([t * weight for t in local])

    def diagonal(self, data: StepData) -> list[Tensor]:
        """The curvature diagonal h of the mean loss over the batch, one tensor per
        parameter."""
        return self._cached(data, diagonal=True)["h"]

    def diagonal_sums(self, data: StepData) -> Tensor:
        """[sum_d h_d per parameter]."""
        return self._cached(data, diagonal=False)["sums"]

    def _diagonal(self, data: StepData, traces: bool = False) -> list[Tensor]:
        """h, one tensor per parameter; with ``traces``, only sum_d h_d (0-dim tensors)."""
        model = data.model
        losses = data.info["individual_losses"]
        variant = self.variant(data)
        if variant == "diag_h":
            # (its cost was checked on entering the step, where the GGN's shortcut was decided)
            probed = self._probed
            if probed is None:
                probed = bool(not_piecewise_linear(model)) or step_output_entries(data) is None
            if probed:
                h = self._probed_diagonal(data)
                return [d.sum() for d in h] if traces else h
            variant = "diag_ggn_exact"  # equal for piecewise-linear networks
        # (the cockpit has checked on entering the step that the per-sample losses have a graph)
        generator = None
        if variant == "diag_ggn_mc":
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + data.step)
        # one batch, or the micro-batches of an accumulated step: the diagonal of the mean
        # over all their samples is sum_i (N_i / N) diag G_i (1 each for a sum)
        parts = data.micro_batches or [MicroBatch(data.captured.calls, losses, 1.0)]
        # one batch over several processes: the Monte-Carlo draws of the global batch's rows
        sizes, rank = data.parallel.batch_sizes, data.parallel.world.rank
        rows = None if data.micro_batches or len(sizes) < 2 else (sum(sizes[:rank]), sum(sizes))
        total = None
        for part in parts:
            h = ggn_diagonal(
                model,
                data.captured.engine,
                part.calls,
                part.individual_losses,
                [p.detach() for p in data.leaves],  # (whole, also under FSDP)
                mc_samples=self.mc_samples if variant == "diag_ggn_mc" else None,
                generator=generator,
                traces=traces,
                rows=rows,
            )
            terms = [part.share * d for d in h] if data.micro_batches else h
            total = terms if total is None else [a + b for a, b in zip(total, terms, strict=True)]
        return total

    def _probed_diagonal(self, data: StepData) -> list[Tensor]:
        """The exact Hessian diagonal of the mean loss by probes, over the parameters whose
        gradient carries a graph; 0 for the others (a gradient without a graph is constant
        in the parameters, e.g. where the loss does not depend on them)."""
        # of this process's mean loss: its graph is of the loss as reduced over its samples
        scale = 1.0 / len(data.individual_losses) if data.reduction == "sum" else 1.0
        grads = _graph_grads(data)
        kept = [k for k, g in enumerate(grads) if g.grad_fn is not None]
        leaves = data.leaves
        probed = hessian_diagonal_by_probes(
            [grads[k] for k in kept], [leaves[k] for k in kept], scale
        )
        h = [torch.zeros_like(p) for p in leaves]
        for k, d in zip(kept, probed, strict=True):
            h[k] = d
        return h


class HessTrace(_Curvature):
    """Per parameter, the sum of the curvature diagonal h of the mean loss over the batch (the
    Hessian trace for ``curvature="diag_h"``), also for a sum-reduced loss; globally their
    sum."""

    needs_sum_sq = False
    output = per_parameter("sum")

    def compute(self, data: StepData):
        return {data.step: self.diagonal_sums(data)}


class TICDiag(_Curvature):
    """Takeuchi information criterion with the diagonal approximation:
    sum_d (mean_n g_{n,d}^2) / (h_d + eps), g_n the gradients of the per-sample losses and h
    the curvature diagonal of their mean (also for a sum-reduced loss). With ``per_layer``,
    the list of its terms per parameter k, sum_{d in k} (mean_n g_{n,d}^2) / (h_d + eps), whose
    sum is the global value."""

    needs_diagonal = True
    per_layer_output = per_parameter("sum")

    def sums(self, data: StepData):
        return {"sum_sq": flat_sum_sq(data)}

    def compute(self, data: StepData):
        h = torch.cat([d.reshape(-1) for d in self.diagonal(data)])
        s = data.totals[self.name]["sum_sq"]
        inverse = h.add_(self.eps).reciprocal_()
        value = torch.dot(inverse, s).double() / data.batch_size
        if self.per_layer:
            terms = per_parameter_sums(inverse.mul_(s), data).double() / data.batch_size
            value = self.layered(value, terms)
        return {data.step: value}


class TICTrace(_Curvature):
    """Takeuchi information criterion with the trace approximation:
    (sum_d mean_n g_{n,d}^2) / (sum_d h_d + eps), g_n the gradients of the per-sample losses
    and h the curvature diagonal of their mean (also for a sum-reduced loss). With
    ``per_layer``, also the same ratio of each parameter k's sums over its coordinates,
    (sum_{d in k} mean_n g_{n,d}^2) / (sum_{d in k} h_d + eps)."""

    per_layer_output = PER_LAYER

    def sums(self, data: StepData):
        terms = per_parameter_rows([q.sum() for q in data.statistics.sum_sq])
        if self.per_layer:
            return {"sum_sq": terms.sum(), "per_parameter": terms}
        return {"sum_sq": terms.sum()}

    def compute(self, data: StepData):
        totals, sums = data.totals[self.name], self.diagonal_sums(data).double()
        value = totals["sum_sq"] / data.batch_size / (sums.sum() + self.eps)
        if self.per_layer:
            per_parameter = totals["per_parameter"] / data.batch_size / (sums + self.eps)
            value = self.layered(value, per_parameter)
        return {data.step: value}
