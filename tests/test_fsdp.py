"""The cockpit under FSDP2 (``torch.distributed.fsdp.fully_shard``): on every process, each
quantity of the "economy" and "transformer" presets (PreconditionedSharpness and the other
curvature quantities: tests/test_fsdp_curvature.py) equals one process run on the concatenated
batch (float64), with equal and unequal per-process batches, the root alone or also its blocks
sharded, gradient accumulation (micro-batches, FSDP's gradient sync off or on for the earlier
ones), 2 and 3 gloo processes (avionics.step.sharded)."""

from __future__ import annotations

import models
import pytest
import torch
from spawned import on_ranks
from test_distributed import (
    ARCHITECTURES,
    FIRST_ORDER,
    assert_equal_outputs,
    batches,
    make_quantities,
    optimizer,
    reduced,
    single_process,
    split,
)

from avionics import Cockpit, configuration, read_run

ECONOMY = tuple(q.name for q in configuration("economy"))
# (PreconditionedSharpness reads an Adam's state: with Adam in tests/test_fsdp_curvature.py)
TRANSFORMER = tuple(
    q.name for q in configuration("transformer") if q.name != "PreconditionedSharpness"
)


def shard(model, nested: bool):
    """fully_shard the model (with ``nested``, first each child whose parameters are its own)."""
    from torch.distributed.fsdp import fully_shard

    children = list(model.children())
    for child in children if nested else []:
        own = {id(p) for p in child.parameters()}
        others = {id(p) for c in children if c is not child for p in c.parameters()}
        if own and not own & others:  # (tied weights stay in one group: the root's)
            fully_shard(child)
    fully_shard(model)
    return model


def one_rank(
    rank, world, architecture, names, sizes, nested, log, reduction="mean", micro=1, sync=False
):
    """One process of an FSDP2 run: its shard of each batch, in ``micro`` micro-batches
    (gradient accumulation, FSDP's gradient sync off on all but the last unless ``sync``:
    FSDP's default, a reduce-scatter after each); FSDP averages the gradients."""
    model, _, _, loss_fn = ARCHITECTURES[architecture](n=2)
    shard(model, nested)
    cockpit = Cockpit(model, make_quantities(names), log=log)
    opt = optimizer(model, names)
    for step, (X, y) in enumerate(batches(architecture, sizes)):
        X, y = split(X, sizes, rank), split(y, sizes, rank)
        opt.zero_grad()
        parts = list(zip(X.tensor_split(micro), y.tensor_split(micro)))
        for i, (Xi, yi) in enumerate(parts):
            model.set_requires_gradient_sync(sync or i == len(parts) - 1)
            losses = loss_fn(model(Xi), yi)
            loss = reduced(losses, reduction)
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(Xi)}
            info["optimizer"] = opt
            # the process's gradient is its shard's: each micro-batch weighs by its share
            share = len(Xi) / len(X) if reduction == "mean" else 1.0
            micro_batch = {"micro_batch": i, "micro_batches": len(parts)} if micro > 1 else {}
            with cockpit(step, info=info, **micro_batch):
                (share * loss).backward()
        opt.step()
    cockpit.close()
    return cockpit.get_output(), [p.full_tensor().detach().clone() for p in model.parameters()]


def runs_on_rank(rank, world, scenarios, tmp):
    """This process's (values, final parameters) of every scenario, in one spawn (starting
    processes is what costs)."""
    return [
        one_rank(rank, world, *scenario[:4], f"{tmp}/{k}/run", *scenario[4:])
        for k, scenario in enumerate(scenarios)
    ]


def scenarios_on_ranks(rank, world, scenarios, tmp):
    """Every scenario and, on 2 processes, the refusals, in one spawn."""
    outputs = runs_on_rank(rank, world, scenarios, tmp)
    return outputs, refusals_on_rank(rank, world) if world == 2 else None


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """{world: (its directory, every process's scenarios_on_ranks)}, spawned once a world."""
    runs = {}

    def run(world):
        if world not in runs:
            tmp = tmp_path_factory.mktemp(f"fsdp{world}")
            runs[world] = tmp, on_ranks(scenarios_on_ranks, world, tmp, SCENARIOS[world], str(tmp))
        return runs[world]

    return run


# (architecture, quantity names, per-process batch sizes, blocks sharded too, the loss's
# reduction when it is not the mean, the micro-batches of each process's shard, and whether
# FSDP reduce-scatters the gradients after each micro-batch)
SCENARIOS = {
    2: [
        ("mlp", ECONOMY, (3, 3), False),
        ("mlp", ECONOMY, (5, 2), True),
        ("cnn", ECONOMY, (3, 2), False),
        ("transformer", ECONOMY, (2, 2), True),
        ("transformer", TRANSFORMER, (2, 3), True),
        ("transformer", TRANSFORMER, (3, 3), False),
        ("mlp", TRANSFORMER, (4, 2), False, "sum"),
        ("mlp", FIRST_ORDER, (3, 3), True),
        ("cnn", FIRST_ORDER, (2, 4), False),
    ],
    3: [("mlp", ECONOMY, (3, 2, 4), True), ("transformer", TRANSFORMER, (2, 2, 2), True)],
}
# gradient accumulation on 2 processes (a spawn of its own, bounded in time as each)
ACCUMULATION = [
    ("mlp", ECONOMY, (4, 4), True, "mean", 2),
    ("cnn", ECONOMY, (4, 4), False, "sum", 2, True),
    ("transformer", ECONOMY, (4, 4), True, "mean", 2),
    ("mlp", ECONOMY, (5, 3), False, "mean", 2),
]


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_every_quantity_is_the_global_batch_s_under_fsdp2(spawned, world):
    tmp_path, results = spawned(world)
    assert_runs_are_one_process_s(SCENARIOS[world], [r[0] for r in results], tmp_path)


def test_accumulated_micro_batches_are_the_global_batch_s_under_fsdp2(tmp_path):
    results = on_ranks(runs_on_rank, 2, tmp_path, ACCUMULATION, str(tmp_path))
    assert_runs_are_one_process_s(ACCUMULATION, results, tmp_path)


def assert_runs_are_one_process_s(scenarios, results, tmp_path):
    """Every process's values and final parameters of each scenario (results[rank][k]) are
    one process's on the global batch; rank 0's log has its steps."""
    for k, (architecture, names, sizes, _, *rest) in enumerate(scenarios):
        reduction = rest[0] if rest else "mean"
        expected, params = single_process(architecture, names, sizes, reduction)
        for rank in range(len(sizes)):
            output, final = results[rank][k]
            assert_equal_outputs(output, expected)
            for p, q in zip(final, params):
                torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        run = read_run(tmp_path / str(k) / "run")
        assert sorted(run.steps) == sorted(expected)


def refusals_on_rank(rank, world):
    """What Cockpit(model, ...) raises for each refused case, with the global hooks it
    leaves (none may be left by a refusal), and the shapes of the FSDP1 model's parameters
    after a backward."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from avionics import quantities

    hooks = len(torch.nn.modules.module._global_forward_hooks)
    cases = {
        "full": (True, configuration("full")),
        "second moments": (True, [quantities.GradNorm(), quantities.MeanGSNR()]),
        "fsdp1": (False, [quantities.Loss()]),
        "fsdp1 orig": ("orig", [quantities.Loss()]),
    }
    refused = {}
    for case, (how, chosen) in cases.items():
        model, _, _, _ = models.mlp(n=2)
        if how is True:
            model = shard(model, nested=False)
        else:
            orig = how == "orig"  # (on CPU, FSDP1 needs device_id="cpu")
            model = FullyShardedDataParallel(model, use_orig_params=orig, device_id="cpu")
        try:
            Cockpit(model, chosen)
        except TypeError as error:
            refused[case] = str(error)
    # FSDP1 trains on CPU gloo processes: each parameter a 1-D piece of the flat shard
    X = torch.randn(4, 6, dtype=torch.float64)
    model.train()
    model(X).square().mean().backward()
    shapes = [tuple(p.shape) for p in model.parameters()]
    return refused, len(torch.nn.modules.module._global_forward_hooks) - hooks, shapes


def test_second_moments_the_full_preset_and_fsdp1_are_refused_by_name(spawned):
    ranks = [refusals for _, refusals in spawned(2)[1]]
    # the FSDP1 model ran: its parameters are 1-D pieces of the processes' flat shards,
    # [5, 6] + [5] + ... elements of the model's split across them
    shapes = [shape for _, _, flat in ranks for shape in flat]
    assert all(len(shape) == 1 for shape in shapes)
    assert sum(n for (n,) in shapes) == sum(p.numel() for p in models.mlp()[0].parameters())
    for refused, hooks_left, _ in ranks:
        assert hooks_left == 0
        assert "GradHist2d need every parameter or its second moments whole" in refused["full"]
        moments = refused["second moments"]
        assert "MeanGSNR need every parameter or its second moments whole" in moments
        assert "Loss, GradNorm, Distance, UpdateSize" in moments
        for case in ("fsdp1", "fsdp1 orig"):
            assert "FullyShardedDataParallel (FSDP1)" in refused[case]
            assert "torch.distributed.fsdp.fully_shard" in refused[case]
        assert "use_orig_params=True" in refused["fsdp1 orig"]
        assert "flattened shard cut across parameters" in refused["fsdp1 orig"]
        assert "flattened parameters have no names" in refused["fsdp1"]


def gathers_per_step(rank, world, sizes):
    """The parameter-sized all-gathers the cockpit makes in each step of an economy run
    (its block and its optimizer.step()), with the run's values."""
    from avionics.step import sharded

    original, per_step = sharded._all_gather, []

    def counted(output, tensor):
        per_step[-1].append(output.numel())
        original(output, tensor)

    sharded._all_gather = counted
    try:
        model, X, y, loss_fn = models.mlp(n=sum(sizes))
        shard(model, nested=False)
        start = sum(sizes[:rank])
        X, y = X[start : start + sizes[rank]], y[start : start + sizes[rank]]
        cockpit = Cockpit(model, configuration("economy"))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(4):
            per_step.append([])
            opt.zero_grad()
            losses = loss_fn(model(X), y)
            info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X)}
            info["optimizer"] = opt
            with cockpit(step, info=info):
                losses.mean().backward()
            opt.step()
        cockpit.close()
        parameters = sum(p.numel() for p in model.parameters())
        return per_step, parameters, cockpit.get_output()
    finally:
        sharded._all_gather = original


@pytest.mark.parametrize("sizes", [(3, 3), (4, 2)])
def test_economy_makes_one_all_gather_per_tracked_step_under_fsdp2(tmp_path, sizes):
    """The mean gradient g_{t+1} and Alpha's update s_t travel in one all-gather (the
    step's), of twice the parameters at an Alpha end step (were two all-gathers: s_t when
    optimizer.step() returned); the values are one process's (the scenarios above)."""
    results = on_ranks(gathers_per_step, 2, tmp_path, sizes)
    for per_step, parameters, output in results:
        assert [len(gathers) for gathers in per_step] == [1, 1, 1, 1]
        assert all(n >= parameters for gathers in per_step for n in gathers)
        assert max(n for gathers in per_step for n in gathers) >= 2 * parameters  # g and s
        assert sorted(output) == [0, 1, 2, 3]
        assert any("Alpha" in values for values in output.values())
