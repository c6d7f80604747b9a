"""Under DDP, an exception inside the block on one rank (issue 28, item 6): every other
process learns which rank raised at which step, with nothing stored for that step, instead of
gloo's collective mismatch: the user's error after the backward, or the cockpit's own check
failing on that rank before the backward (issue 26: not raised there, but with every process
when the blocks end). The user's own error before the backward leaves the others waiting in
DDP's all-reduces, as without the cockpit (docs/cockpit.md)."""

from __future__ import annotations

import models
import pytest
import torch
from spawned import on_ranks
from torch import nn

from avionics import Cockpit, quantities, read_run


def raising_rank(rank, world, log, after_backward):
    """Rank 1 fails inside its block at step 2: the user's error after its backward, or a
    bad info (per-sample losses of the wrong size) that the cockpit's check finds before it."""
    model, X, y, loss_fn = models.mlp(n=6)
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, [quantities.Loss(), quantities.NormTest()], log=log)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    X, y = X[3 * rank : 3 * rank + 3], y[3 * rank : 3 * rank + 3]
    for step in range(4):
        opt.zero_grad()
        losses = loss_fn(forward(X), y)
        bad = rank == 1 and step == 2 and not after_backward
        info = {"loss": losses.mean(), "individual_losses": losses[: 2 if bad else 3]}
        info["batch_size"] = 3
        try:
            with cockpit(step, info=info):
                losses.mean().backward()
                if rank == 1 and step == 2 and after_backward:
                    raise ValueError("the user's own error")
        except (ValueError, RuntimeError) as error:
            cockpit.close()
            return type(error).__name__, str(error), sorted(cockpit.get_output())
        opt.step()
    return "finished"


@pytest.mark.parametrize("after_backward", [False, True])
def test_the_other_processes_learn_which_rank_raised_at_which_step(tmp_path, after_backward):
    log = tmp_path / "run"
    (error0, message0, steps0), (error1, message1, steps1) = on_ranks(
        raising_rank, 2, tmp_path, str(log), after_backward
    )
    if after_backward:
        assert (error1, message1) == ("ValueError", "the user's own error")
        messages = [message0]
    else:  # the same error on both, with rank 1's message
        assert error1 == "RuntimeError" and "rank 1: ValueError: info['batch_size']" in message1
        messages = [message0, message1]
    assert error0 == "RuntimeError"
    for message in messages:
        assert "Step 2, micro-batch 0: the process(es) of rank 1 raised inside" in message
        assert "handle an error on every process alike" in message
    assert steps0 == steps1 == [0, 1]  # nothing stored for step 2
    run = read_run(log)
    assert sorted(run.steps) == [0, 1] and run.problems == []
