"""The cockpit under data parallelism: on every process, each quantity equals a single process
run on the concatenated batch (float64), with DistributedDataParallel and its options, equal
and unequal per-process batches, 2 and 3 gloo processes, gradient accumulation in each process
(docs/definitions.md, section 2; avionics.distributed).
"""

from __future__ import annotations

import contextlib
import warnings

import models
import pytest
import torch
from compare import assert_same_output
from spawned import on_ranks
from torch import nn

from avionics import Cockpit, configuration, quantities, read_run

STEPS = 3
ARCHITECTURES = {"mlp": models.mlp, "cnn": models.cnn, "transformer": models.transformer}


def batches(architecture: str, sizes: tuple[int, ...]):
    """STEPS global batches of sum(sizes) samples, and how they split over the processes."""
    total = sum(sizes)
    out = []
    for step in range(STEPS):
        _, X, y, _ = ARCHITECTURES[architecture](n=total, seed=100 + step)
        out.append((X, y))
    return out


def split(tensor: torch.Tensor, sizes, rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return tensor[start : start + sizes[rank]]


def make_quantities(names):
    return [getattr(quantities, name)() for name in names] if names else configuration("full")


class MeasuredSGD(torch.optim.SGD):
    """SGD that is not "plain SGD" to the cockpit (it overrides step): Alpha measures the
    update, which here is not -lr times the gradient the cockpit saw (the test sets DDP's)."""

    def step(self, closure=None):
        return super().step(closure)


def optimizer(model, names):
    plain = names is not None and "CABS" in names
    return (torch.optim.SGD if plain else MeasuredSGD)(model.parameters(), lr=0.05)


def reduced(losses, reduction):
    return losses.mean() if reduction == "mean" else losses.sum()


def ddp_gradient(model, losses, sizes, reduction="mean"):
    """What DDP leaves in p.grad: the average over processes of their losses' gradients."""
    shares = losses.split(list(sizes))
    objective = sum(reduced(share, reduction) for share in shares) / len(sizes)
    return torch.autograd.grad(objective, list(model.parameters()), retain_graph=True)


def single_process(architecture, names, sizes, reduction="mean", made=None):
    """The reference: one process, the global batch, and the update DDP makes (the average of
    the processes' gradients); ``made``: (quantities, optimizer) from ``names`` and the model,
    by default this file's :func:`make_quantities` and :func:`optimizer`."""
    make, make_optimizer = made or (make_quantities, optimizer)
    model, _, _, loss_fn = ARCHITECTURES[architecture](n=2)
    cockpit = Cockpit(model, make(names))
    opt = make_optimizer(model, names)
    for step, (X, y) in enumerate(batches(architecture, sizes)):
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        loss = reduced(losses, reduction)
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X), "optimizer": opt}
        update = ddp_gradient(model, losses, sizes, reduction)
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        for p, g in zip(model.parameters(), update):
            p.grad = g.detach()
        opt.step()
    cockpit.close()
    return cockpit.get_output(), [p.detach().clone() for p in model.parameters()]


def one_rank(
    rank, world, architecture, names, sizes, wrap, options, log, reduction="mean", micro=1
):
    """One process of a data-parallel run: its shard of each batch, DDP (``wrap``) with
    ``options`` or the plain model with the gradients averaged by hand; the shard in ``micro``
    micro-batches (gradient accumulation, DDP's ``no_sync`` on all but the last)."""
    model, _, _, loss_fn = ARCHITECTURES[architecture](n=2)
    forward = nn.parallel.DistributedDataParallel(model, **options) if wrap else model
    # wrap == "module": trained through DDP, but the cockpit is given the module it wraps
    cockpit = Cockpit(model if wrap == "module" else forward, make_quantities(names), log=log)
    opt = optimizer(model, names)
    for step, (X, y) in enumerate(batches(architecture, sizes)):
        X, y = split(X, sizes, rank), split(y, sizes, rank)
        opt.zero_grad()
        parts = list(zip(X.tensor_split(micro), y.tensor_split(micro)))
        for i, (Xi, yi) in enumerate(parts):
            last = i == len(parts) - 1
            with forward.no_sync() if wrap is True and not last else contextlib.nullcontext():
                losses = loss_fn(forward(Xi), yi)
                loss = reduced(losses, reduction)
                info = {"loss": loss, "individual_losses": losses, "batch_size": len(Xi)}
                info["optimizer"] = opt
                # the process's gradient is its shard's: each micro-batch weighs by its share
                share = len(Xi) / len(X) if reduction == "mean" else 1.0
                with cockpit(step, info=info, micro_batch=i, micro_batches=len(parts)):
                    (share * loss).backward(create_graph=cockpit.create_graph(step))
        if not wrap:  # what DDP would do
            for p in model.parameters():
                p.grad = p.grad.detach()
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        opt.step()
    cockpit.close()
    return cockpit.get_output(), [p.detach().clone() for p in model.parameters()]


def scenarios_on_ranks(rank, world, scenarios, tmp):
    """Every scenario in one spawn (starting processes is what costs)."""
    return [
        one_rank(rank, world, *scenario[:5], f"{tmp}/{k}/run", *scenario[5:])
        for k, scenario in enumerate(scenarios)
    ]


def assert_equal_outputs(ours, expected, rel=1e-10):
    """Every step's values equal (nested ones through tests/compare.py), but for Time."""
    assert sorted(ours) == sorted(expected)
    for step, values in expected.items():
        assert sorted(ours[step]) == sorted(values), step
        for name, value in values.items():
            if name != "Time":
                assert_same_output(ours[step][name], value, rel, 1e-12, (step, name))


FIRST_ORDER = ("Loss", "GradNorm", "Distance", "UpdateSize")
# quantities defined for plain SGD (trained with it, and without Alpha, whose shortcut for
# plain SGD assumes the update is -lr times the gradient the cockpit saw: the reference is
# updated with DDP's gradient)
PLAIN_SGD_ONLY = ("CABS", "EarlyStopping", "MeanGSNR", "Loss")
FIRST_ORDER_PER_SAMPLE = (
    *("Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest"),
    *("OrthoTest", "UpdateSize", "MeanGSNR", "GradientNoiseScale", "GradHist2d"),
)
ECONOMY_AND_CURVATURE = (
    *("Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "Loss", "NormTest"),
    *("OrthoTest", "UpdateSize", "HessMaxEV", "MeanGSNR", "GradientNoiseScale", "TICTrace"),
)

# (architecture, quantity names or None for "full", per-process batch sizes, DDP, its options,
# the loss's reduction when it is not the mean, and the micro-batches of each process's shard)
SCENARIOS = {
    2: [
        ("mlp", None, (4, 4), True, {}),
        ("mlp", None, (5, 2), True, {}),
        ("cnn", ECONOMY_AND_CURVATURE, (3, 2), True, {"gradient_as_bucket_view": True}),
        ("transformer", FIRST_ORDER_PER_SAMPLE, (2, 3), True, {"find_unused_parameters": True}),
        ("transformer", ("Loss", "HessMaxEV", "TICTrace"), (2, 2), True, {}),
        ("mlp", FIRST_ORDER, (3, 3), True, {"gradient_as_bucket_view": True}),
        ("mlp", FIRST_ORDER, (3, 3), True, {"static_graph": True}),
        ("mlp", FIRST_ORDER, (3, 3), True, {"find_unused_parameters": True}),
        ("mlp", FIRST_ORDER, (3, 4), False, {}),
        ("mlp", FIRST_ORDER_PER_SAMPLE, (3, 4), "module", {"gradient_as_bucket_view": True}),
        ("mlp", PLAIN_SGD_ONLY, (3, 4), True, {}),
        ("mlp", None, (4, 2), True, {}, "sum"),
        ("cnn", ECONOMY_AND_CURVATURE, (3, 3), True, {}, "sum"),
        ("mlp", ECONOMY_AND_CURVATURE, (4, 3), True, {}, "mean", 2),
        ("cnn", ECONOMY_AND_CURVATURE, (4, 4), True, {}, "sum", 2),
    ],
    3: [("mlp", None, (3, 2, 4), True, {})],
}


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_every_quantity_is_the_global_batch_s(tmp_path, world):
    scenarios = SCENARIOS[world]
    results = on_ranks(scenarios_on_ranks, world, tmp_path, scenarios, str(tmp_path))
    for k, (architecture, names, sizes, *rest) in enumerate(scenarios):
        reduction = rest[2] if len(rest) > 2 else "mean"
        expected, params = single_process(architecture, names, sizes, reduction)
        for rank in range(world):
            output, final = results[rank][k]
            assert_equal_outputs(output, expected)
            for p, q in zip(final, params):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        run = read_run(tmp_path / str(k) / "run")  # rank 0's log, the only one
        assert sorted(run.steps) == sorted(expected)
        assert run.metadata["world_size"] == world


def raising_rank(rank, world, log):
    """Rank 1 raises inside its block at step 2 and leaves; rank 0 goes on until the process
    group fails it."""
    model, _, _, loss_fn = models.mlp(n=2)
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, [quantities.Loss(), quantities.NormTest()], log=log)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (X, y) in enumerate(batches("mlp", (3, 3)) * 2):
        X, y = split(X, (3, 3), rank), split(y, (3, 3), rank)
        opt.zero_grad()
        losses = loss_fn(forward(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        try:
            with cockpit(step, info=info):
                if rank == 1 and step == 2:
                    raise ValueError("the user's own error")
                losses.mean().backward()
        except (ValueError, RuntimeError) as error:
            return f"step {step}: {type(error).__name__}"
        opt.step()
    return "finished"


def test_a_process_that_raises_leaves_rank_0_s_log_readable(tmp_path):
    log = tmp_path / "run"
    outcomes = on_ranks(raising_rank, 2, tmp_path, str(log))
    assert outcomes[1] == "step 2: ValueError"
    assert outcomes[0].startswith("step 2") or outcomes[0].startswith("step 3")
    run = read_run(log)
    assert sorted(run.steps) == [0, 1] and run.problems == []


def per_rank_logs(rank, world, log):
    model, _, _, loss_fn = models.mlp(n=2)
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, [quantities.Loss()], log=log)
    X, y = batches("mlp", (2, 3))[0]
    losses = loss_fn(forward(split(X, (2, 3), rank)), split(y, (2, 3), rank))
    with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses}):
        losses.mean().backward()
    cockpit.close()


def test_a_log_path_with_rank_gives_each_process_its_log(tmp_path):
    on_ranks(per_rank_logs, 2, tmp_path, str(tmp_path / "rank{rank}"))
    for rank in range(2):
        run = read_run(tmp_path / f"rank{rank}")
        assert run.metadata["world_size"] == 2 and sorted(run.steps) == [0]


def noise_scale_per_process(rank, world, sizes):
    model, _, _, loss_fn = models.mlp(n=2)
    forward = nn.parallel.DistributedDataParallel(model)
    chosen = [
        quantities.GradCovTrace(per_process=True),
        quantities.TrueGradSqNorm(per_process=True),
    ]
    cockpit = Cockpit(forward, chosen)
    X, y = batches("mlp", sizes)[0]
    losses = loss_fn(forward(split(X, sizes, rank)), split(y, sizes, rank))
    with cockpit(0, info={"loss": losses.mean(), "batch_size": len(losses)}):
        losses.mean().backward()
    return cockpit.get_output()[0]


@pytest.mark.parametrize("sizes", [(3, 3), (2, 2, 2)])
def test_the_cheap_noise_scale_takes_the_processes_batches_as_the_small_ones(tmp_path, sizes):
    """B_small = N / P: |G_small|^2 the mean of the processes' ||g_r||^2, B_big = N."""
    outputs = on_ranks(noise_scale_per_process, len(sizes), tmp_path, sizes)
    model, _, _, loss_fn = models.mlp(n=2)
    X, y = batches("mlp", sizes)[0]
    per_process = []
    for rank in range(len(sizes)):
        loss = loss_fn(model(split(X, sizes, rank)), split(y, sizes, rank)).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        per_process.append(torch.cat([g.reshape(-1) for g in grads]))
    g_r = torch.stack(per_process)
    small, big = g_r.pow(2).sum(1).mean(), g_r.mean(0).pow(2).sum()
    b, n = sizes[0], sum(sizes)
    noise = (small - big) / (1 / b - 1 / n)
    signal = (n * big - b * small) / (n - b)
    for output in outputs:
        assert output["GradCovTrace"] == pytest.approx(float(noise), rel=1e-10)
        assert output["TrueGradSqNorm"] == pytest.approx(float(signal), rel=1e-10)


# Per-process batch sizes that change between steps: equal, then unequal at step 2 (the steps
# laid out for equal shards learn it only from their agreement), then equal again.
CHANGING = [(3, 3), (3, 3), (3, 2), (3, 2), (3, 3), (3, 3)]
PER_SAMPLE = ("Loss", "GradNorm", "NormTest", "InnerTest", "OrthoTest", "LossOutliers")


def changing_batches():
    return [
        (*models.mlp(n=sum(sizes), seed=200 + step)[1:3], sizes)
        for step, sizes in enumerate(CHANGING)
    ]


def changing_shards(rank, world):
    """DDP with CHANGING shards: (the values, the warnings of each step)."""
    model, _, _, loss_fn = models.mlp(n=2)
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, make_quantities(PER_SAMPLE))
    opt = MeasuredSGD(model.parameters(), lr=0.05)
    said = []
    for step, (X, y, sizes) in enumerate(changing_batches()):
        X, y = split(X, sizes, rank), split(y, sizes, rank)
        opt.zero_grad()
        losses = loss_fn(forward(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with cockpit(step, info=info):
                losses.mean().backward()
        said.append([str(w.message) for w in caught if "batch sizes" in str(w.message)])
        opt.step()
    cockpit.close()
    return cockpit.get_output(), said


def test_shards_that_become_unequal_skip_one_step_s_values_and_are_exact_after(tmp_path):
    """A step laid out for equal shards (as at the step before) whose shards are unequal
    stores its Loss alone, with a warning, on every process; every other step equals one
    float64 process on the global batch."""
    model, _, _, loss_fn = models.mlp(n=2)
    cockpit = Cockpit(model, make_quantities(PER_SAMPLE))
    opt = MeasuredSGD(model.parameters(), lr=0.05)
    for step, (X, y, sizes) in enumerate(changing_batches()):
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X)}
        update = ddp_gradient(model, losses, sizes)
        with cockpit(step, info=info):
            losses.mean().backward()
        for p, g in zip(model.parameters(), update):
            p.grad = g.detach()
        opt.step()
    cockpit.close()
    expected = cockpit.get_output()
    first_unequal = CHANGING.index((3, 2))
    for output, said in on_ranks(changing_shards, 2, tmp_path):
        assert sorted(output[first_unequal]) == ["Loss"]
        assert output[first_unequal]["Loss"] == pytest.approx(
            float(expected[first_unequal]["Loss"]), rel=1e-12
        )
        assert [len(s) for s in said] == [int(step == first_unequal) for step in range(6)]
        assert "batch sizes (3, 2) are unequal" in said[first_unequal][0]
        others = {step: values for step, values in expected.items() if step != first_unequal}
        del output[first_unequal]
        assert_equal_outputs(output, others)
