"""Under DDP, an exception inside the block on one rank (issue 28, item 6): every other
process learns which rank raised at which step, with nothing stored for that step, instead of
gloo's collective mismatch."""

from __future__ import annotations

import models
import pytest
import torch
from spawned import on_ranks
from torch import nn

from avionics import Cockpit, quantities, read_run


def raising_rank(rank, world, log, after_backward):
    """Rank 1 raises inside its block at step 2 (before or after its backward)."""
    model, X, y, loss_fn = models.mlp(n=6)
    forward = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(forward, [quantities.Loss(), quantities.NormTest()], log=log)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    X, y = X[3 * rank : 3 * rank + 3], y[3 * rank : 3 * rank + 3]
    for step in range(4):
        opt.zero_grad()
        losses = loss_fn(forward(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        try:
            with cockpit(step, info=info):
                if rank == 1 and step == 2 and not after_backward:
                    raise ValueError("the user's own error")
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
    assert (error1, message1) == ("ValueError", "the user's own error")
    assert error0 == "RuntimeError"
    assert "Step 2, micro-batch 0: the process(es) of rank 1 raised inside" in message0
    assert "handle an error on every process alike" in message0
    assert steps0 == steps1 == [0, 1]  # nothing stored for step 2
    run = read_run(log)
    assert sorted(run.steps) == [0, 1] and run.problems == []
