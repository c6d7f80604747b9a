"""The curvature quantities under FSDP2 (``fully_shard``): on every process, HessTrace, TICDiag,
TICTrace, HessMaxEV and PreconditionedSharpness (and the "business" preset) equal one process
run on the concatenated batch (float64), with equal and unequal per-process batches, the root
alone or also its blocks sharded, 2 gloo processes (avionics.step.sharded).

A double backward through the step's gradient graph reads the layers' unsharded parameters
the forward saved. With fully_shard's defaults FSDP frees them after the backward
(reshard_after_backward); the cockpit keeps them through the backward of a curvature step
(``set_reshard_after_backward(False)``, the user's setting restored after) and reshards them
when the step's values are computed. Each process's product is then H_r v of its own loss,
and w_r-weighted they add to the global batch's H v; the diagonals add alike.
"""

from __future__ import annotations

import pytest
import torch
from spawned import on_ranks
from test_distributed import (
    ARCHITECTURES,
    assert_equal_outputs,
    batches,
    reduced,
    single_process,
    split,
)
from test_fsdp import shard

from avionics import Cockpit, configuration, quantities

CURVATURE = ("Loss", "HessTrace", "TICDiag", "TICTrace", "HessMaxEV")
BUSINESS = tuple(q.name for q in configuration("business"))
SHARPNESS = ("Loss", "GradNorm", "PreconditionedSharpness")


def make_quantities(names):
    """The quantities ``names``, "Name:variant" with the curvature diagonal's variant."""
    made = []
    for name in names:
        name, _, variant = name.partition(":")
        made.append(getattr(quantities, name)(**({"curvature": variant} if variant else {})))
    return made


def optimizer(model, names):
    """Adam where PreconditionedSharpness reads its state, else SGD (not "plain SGD" to the
    cockpit: Alpha measures the update)."""
    if "PreconditionedSharpness" in names:
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)


def one_rank(rank, world, architecture, names, sizes, nested, reduction="mean", micro=1):
    """One process of an FSDP2 run with the curvature quantities ``names``: its shard of each
    batch, backpropagated with create_graph where the cockpit asks, in ``micro`` micro-batches
    (gradient accumulation, FSDP's gradient sync off on all but the last)."""
    model, _, _, loss_fn = ARCHITECTURES[architecture](n=2)
    shard(model, nested)
    groups = [
        group
        for module in model.modules()
        if hasattr(module, "_get_fsdp_state")
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]
    cockpit = Cockpit(model, make_quantities(names))
    opt = optimizer(model, names)
    unsharded_after = []  # after each block: whether a group still holds its whole parameters
    for step, (X, y) in enumerate(batches(architecture, sizes)):
        X, y = split(X, sizes, rank), split(y, sizes, rank)
        opt.zero_grad()
        parts = list(zip(X.tensor_split(micro), y.tensor_split(micro)))
        for i, (Xi, yi) in enumerate(parts):
            model.set_requires_gradient_sync(i == len(parts) - 1)
            losses = loss_fn(model(Xi), yi)
            loss = reduced(losses, reduction)
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(Xi)}
            info["optimizer"] = opt
            share = len(Xi) / len(X) if reduction == "mean" else 1.0
            with cockpit(step, info=info, micro_batch=i, micro_batches=len(parts)):
                (share * loss).backward(create_graph=cockpit.create_graph(step))
        unsharded_after.append(any(group.is_unsharded for group in groups))
        opt.step()
    cockpit.close()
    settings = [group.reshard_after_backward for group in groups]
    final = [p.full_tensor().detach().clone() for p in model.parameters()]
    return cockpit.get_output(), final, unsharded_after, settings


def scenarios_on_rank(rank, world, scenarios):
    return [one_rank(rank, world, *scenario) for scenario in scenarios]


# (architecture, quantity names, per-process batch sizes, blocks sharded too, the loss's
# reduction, the micro-batches of each process's shard)
SCENARIOS = [
    ("mlp", CURVATURE, (3, 3), True),
    ("mlp", CURVATURE, (5, 2), False),
    ("cnn", CURVATURE, (2, 3), True),
    ("mlp", BUSINESS, (4, 2), True, "sum"),
    ("mlp", SHARPNESS, (3, 4), True),
    ("cnn", ("Loss", "HessTrace:diag_ggn_exact", "TICDiag:diag_ggn_mc"), (3, 2), False),
    ("mlp", ("TICTrace:diag_ggn_mc", "TICDiag:diag_ggn_exact"), (2, 4), True, "sum"),
    ("mlp", CURVATURE, (4, 4), True, "mean", 2),
    ("cnn", ("Loss", "HessMaxEV", "TICDiag:diag_ggn_exact"), (4, 2), False, "sum", 2),
    ("transformer", ("Loss", "HessMaxEV", "TICTrace", "PreconditionedSharpness"), (2, 3), True),
]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_curvature")
    return on_ranks(scenarios_on_rank, 2, tmp, SCENARIOS)


@pytest.mark.parametrize("k", range(len(SCENARIOS)))
def test_curvature_quantities_are_the_global_batch_s_under_fsdp2(spawned, k):
    architecture, names, sizes, _, *rest = SCENARIOS[k]
    expected, params = single_process(
        architecture, names, sizes, *rest[:1], made=(make_quantities, optimizer)
    )
    for output, final, unsharded_after, settings in (results[k] for results in spawned):
        assert_equal_outputs(output, expected)
        # (Adam moves a coordinate whose gradient is rounding noise by lr times its sign)
        for p, q in zip(final, params):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)
        # resharded after each step's values; FSDP's own setting back after close
        assert unsharded_after == [False] * len(unsharded_after)
        assert settings == [True] * len(settings)
