"""A rank that raises inside its block before its backward, under DDP and FSDP2 (issue 29,
item 1): the step's first agreement is made when the backward's gradient arrives at the loss,
before any collective of that backward (DDP's all-reduces, FSDP's pre-backward all-gathers,
whose hook sits on the loss itself where the loss is the sharded root's output), so every other
process raises a RuntimeError naming the rank and the step instead of waiting in a collective
the raising rank never makes; and every process goes on to the next steps in step."""

from __future__ import annotations

import models
import pytest
import torch
from spawned import on_ranks
from test_fsdp import shard
from torch import nn

from avionics import Cockpit, quantities

STEPS, FAILING = 4, 1


class WithLoss(nn.Module):
    """The mlp and its per-sample losses in one forward (as Hugging Face models return their
    loss): under fully_shard the losses are the root's output, on which FSDP hooks its
    pre-backward (root) and backward prefetch (all-gathers of the blocks)."""

    def __init__(self, network, loss_fn):
        super().__init__()
        self.network, self.loss_fn = network, loss_fn

    def forward(self, X, y):
        return self.loss_fn(self.network(X), y)


def raising_before_backward(rank, world, wrap):
    """Rank 1 raises before its backward at step FAILING; every process catches what it gets
    and goes on. Returns (each step's outcome, the values stored)."""
    network, X, y, loss_fn = models.mlp(n=6)
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(WithLoss(network, loss_fn))
    else:  # each Linear sharded apart, then the root
        for layer in network:
            if isinstance(layer, nn.Linear):
                shard(layer, False)
        model = shard(WithLoss(network, loss_fn), False)
    cockpit = Cockpit(model, [quantities.Loss(), quantities.GradNorm(), quantities.NormTest()])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    X, y = X[3 * rank : 3 * rank + 3], y[3 * rank : 3 * rank + 3]
    outcomes = []
    for step in range(STEPS):
        opt.zero_grad()
        losses = model(X, y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        try:
            with cockpit(step, info=info):
                if rank == 1 and step == FAILING:
                    raise ValueError("the user's own error")
                info["loss"].backward()
        except (ValueError, RuntimeError) as error:
            outcomes.append(f"{type(error).__name__}: {error}")
            continue
        outcomes.append("tracked")
        opt.step()
    cockpit.close()
    return outcomes, cockpit.get_output()


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_a_rank_raising_before_its_backward_is_named_on_every_rank(tmp_path, wrap):
    (outcomes0, values0), (outcomes1, values1) = on_ranks(
        raising_before_backward, 2, tmp_path, wrap
    )
    assert outcomes1[FAILING] == "ValueError: the user's own error"
    assert outcomes0[FAILING].startswith(
        f"RuntimeError: Step {FAILING}, micro-batch 0: the process(es) of rank 1 raised inside"
    )
    others = [o for step, o in enumerate(outcomes0 + outcomes1) if step % STEPS != FAILING]
    assert others == ["tracked"] * (2 * STEPS - 2)
    stored = sorted(set(range(STEPS)) - {FAILING})
    assert sorted(values0) == sorted(values1) == stored
    for step in stored:  # the global batch's values, the same on both ranks
        for name in ("Loss", "GradNorm", "NormTest"):
            torch.testing.assert_close(values0[step][name], values1[step][name], rtol=0, atol=0)
            assert torch.isfinite(torch.as_tensor(values0[step][name])).all()


class NormTestFailingOnRank1(quantities.NormTest):
    """The norm test, but for rank 1's sums at step FAILING, which raise (a user's instrument
    failing on one process, after every block ended)."""

    def sums(self, data):
        if data.parallel.world.rank == 1 and data.step == FAILING + 1:
            raise ValueError("the instrument's own error")
        return super().sums(data)


def raising_while_computing(rank, world):
    """Under DDP with equal shards (the sums ride in the held closing agreement): rank 1 raises
    while computing its values; every process goes on."""
    network, X, y, loss_fn = models.mlp(n=6)
    model = nn.parallel.DistributedDataParallel(WithLoss(network, loss_fn))
    cockpit = Cockpit(model, [quantities.Loss(), NormTestFailingOnRank1()])
    X, y = X[3 * rank : 3 * rank + 3], y[3 * rank : 3 * rank + 3]
    outcomes = []
    for step in range(STEPS):
        losses = model(X, y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        try:
            with cockpit(step, info=info):
                info["loss"].backward()
        except (ValueError, RuntimeError) as error:
            outcomes.append(f"{type(error).__name__}: {error}")
            continue
        outcomes.append("tracked")
    cockpit.close()
    return outcomes, sorted(cockpit.get_output())


def test_a_rank_raising_while_computing_its_values_is_named_on_every_rank(tmp_path):
    (outcomes0, steps0), (outcomes1, steps1) = on_ranks(raising_while_computing, 2, tmp_path)
    failing = FAILING + 1  # (the step after the room for the sums is learnt)
    assert outcomes1[failing] == "ValueError: the instrument's own error"
    assert outcomes0[failing].startswith(
        f"RuntimeError: Step {failing}, micro-batch 0: the process(es) of rank 1 raised"
    )
    assert [o for s, o in enumerate(outcomes0) if s != failing] == ["tracked"] * (STEPS - 1)
    assert steps0 == steps1 == sorted(set(range(STEPS)) - {failing})
