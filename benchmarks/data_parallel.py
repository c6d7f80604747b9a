"""The cockpit under data parallelism: its cost beside a plain DDP or FSDP2 step, what it sends.

Two gloo processes on this machine (one torch thread each) train two copies of a model side by
side, each wrapped in DistributedDataParallel: one plainly, one inside ``with cockpit(step,
info)`` with ``configuration("economy")`` tracking every step; steps alternate as in
:mod:`benchmarks.cockpit_overhead`, and the ratio is median(tracked) / median(plain) on rank 0.
The single-process ratio is measured in the same run (the same model on the whole batch, one
process), since the target is that ratio + 0.1.

The economy preset with the per-rank view (``Ranks``) is timed the same way, for its cost.

Communication: every collective the cockpit makes goes through ``torch.distributed`` (DDP's own
gradient all-reduce runs in its C++ reducer and is not counted). The benchmark records the
elements and bytes of each of them during a tracked step, for each preset, for economy with
unequal shards and with the per-rank view, and for each quantity alone, beside the gradient
all-reduce's size (the parameters' count); the same table is then computed for GPT-2 small
(124,439,808 parameters, 12 layers) from the measured counts: a collective is small (a
constant) or parameter-sized (curvature products, second moments, gradient sums). Last, the
two ways of the per-rank view's exchange are timed on the group: slots in the one all_reduce,
or an all_gather beside it.

Run: ``python -m benchmarks.data_parallel`` (about five minutes), ``--no-write`` to print only.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from avionics import Cockpit, configuration, quantities
from avionics.configurations import PRESETS
from benchmarks.problems import PROBLEMS
from benchmarks.report import machine, table, write_section

GPT2_SMALL_PARAMETERS = 124_439_808
WORLD = 2
# The presets, economy with the per-rank view, and each quantity alone.
ROWS = [
    *PRESETS, "economy + Ranks",
    "Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest", "OrthoTest",
    "Alpha", "GradHist1d", "GradientNoiseScale", "MeanGSNR", "HessMaxEV", "HessTrace",
    "TICTrace", "Ranks",
]  # fmt: skip


# The torch.distributed collectives counted (DDP's reducer calls none of them).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter_tensor", "all_to_all_single",
)  # fmt: skip


class Counted:
    """Records the elements and bytes of every torch.distributed collective while on."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []
        self.on = False
        self._original = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, function in self._original.items():
            setattr(dist, name, self._counting(function))

    def _counting(self, function):
        def counted(tensor, *args, **kwargs):
            if self.on:
                tensors = tensor if isinstance(tensor, list) else [tensor]
                tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
                elements = sum(t.numel() for t in tensors)
                self.calls.append((elements, sum(t.numel() * t.element_size() for t in tensors)))
            return function(tensor, *args, **kwargs)

        return counted

    def take(self) -> list[tuple[int, int]]:
        """(elements, bytes) of each collective since the last take."""
        calls, self.calls = self.calls, []
        return calls

    def close(self) -> None:
        for name, function in self._original.items():
            setattr(dist, name, function)


def _step(model, forward, cockpit, opt, X, y, loss_fn, k):
    opt.zero_grad()
    losses = loss_fn(forward(X), y)
    loss = losses.mean()
    if cockpit is None:
        loss.backward()
    else:
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X), "optimizer": opt}
        with cockpit(k, info=info):
            loss.backward(create_graph=cockpit.create_graph(k))
    opt.step()


def _timed(problem, make_cockpit, steps, warmup, shard=None, wrap=False):
    """(median tracked step, median plain step) of two copies alternating."""
    model, X, y, loss_fn = PROBLEMS[problem]()
    if shard is not None:
        X, y = X[shard], y[shard]
    plain = copy.deepcopy(model)
    forwards = [_wrapped(m, wrap) for m in (model, plain)]
    cockpit = make_cockpit(forwards[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, plain)]
    tracked, plain_t = [], []
    for k in range(warmup + steps):
        if cockpit._held.capture is not None:
            cockpit._held.capture.disarm()
        t0 = time.perf_counter()
        _step(plain, forwards[1], None, opts[1], X, y, loss_fn, k)
        t1 = time.perf_counter()
        if cockpit._held.capture is not None:
            cockpit._held.capture.arm()
        _step(model, forwards[0], cockpit, opts[0], X, y, loss_fn, k)
        t2 = time.perf_counter()
        if k >= warmup:
            plain_t.append(t1 - t0)
            tracked.append(t2 - t1)
    cockpit.close()
    return statistics.median(tracked), statistics.median(plain_t)


def _wrapped(model, wrap):
    """``model`` in DDP (``wrap`` True), sharded by FSDP2 (``"fsdp"``: fully_shard of each
    child with parameters, then of the model), or as it is."""
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        return fully_shard(model)
    return nn.parallel.DistributedDataParallel(model) if wrap else model


def _communication(problem, chosen, shard):
    """(elements, bytes) of each collective of one tracked step (the third: the first arms)."""
    counted = Counted()
    model, X, y, loss_fn = PROBLEMS[problem]()
    X, y = X[shard], y[shard]
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, chosen())
    # Adam: the transformer preset's PreconditionedSharpness reads its preconditioner
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for k in range(3):
        counted.on = k == 2
        _step(model, forward, cockpit, opt, X, y, loss_fn, k)
    cockpit.close()
    counted.close()
    return counted.take()


def _small_collectives(sizes, repeats: int = 200) -> dict:
    """Seconds per collective of the per-rank view's two ways on this group: the slots (each
    process's k numbers in its own row of a [W, k] zero buffer) inside the step's all_reduce
    of S sums, or an all_gather of the k numbers beside it (two collectives)."""
    world = dist.get_world_size()
    out = {}
    for k, s in sizes:
        slots = torch.zeros(world * k + s, dtype=torch.float64)
        mine = torch.zeros(k, dtype=torch.float64)
        gathered = [torch.zeros(k, dtype=torch.float64) for _ in range(world)]
        sums = torch.zeros(s, dtype=torch.float64)
        times = {"slots in the all_reduce": [], "all_reduce + all_gather": []}
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(slots)
            t1 = time.perf_counter()
            dist.all_reduce(sums)
            dist.all_gather(gathered, mine)
            t2 = time.perf_counter()
            times["slots in the all_reduce"].append(t1 - t0)
            times["all_reduce + all_gather"].append(t2 - t1)
        out[(k, s)] = {way: statistics.median(t) for way, t in times.items()}
    return out


# Each preset, the economy preset with the per-rank view, and each quantity alone.
def _chosen(name):
    if name in PRESETS:
        return lambda: configuration(name)
    if name == "economy + Ranks":
        return lambda: [*configuration("economy"), quantities.Ranks()]
    return lambda: [getattr(quantities, name)()]


def _joined(rank, port, problem) -> tuple[slice, slice]:
    """Join the gloo group of ``WORLD`` processes; this rank's equal shard of the problem's
    batch and its unequal one (rank 0 one sample fewer)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    per = len(PROBLEMS[problem]()[1]) // WORLD
    unequal = slice(0, per - 1) if rank == 0 else slice(per, 2 * per)
    return slice(rank * per, (rank + 1) * per), unequal


def _rank(rank, port, problem, steps, warmup, out):
    shard, unequal = _joined(rank, port, problem)
    economy = lambda forward: Cockpit(forward, configuration("economy"))  # noqa: E731
    viewed = lambda forward: Cockpit(forward, _chosen("economy + Ranks")())  # noqa: E731
    ddp = _timed(problem, economy, steps, warmup, shard, wrap=True)
    ddp_viewed = _timed(problem, viewed, steps, warmup, shard, wrap=True)
    fsdp = _timed(problem, economy, steps, warmup, shard, wrap="fsdp")
    rows = {name: _communication(problem, _chosen(name), shard) for name in ROWS}
    rows["economy, unequal shards"] = _communication(problem, _chosen("economy"), unequal)
    small = _small_collectives([(4, 112), (4, 2048)])
    dist.destroy_process_group()
    if rank == 0:
        result = {
            "ddp": ddp,
            "viewed": ddp_viewed,
            "fsdp": fsdp,
            "communication": rows,
            "small": small,
        }
        torch.save(result, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(problem: str, steps: int, warmup: int, out: str) -> dict:
    torch.set_num_threads(1)
    single = _timed(problem, lambda m: Cockpit(m, configuration("economy")), steps, warmup)
    mp.start_processes(
        _rank, args=(_free_port(), problem, steps, warmup, out), nprocs=WORLD,
        start_method="spawn",
    )  # fmt: skip
    result = torch.load(out, weights_only=False)
    result["single"] = single
    model = PROBLEMS[problem]()[0]
    result["parameters"] = sum(p.numel() for p in model.parameters())
    return result


def _traffic_row(name, calls, dim):
    """[name, collectives, small bytes, parameter-sized collectives, total bytes, GPT-2 small]:
    a collective of at least the parameters' count is one parameter-sized exchange (the
    gradient sums, a Hessian-vector product, second moments), scaled to GPT-2 small by
    its elements per parameter."""
    small = sum(b for e, b in calls if e < dim)
    large = [(e, b) for e, b in calls if e >= dim]
    per_parameter = sum(b / e for e, b in large)  # bytes per parameter, over the large ones
    gpt2 = small + per_parameter * GPT2_SMALL_PARAMETERS
    return [
        name, str(len(calls)), f"{small:,} B", str(len(large)),
        f"{sum(b for _, b in calls):,} B",
        f"{gpt2 / 1e6:.1f} MB" if gpt2 >= 1e6 else f"{gpt2:,.0f} B",
    ]  # fmt: skip


def report(problem: str, result: dict) -> str:
    (tracked, plain), (s_tracked, s_plain) = result["ddp"], result["single"]
    v_tracked, v_plain = result["viewed"]
    dim = result["parameters"]
    communication = result["communication"]
    lines = [
        f"## Data parallelism: the cockpit beside a plain DDP step ({time.strftime('%Y-%m-%d')}, "
        "issues 26 and 29, helper one)",
        "",
        "Measured by `python -m benchmarks.data_parallel` (its docstring says how).",
        "",
        f"{problem}, {WORLD} gloo processes on this machine, batch split evenly, one torch "
        f"thread each ({machine()}):",
        "",
        table(
            ["run", "plain step", "tracked step", "ratio"],
            [
                [
                    f"DDP, {WORLD} processes, economy",
                    f"{plain * 1e3:.1f} ms",
                    f"{tracked * 1e3:.1f} ms",
                    f"{tracked / plain:.2f}x",
                ],
                [
                    f"DDP, {WORLD} processes, economy + Ranks",
                    f"{v_plain * 1e3:.1f} ms",
                    f"{v_tracked * 1e3:.1f} ms",
                    f"{v_tracked / v_plain:.2f}x",
                ],
                [
                    f"FSDP2 (fully_shard), {WORLD} processes, economy",
                    f"{result['fsdp'][1] * 1e3:.1f} ms",
                    f"{result['fsdp'][0] * 1e3:.1f} ms",
                    f"{result['fsdp'][0] / result['fsdp'][1]:.2f}x",
                ],
                [
                    "one process, whole batch, economy",
                    f"{s_plain * 1e3:.1f} ms",
                    f"{s_tracked * 1e3:.1f} ms",
                    f"{s_tracked / s_plain:.2f}x",
                ],
            ],  # fmt: skip
        ),
        "",
        "Wall-clock medians (perf_counter: the processes wait in collectives, which CPU time "
        "would not show) on a machine shared by 8 helpers (load average "
        f"{os.getloadavg()[0]:.1f} when the report was written): the ratios move by about "
        "+-0.5 between runs; the collective counts and bytes below are exact.",
        "",
        f"Target: DDP ratio at most the single-process ratio + 0.1 "
        f"({s_tracked / s_plain + 0.1:.2f}x): "
        f"{'met' if tracked / plain <= s_tracked / s_plain + 0.1 else 'not met'}. The per-rank "
        f"view (Ranks) costs {v_tracked / v_plain - tracked / plain:+.2f} of the plain step "
        "(each ratio measured beside its own plain copy).",
        "",
        "FSDP2: each child of the model with parameters and the model sharded by "
        "fully_shard; the economy step adds FSDP's unshard of the parameters for the rules "
        "that read them (none in this mlp), one all-gather a tracked step of the directions "
        "the per-sample statistics project onto (the step's mean gradient g_{t+1} and, at "
        "Alpha's end step, its update s_t, measured there under sharding and packed into the "
        "same all-gather: twice the parameters' size; were two all-gathers, s_t's when "
        "optimizer.step() returned), and a few small all-reduces. Alpha's update cannot be "
        "left sharded: its observations' variances need each sample's projection g_n . s, "
        "and process r holds g_n whole for its own samples only, s for its own rows only "
        "(the other rows' part of g_n . s would need the other samples' layer inputs and "
        "output gradients gathered instead, more than the parameters for a sequence model). "
        "The cost of the packing: the start step's capture is held until the end step.",
        "",
        "What the cockpit communicates per tracked step, beside DDP's gradient all-reduce "
        f"({dim:,} elements here, {GPT2_SMALL_PARAMETERS:,} for GPT-2 small): every "
        "torch.distributed collective it calls, counted; *small* is the bytes of those below "
        "the parameters' count, *parameter-sized* the number of collectives of the parameters' "
        "count or more (the GPT-2 small column scales those to its parameters):",
        "",
    ]
    rows = [_traffic_row(name, calls, dim) for name, calls in communication.items()]
    lines.append(
        table(
            ["quantities", "collectives", "small", "parameter-sized", "bytes", "GPT-2 small"],
            rows,
        )
    )
    economy, unequal = (
        sum(b for _, b in communication[name])
        - dim * 8 * len([e for e, _ in communication[name] if e >= dim])
        for name in ("economy", "economy, unequal shards")
    )
    hvp = communication["HessMaxEV"]
    products = len([e for e, _ in hvp if e >= dim]) - 1  # less the gradient's, in no_sync
    per_product = max((b for e, b in hvp if e >= dim), default=0)
    lines += [
        "",
        "A tracked single-batch step of several processes under DDP makes one collective of "
        "its own with equal shards: its agreement, made when the block ends (each process "
        "learns of one that failed, the cockpit's own errors before the backward included, "
        "which are recorded and raised with every process there), held until the "
        "quantities' sums are made, carrying each process's row (raised, batch size, loss, "
        "step time, skipped: 5 float64) and the sums (per-sample sums, which need no "
        "process's batch size first; the global mean gradient is DDP's average). A process "
        "that raised sends zeros in the sums' room, whose size every process knows from the "
        "last step with the same active quantities (the first such step, and one whose sums "
        "outgrow the room, such as Alpha's first end, sends them apart). With unequal shards "
        "the global mean gradient sum_r N_r g_r / N is not DDP's average (1/W) sum_r g_r: "
        "the agreement carries the gradient sums (float64, P numbers beside the rows), and "
        "the sums, which project the g_n on that mean, follow in a second collective "
        "(docs/cockpit.md, 'One collective'). Every process lays out the agreement for the "
        "shards of the last tracked step (the first carries the gradient sums). Under "
        "DDP's no_sync() (the "
        "curvature steps) one parameter-sized all-reduce is the gradient's, which replaces "
        f"DDP's; each Hessian-vector product adds one parameter-sized all-reduce of float64 "
        f"({per_product:,} B here, {GPT2_SMALL_PARAMETERS * 8 / 1e9:.2f} GB for GPT-2 small; "
        f"HessMaxEV made {products} products at this step); HessTrace and TICTrace send their "
        "diagonal (P sums), MeanGSNR the per-coordinate second moments, as their definitions "
        "need.",
        "",
        f"Target: economy adds at most 1 KB per step beyond the gradients (the gradient "
        f"sums' P float64 left out): {economy:,} B with "
        f"equal shards, {unequal:,} B with unequal ones, "
        f"{'met' if max(economy, unequal) <= 1024 else 'not met'} (were 976 B and 976 B).",
        "",
        f"Target: one collective per tracked economy step: "
        f"{len(communication['economy'])} with equal shards, "
        f"{len(communication['economy, unequal shards'])} with unequal ones (were 2 and 3: "
        "an agreement when the backward started, before DDP's buckets, so that a process "
        "that raised before its backward was named; now the cockpit's own errors before the "
        "backward are held to the block's end, and a user's error before the backward leaves "
        "DDP waiting as without the cockpit). Equal shards: "
        f"{'met' if len(communication['economy']) == 1 else 'not met'}. Unequal shards: "
        "two is the least while a quantity projects on the global mean gradient g "
        "(sum_n (g_n . g)^2 = g^T (sum_n g_n g_n^T) g needs g, whole only after the "
        "gradient sums' all-reduce; DDP's average is another combination of the g_r).",
        "",
        "The per-rank view's way (median seconds per step's exchange on this gloo group): "
        "each process's numbers in its slots of the step's one all_reduce, or an all_gather "
        "of them beside the all_reduce of the sums:",
        "",
        table(
            ["numbers per process, sums", *next(iter(result["small"].values()))],
            [
                [f"{k}, {s}", *(f"{t * 1e6:.0f} us" for t in times.values())]
                for (k, s), times in result["small"].items()
            ],
        ),
        "",
        "The slots cost W x k numbers more in the one all_reduce (64 B on 2 processes) and "
        "save a collective's latency; an all_gather of the whole packed vector would give "
        "every process W x S numbers instead of S.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- FSDP2 curvature (issue 29)
# The FSDP2 rows of the curvature presets: the business preset's tracked step beside a plain
# fully_shard step, and what the cockpit sends beyond FSDP's own collectives, per
# Hessian-vector product (``--fsdp-curvature``, its own section of BENCHMARKS.md).
FSDP_ROWS = ["economy", "business", "HessTrace", "TICDiag", "HessMaxEV", "PreconditionedSharpness"]
# FSDP2 (torch 2.13) all-gathers and reduce-scatters through these (counted too, then
# subtracted: a plain step's collectives are FSDP's own)
FSDP_COLLECTIVES = ("all_gather_single", "reduce_scatter_single")


def _counting_output(counted, function):
    """``function`` (FSDP's output-first collectives, called with keywords) counted by the
    (elements, bytes) of its output buffer while ``counted`` is on."""

    def count(*args, **kwargs):
        output = kwargs.get("output", kwargs.get("output_tensor", args[0] if args else None))
        if counted.on and isinstance(output, torch.Tensor):
            counted.calls.append((output.numel(), output.numel() * output.element_size()))
        return function(*args, **kwargs)

    return count


def _fsdp_communication(problem, chosen, shard):
    """(the cockpit's collectives of one tracked step beyond FSDP's, as (elements, bytes),
    the Hessian-vector products its quantities made): step 2's collectives less those of a
    plain fully_shard step of the same model (FSDP's all-gathers and reduce-scatters)."""
    counted = Counted()
    extra = {name: getattr(dist, name) for name in FSDP_COLLECTIVES}
    for name, function in extra.items():
        setattr(dist, name, _counting_output(counted, function))
    try:
        calls = {}
        for tracked in (False, True):
            model, X, y, loss_fn = PROBLEMS[problem]()
            X, y = X[shard], y[shard]
            forward = _wrapped(model, "fsdp")
            made = chosen()
            cockpit = Cockpit(forward, made) if tracked else None
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            for k in range(3):
                counted.on = k == 2
                _step(model, forward, cockpit, opt, X, y, loss_fn, k)
            if cockpit is not None:
                cockpit.close()
            calls[tracked] = counted.take()
    finally:
        counted.close()
        for name, function in extra.items():
            setattr(dist, name, function)
    ours = list(calls[True])
    for call in calls[False]:  # FSDP's own
        ours.remove(call)
    products = sum(q.num_products.get(2, 0) for q in made if hasattr(q, "num_products"))
    return ours, products


def _fsdp_rank(rank, port, problem, steps, warmup, out):
    shard, unequal = _joined(rank, port, problem)
    business = lambda forward: Cockpit(forward, configuration("business"))  # noqa: E731
    economy = lambda forward: Cockpit(forward, configuration("economy"))  # noqa: E731
    timed = {
        "economy": _timed(problem, economy, steps, warmup, shard, wrap="fsdp"),
        "business": _timed(problem, business, steps, warmup, shard, wrap="fsdp"),
    }
    rows = {name: _fsdp_communication(problem, _chosen(name), shard) for name in FSDP_ROWS}
    rows["business, unequal shards"] = _fsdp_communication(problem, _chosen("business"), unequal)
    dist.destroy_process_group()
    if rank == 0:
        torch.save({"timed": timed, "communication": rows}, out)


def run_fsdp(problem: str, steps: int, warmup: int, out: str) -> dict:
    torch.set_num_threads(1)
    business = lambda m: Cockpit(m, configuration("business"))  # noqa: E731
    single = _timed(problem, business, steps, warmup)
    mp.start_processes(
        _fsdp_rank, args=(_free_port(), problem, steps, warmup, out), nprocs=WORLD,
        start_method="spawn",
    )  # fmt: skip
    result = torch.load(out, weights_only=False)
    result["timed"]["one process, whole batch, business"] = single
    result["parameters"] = sum(p.numel() for p in PROBLEMS[problem]()[0].parameters())
    return result


def fsdp_report(problem: str, result: dict) -> str:
    dim = result["parameters"]
    timing = [
        [
            name if name.startswith("one") else f"FSDP2 (fully_shard), {WORLD} processes, {name}",
            f"{plain * 1e3:.1f} ms",
            f"{tracked * 1e3:.1f} ms",
            f"{tracked / plain:.2f}x",
        ]
        for name, (tracked, plain) in result["timed"].items()
    ]
    traffic = []
    for name, (calls, products) in result["communication"].items():
        large = [b for e, b in calls if e >= dim]
        small = sum(b for e, b in calls if e < dim)
        per_product = f"{max(large):,} B" if products and large else ""
        traffic.append(
            [name, str(len(calls)), f"{small:,} B", str(len(large)), str(products or ""),
             per_product, f"{sum(b for _, b in calls):,} B"]
        )  # fmt: skip
    return "\n".join(
        [
            f"## FSDP2: the curvature presets beside a plain fully_shard step "
            f"({time.strftime('%Y-%m-%d')}, issue 29, helper fsdpc)",
            "",
            "Measured by `python -m benchmarks.data_parallel --fsdp-curvature`. "
            f"{problem} ({dim:,} parameters), {WORLD} gloo processes on this machine, batch "
            f"split evenly, one torch thread each, each child with parameters and the model "
            f"sharded by fully_shard; wall clock under the machine's load ({machine()}):",
            "",
            table(["run", "plain step", "tracked step", "ratio"], timing),
            "",
            "What the cockpit sends per tracked step beyond FSDP's own all-gathers and "
            "reduce-scatters (a plain fully_shard step's, subtracted): every torch.distributed "
            "collective, as (elements, bytes) of its buffer; *parameter-sized*: those of the "
            "parameters' count or more; *per product*: the all-reduce of each Hessian-vector "
            "product (Adam, step 2):",
            "",
            table(
                [
                    "quantities",
                    "collectives",
                    "small",
                    "parameter-sized",
                    "products",
                    "per product",
                    "bytes",
                ],
                traffic,
            ),  # fmt: skip
            "",
            "A curvature step keeps FSDP's unsharded parameters through its backward "
            "(set_reshard_after_backward(False)) and reshards them once its values are "
            "computed: no all-gather more than FSDP's, and the whole model held on every "
            "process from the backward to the block's end. Each Hessian-vector product is "
            "one all-reduce of sum_r w_r H_r v, the parameters' size in float64 (the "
            "packing of avionics.distributed.sum_over_processes, as under DDP; HessMaxEV's "
            "Lanczos and PreconditionedSharpness's); a curvature diagonal is "
            "one all-reduce of its P numbers per step (HessTrace alone: its K sums), "
            "TICDiag's second moments one more of P; PreconditionedSharpness all-gathers "
            "P^{-1/2} once per step (each process makes its shards' from the optimizer's "
            "sharded state).",
        ]
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="mlp", choices=sorted(PROBLEMS))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--fsdp-curvature", action="store_true", help="the FSDP2 curvature rows")
    args = parser.parse_args(argv)
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"avionics-dp-{os.getpid()}.pt")
    if args.fsdp_curvature:
        text = fsdp_report(args.problem, run_fsdp(args.problem, args.steps, args.warmup, out))
        print(text)
        if not args.no_write:
            write_section("fsdp-curvature", text)
        return
    text = report(args.problem, run(args.problem, args.steps, args.warmup, out))
    print(text)
    if not args.no_write:
        write_section("data-parallel", text)


if __name__ == "__main__":
    sys.exit(main())
