"""The cockpit under data parallelism: its cost beside a plain DDP or FSDP2 step, what it sends.

Two gloo processes on this machine (one torch thread each) train two copies of a model side by
side, each wrapped in DistributedDataParallel: one plainly, one inside ``with cockpit(step,
info)`` with ``configuration("economy")`` tracking every step; steps alternate as in
:mod:`benchmarks.cockpit_overhead`, and the ratio is median(tracked) / median(plain) on rank 0.
The single-process ratio is measured in the same run (the same model on the whole batch, one
process), since the target is that ratio + 0.1.

Communication: every collective the cockpit makes goes through ``torch.distributed`` (DDP's own
gradient all-reduce runs in its C++ reducer and is not counted). The benchmark records the
elements of each of them during a tracked step, for the whole preset and for each quantity
alone, beside the gradient all-reduce's size (the parameters' count); the same table is then
computed for GPT-2 small (124,439,808 parameters, 12 layers) from the measured counts: a
quantity's count is a constant, or proportional to the parameters (curvature, second moments).

Run: ``python -m benchmarks.data_parallel`` (about two minutes), ``--no-write`` to print only.
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
from benchmarks.problems import PROBLEMS
from benchmarks.report import machine, table, write_section

GPT2_SMALL_PARAMETERS = 124_439_808
WORLD = 2
# Each quantity alone, for its share of the communication.
ALONE = [
    "Loss", "GradNorm", "Distance", "UpdateSize", "NormTest", "InnerTest", "OrthoTest",
    "Alpha", "GradHist1d", "GradientNoiseScale", "MeanGSNR", "HessMaxEV", "HessTrace",
]  # fmt: skip


class Counted:
    """Records the elements (and bytes) of every torch.distributed collective while on."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []
        self.on = False
        self._all_reduce = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            if self.on:
                self.calls.append((tensor.numel(), tensor.numel() * tensor.element_size()))
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce

    def take(self) -> tuple[int, int, int]:
        """(collectives, elements, bytes) since the last take."""
        calls, self.calls = self.calls, []
        return len(calls), sum(c for c, _ in calls), sum(b for _, b in calls)


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
        if cockpit._capture is not None:
            cockpit._capture.disarm()
        t0 = time.perf_counter()
        _step(plain, forwards[1], None, opts[1], X, y, loss_fn, k)
        t1 = time.perf_counter()
        if cockpit._capture is not None:
            cockpit._capture.arm()
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


def _communication(problem, names, shard):
    """(collectives, elements, bytes) of one tracked step (the second: the first arms)."""
    counted = Counted()
    model, X, y, loss_fn = PROBLEMS[problem]()
    X, y = X[shard], y[shard]
    forward = nn.parallel.DistributedDataParallel(model)
    chosen = (
        configuration("economy") if names is None else [getattr(quantities, n)() for n in names]
    )
    cockpit = Cockpit(forward, chosen)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for k in range(3):
        counted.on = k == 2
        _step(model, forward, cockpit, opt, X, y, loss_fn, k)
    cockpit.close()
    dist.all_reduce = counted._all_reduce
    return counted.take()


def _rank(rank, port, problem, steps, warmup, out):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=600),
    )  # fmt: skip
    batch = len(PROBLEMS[problem]()[1])
    per = batch // WORLD
    shard = slice(rank * per, (rank + 1) * per)
    economy = lambda forward: Cockpit(forward, configuration("economy"))  # noqa: E731
    ddp = _timed(problem, economy, steps, warmup, shard, wrap=True)
    fsdp = _timed(problem, economy, steps, warmup, shard, wrap="fsdp")
    rows = {"economy": _communication(problem, None, shard)}
    for name in ALONE:
        rows[name] = _communication(problem, [name], shard)
    dist.destroy_process_group()
    if rank == 0:
        torch.save({"ddp": ddp, "fsdp": fsdp, "communication": rows}, out)


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


def report(problem: str, result: dict) -> str:
    (tracked, plain), (s_tracked, s_plain) = result["ddp"], result["single"]
    dim = result["parameters"]
    lines = [
        f"## Data parallelism: the cockpit beside a plain DDP step ({time.strftime('%Y-%m-%d')})",
        "",
        "Measured by `python -m benchmarks.data_parallel` (its docstring says how).",
        "",
        f"{problem}, {WORLD} gloo processes on this machine, batch split evenly, one torch "
        f"thread each ({machine()}):",
        "",
        table(
            ["run", "plain step", "economy step", "ratio"],
            [
                [
                    f"DDP, {WORLD} processes",
                    f"{plain * 1e3:.1f} ms",
                    f"{tracked * 1e3:.1f} ms",
                    f"{tracked / plain:.2f}x",
                ],
                [
                    f"FSDP2 (fully_shard), {WORLD} processes",
                    f"{result['fsdp'][1] * 1e3:.1f} ms",
                    f"{result['fsdp'][0] * 1e3:.1f} ms",
                    f"{result['fsdp'][0] / result['fsdp'][1]:.2f}x",
                ],
                [
                    "one process, whole batch",
                    f"{s_plain * 1e3:.1f} ms",
                    f"{s_tracked * 1e3:.1f} ms",
                    f"{s_tracked / s_plain:.2f}x",
                ],
            ],  # fmt: skip
        ),
        "",
        f"Target: DDP ratio at most the single-process ratio + 0.1 "
        f"({s_tracked / s_plain + 0.1:.2f}x): "
        f"{'met' if tracked / plain <= s_tracked / s_plain + 0.1 else 'not met'}.",
        "",
        "FSDP2: each child of the model with parameters and the model sharded by "
        "fully_shard; the economy step adds FSDP's unshard of the parameters for the rules "
        "that read them (none in this mlp), two all-gathers of the parameters' size, of the "
        "directions the per-sample statistics project onto (the mean gradient at the step, "
        "Alpha's update when optimizer.step() returns), and a few small all-reduces.",
        "",
        "What the cockpit communicates per tracked step, beside DDP's gradient all-reduce "
        f"({dim:,} elements here, {GPT2_SMALL_PARAMETERS:,} for GPT-2 small); the GPT-2 small "
        "column scales counts proportional to the parameters:",
        "",
    ]
    rows = []
    for name, (calls, elements, nbytes) in result["communication"].items():
        scaled = elements // dim if elements >= dim else 0
        constant = elements - scaled * dim
        gpt2 = (constant + scaled * GPT2_SMALL_PARAMETERS) * (nbytes // max(elements, 1))
        rows.append(
            [name, str(calls), f"{elements:,}", f"{nbytes:,} B",
             f"{gpt2 / 1e6:.1f} MB" if gpt2 >= 1e6 else f"{gpt2:,} B"]
        )  # fmt: skip
    lines.append(table(["quantities", "collectives", "elements", "bytes", "GPT-2 small"], rows))
    economy = result["communication"]["economy"][2]
    lines += [
        "",
        "Each row's first collective is the step's loss and batch sizes (2 numbers per "
        "process). The curvature quantities' steps run in DDP's no_sync(): one of their "
        "parameter-sized all-reduces is the gradient's, which replaces DDP's (so HessTrace "
        "adds its P sums, HessMaxEV one parameter-sized all-reduce per Hessian-vector "
        "product); MeanGSNR sends the per-coordinate second moments, as its definition needs.",
        "",
        f"Target: economy adds at most 1 KB per step: {economy:,} B, "
        f"{'met' if economy <= 1024 else 'not met'}.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="mlp", choices=sorted(PROBLEMS))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"avionics-dp-{os.getpid()}.pt")
    text = report(args.problem, run(args.problem, args.steps, args.warmup, out))
    print(text)
    if not args.no_write:
        write_section("data-parallel", text)


if __name__ == "__main__":
    sys.exit(main())
