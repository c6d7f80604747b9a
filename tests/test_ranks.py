"""The per-rank view (issue 29): each process's own loss, gradient norm, batch size and step time
(the ``Ranks`` quantity), against a float64 reference of each shard alone, in real spawned gloo
processes under DDP; its diagnosis (a straggler rank, an outlier shard) on injected faults and
on a healthy run; its dashboard panel where there are several ranks."""

from __future__ import annotations

import contextlib
import statistics
import time

import models
import pytest
import torch
from spawned import on_ranks
from torch import nn

from avionics import Cockpit, quantities, read_run
from avionics.diagnosis import diagnose, report
from avionics.records import Run

STEPS = 6


def shard(tensor, sizes, rank):
    start = sum(sizes[:rank])
    return tensor[start : start + sizes[rank]]


def data(sizes, step, fault=None, rank=0):
    """Rank ``rank``'s shard of step ``step``'s global batch split into ``sizes``."""
    _, X, y, _ = models.mlp(n=sum(sizes), seed=10 + step)
    return shard(X, sizes, rank), shard(y, sizes, rank)


def viewed_rank(rank, world, sizes, log, fault, reduction="mean", micro=1):
    """A DDP run with Ranks (and Loss, GradNorm) tracked every step; ``fault="slow"`` makes
    rank 1 sleep 60 ms before each forward (a straggler), ``fault="shard"`` its per-sample
    losses 10 times the others' (a shard whose targets or loss differ)."""
    model, _, _, loss_fn = models.mlp(n=2)
    forward = nn.parallel.DistributedDataParallel(model)
    chosen = [quantities.Loss(), quantities.GradNorm(), quantities.Ranks()]
    cockpit = Cockpit(forward, chosen, log=log)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        X, y = data(sizes, step, fault, rank)
        opt.zero_grad()
        if fault == "slow" and rank == 1:
            time.sleep(0.06)
        parts = list(zip(X.tensor_split(micro), y.tensor_split(micro)))
        for i, (Xi, yi) in enumerate(parts):
            last = i == len(parts) - 1
            with contextlib.nullcontext() if last else forward.no_sync():
                losses = loss_fn(forward(Xi), yi) * (10 if fault == "shard" and rank else 1)
                loss = losses.mean() if reduction == "mean" else losses.sum()
                info = {"loss": loss, "individual_losses": losses, "batch_size": len(Xi)}
                share = len(Xi) / len(X) if reduction == "mean" else 1.0
                with cockpit(step, info=info, micro_batch=i, micro_batches=len(parts)):
                    (share * loss).backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output()


def reference(sizes, reduction="mean"):
    """Per step and rank, (L_r, ||g_r||) of each shard alone on one process in float64, the
    model trained with DDP's update (the average of the shards' gradients)."""
    model, _, _, loss_fn = models.mlp(n=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(STEPS):
        per_rank, update = [], None
        for rank in range(len(sizes)):
            X, y = data(sizes, step, None, rank)
            losses = loss_fn(model(X), y)
            loss = losses.mean() if reduction == "mean" else losses.sum()
            grads = torch.autograd.grad(loss, list(model.parameters()))
            mean_grads = grads if reduction == "mean" else [g / len(X) for g in grads]
            norm = torch.cat([g.reshape(-1) for g in mean_grads]).norm()
            per_rank.append((float(loss), float(norm)))
            share = [g / len(sizes) for g in grads]
            update = share if update is None else [u + g for u, g in zip(update, share)]
        out.append(per_rank)
        opt.zero_grad()
        for p, g in zip(model.parameters(), update):
            p.grad = g
        opt.step()
    return out


VIEWS = [((3, 4), "mean", 1), ((4, 2), "sum", 1), ((4, 3), "mean", 2)]
FAULTS = ("slow", "shard", None)


def every_run(rank, world, tmp):
    """The VIEWS, then the FAULTS' runs (each with its log), in one spawn."""
    views = [viewed_rank(rank, world, sizes, None, None, *rest) for sizes, *rest in VIEWS]
    for fault in FAULTS:
        viewed_rank(rank, world, (3, 3), f"{tmp}/{fault}", fault)
    return views


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(per VIEWS case, both ranks' outputs; the folder of the FAULTS' logs)."""
    tmp = tmp_path_factory.mktemp("ranks")
    outputs = on_ranks(every_run, 2, tmp, str(tmp))
    return list(zip(*outputs)), tmp


@pytest.mark.parametrize("case", range(len(VIEWS)), ids=[str(v) for v in VIEWS])
def test_each_rank_s_loss_gradient_norm_and_batch_size_are_its_shard_s(runs, case):
    sizes, reduction, _ = VIEWS[case]
    expected = reference(sizes, reduction)
    for output in runs[0][case]:
        for step in range(STEPS):
            ranks = output[step]["Ranks"]
            assert ranks["batch_size"] == list(sizes)
            losses = [loss for loss, _ in expected[step]]
            norms = [norm for _, norm in expected[step]]
            assert ranks["loss"] == pytest.approx(losses, rel=1e-12)
            assert ranks["grad_norm"] == pytest.approx(norms, rel=1e-10)
            assert all(t > 0 for t in ranks["step_time"])


def test_a_slow_rank_is_found_as_a_straggler(runs):
    log = runs[1] / "slow"
    findings = [f for f in diagnose(log) if f.check == "straggler_ranks"]
    assert [f.title.split(":")[0] for f in findings] == ["Rank 1 is a straggler"]
    times = [read_run(log).steps[s]["Ranks"]["step_time"] for s in range(STEPS)]
    assert statistics.median(slow - fast for fast, slow in times) > 0.04  # the 60 ms sleep
    assert not [f for f in diagnose(log) if f.check == "outlier_shards"]


def test_a_shard_of_another_distribution_is_found_as_an_outlier(runs):
    findings = [f for f in diagnose(runs[1] / "shard") if f.check == "outlier_shards"]
    assert [f.title.rsplit(" ", 4)[0] for f in findings] == [
        "Rank 1's shard has a loss",
        "Rank 1's shard has a gradient norm",
    ]


def test_a_healthy_run_has_no_rank_findings(runs):
    log = runs[1] / "None"
    checks = {f.check for f in diagnose(log)}
    assert not checks & {"straggler_ranks", "outlier_shards"}
    assert "stragglers and outlier shards" not in report(log)  # checked: it had the data
    assert len(read_run(log).steps[0]["Ranks"]["loss"]) == 2


def synthetic(times, losses=None, norms=None):
    """A run of ``len(times)`` steps whose Ranks value has ``times[step]`` per rank."""
    steps = {}
    for step, row in enumerate(times):
        width = len(row)
        steps[step] = {
            "Ranks": {
                "loss": list(losses[step]) if losses else [1.0] * width,
                "grad_norm": list(norms[step]) if norms else [0.5] * width,
                "batch_size": [8] * width,
                "step_time": list(row),
            }
        }
    return Run.from_output(steps, {"world_size": len(times[0])})


def test_the_straggler_rule_reads_the_median_over_steps_against_the_other_ranks():
    # rank 2 of 4 is slow in 6 of 8 steps: found; a rank slow in 2 of 8 is not
    slow = [[0.05, 0.05, 0.15 if s % 4 else 0.05, 0.3 if s in (3, 5) else 0.05] for s in range(8)]
    (finding,) = diagnose(synthetic(slow))
    assert finding.title == "Rank 2 is a straggler: its steps take 3.0x the other ranks'"
    assert "150.0 ms on rank 2, 50.0 ms on the others" in finding.evidence
    # fast steps: 3x of a microsecond is timer noise
    assert diagnose(synthetic([[1e-5, 3e-5]] * 8)) == []


def test_an_outlier_gradient_norm_is_found_and_equal_shards_are_not():
    norms = [[0.5, 0.6, 4.0]] * 5
    (finding,) = diagnose(synthetic([[0.01] * 3] * 5, norms=norms))
    assert finding.check == "outlier_shards" and "gradient norm 7.3x" in finding.title
    assert diagnose(synthetic([[0.01] * 3] * 5, losses=[[1.0, 1.3, 0.8]] * 5)) == []
    assert diagnose(synthetic([[0.01] * 3] * 2, norms=norms[:2])) == []  # too few steps


def test_a_single_process_run_is_not_said_to_lack_the_per_rank_view():
    run = Run.from_output({0: {"Loss": 1.0}}, {"world_size": 1})
    assert "stragglers" not in report(run)
    run = Run.from_output({0: {"Loss": 1.0}}, {"world_size": 2})
    assert "stragglers and outlier shards (needs Ranks)" in report(run)


def test_the_dashboard_draws_the_per_rank_panel_only_with_several_ranks():
    from avionics.dashboard import plot

    times = [[0.05, 0.05, 0.15]] * 5
    titles = [ax.get_title() for ax in plot(synthetic(times)).axes]
    assert titles.count("Ranks") == 1
    single = synthetic([[0.05]] * 5)
    assert "Ranks" not in [ax.get_title() for ax in plot(single).axes]


@pytest.mark.parametrize("architecture", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_with_one_process_the_view_is_the_batch_s_own(architecture, reduction):
    model, X, y, loss_fn = getattr(models, architecture)(n=5)
    cockpit = Cockpit(model, [quantities.Ranks()])
    losses = loss_fn(model(X), y)
    loss = losses.mean() if reduction == "mean" else losses.sum()
    mean_grads = torch.autograd.grad(losses.mean(), list(model.parameters()), retain_graph=True)
    with cockpit(0, info={"loss": loss, "individual_losses": losses, "batch_size": len(X)}):
        loss.backward()
    ranks = cockpit.get_output()[0]["Ranks"]
    norm = torch.cat([g.reshape(-1) for g in mean_grads]).norm()
    assert ranks["loss"] == pytest.approx([float(loss)], rel=1e-14)
    assert ranks["grad_norm"] == pytest.approx([float(norm)], rel=1e-12)
    assert ranks["batch_size"] == [len(X)] and ranks["step_time"] == [None]
