"""A rank that fails inside its block (issue 29, item 1; issue 26, one collective).

* The cockpit's own error on one rank before its backward (a bad ``info`` there): under DDP it
  is not raised on entering: that rank's block runs with the cockpit's hooks quiet, its
  backward makes DDP's all-reduces as usual, and the step's one agreement (when the blocks
  end) tells every rank, which raises a RuntimeError naming the rank, the step and the error;
  every process goes on to the next steps in step.
* The user's own error before the backward: under FSDP2 the step's first agreement is made when
  the backward's gradient arrives at the loss, before any collective of that backward (FSDP's
  pre-backward all-gathers, whose hook sits on the loss itself where the loss is the sharded
  root's output), so every other process raises naming the rank. Under DDP the others wait in
  DDP's all-reduces as they would without the cockpit (docs/cockpit.md).
"""

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


def test_a_rank_raising_before_its_backward_is_named_on_every_rank_under_fsdp2(tmp_path):
    (outcomes0, values0), (outcomes1, values1) = on_ranks(
        raising_before_backward, 2, tmp_path, "fsdp2"
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


def failing_check_on_rank_1(rank, world, sizes, failing):
    """Under DDP, rank 1 gives the cockpit per-sample losses of the wrong size at step
    ``failing`` (the cockpit's own check fails there only); every process catches what it
    gets and goes on. Returns (each step's outcome, the values stored, the collectives of the
    failing step)."""
    from test_traffic import Counted

    network, X, y, loss_fn = models.mlp(n=sum(sizes))
    model = nn.parallel.DistributedDataParallel(WithLoss(network, loss_fn))
    cockpit = Cockpit(model, [quantities.Loss(), quantities.GradNorm(), quantities.NormTest()])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = sum(sizes[:rank])
    X, y = X[start : start + sizes[rank]], y[start : start + sizes[rank]]
    outcomes, counted, calls = [], Counted(), []
    for step in range(STEPS):
        counted.on, counted.calls = step == failing, []
        opt.zero_grad()
        losses = model(X, y)
        given = losses[:-1] if rank == 1 and step == failing else losses
        info = {"loss": losses.mean(), "individual_losses": given, "batch_size": len(X)}
        try:
            with cockpit(step, info=info):
                info["loss"].backward()
        except (ValueError, RuntimeError) as error:
            outcomes.append(f"{type(error).__name__}: {error}")
            calls = [size for _, size in counted.calls]
            continue
        finally:
            counted.on = False
        outcomes.append("tracked")
        opt.step()
    counted.close()
    cockpit.close()
    return outcomes, cockpit.get_output(), calls, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(("sizes", "failing"), [((3, 3), 2), ((3, 4), 1)])
def test_the_cockpit_failing_on_one_rank_before_the_backward_raises_on_every_rank(
    tmp_path, sizes, failing
):
    """Equal shards at a step whose sums ride in the agreement, unequal ones at a step whose
    agreement carries the gradient sums: both ranks raise the same RuntimeError, naming rank 1
    and its error, after one collective of the agreement (and one of the messages); DDP's
    all-reduces ran on both (the parameters stay equal), and the other steps are tracked."""
    results = on_ranks(failing_check_on_rank_1, 2, tmp_path, sizes, failing)
    (outcomes0, values0, calls0, params0), (outcomes1, values1, calls1, params1) = results
    for outcomes in (outcomes0, outcomes1):
        error = outcomes[failing]
        assert error.startswith(
            f"RuntimeError: Step {failing}, micro-batch 0: the process(es) of rank 1 raised"
        )
        told = f"rank 1: ValueError: info['batch_size'] is {sizes[1]} but info['individual"
        assert told in error
        others = [o for step, o in enumerate(outcomes) if step != failing]
        assert others == ["tracked"] * (STEPS - 1)
    assert "(rank 0 here;" in outcomes0[failing] and "(rank 1 here;" in outcomes1[failing]
    assert calls0 == calls1 and len(calls0) == 2  # the agreement, then the messages
    assert calls0[1] == 2 * 512  # every rank's message, uint8
    stored = sorted(set(range(STEPS)) - {failing})
    assert sorted(values0) == sorted(values1) == stored
    for step in stored:
        for name in ("Loss", "GradNorm", "NormTest"):
            torch.testing.assert_close(values0[step][name], values1[step][name], rtol=0, atol=0)
    for p, q in zip(params0, params1):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
