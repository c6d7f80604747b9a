"""The faults of the reliability audit's third round (issue 28): each is followed, or refused
once with its cause and remedy, with nothing stored, logged or left on the model or optimizer."""

from __future__ import annotations

import models
import pytest
import torch
from reference import gradient_quantities

from avionics import Cockpit, quantities, read_run, schedules


def info_of(losses, **extra):
    return {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(losses), **extra}


def micro_step(cockpit, model, X, y, loss_fn, step, parts, k, opt):
    """Step ``step`` over ``parts`` micro-batches of X declared as ``k``, then the update."""
    for i, (Xi, yi) in enumerate(zip(X.chunk(parts), y.chunk(parts))):
        losses = loss_fn(model(Xi), yi)
        with cockpit(step, info_of(losses, optimizer=opt), micro_batch=i, micro_batches=k):
            (losses.mean() / parts).backward()
    opt.step()
    opt.zero_grad()


def hooks(model, opt) -> int:
    count = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    for p in model.parameters():
        count += len(p._backward_hooks or {})
    return count + len(torch.nn.modules.module._global_forward_hooks)


# ------------------------------------------------------------------ item 2
def test_a_step_with_fewer_micro_batches_than_declared_is_skipped_with_a_warning(tmp_path):
    model, X, y, loss_fn = models.mlp(n=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    every = schedules.linear(1)
    used = [quantities.Loss(), quantities.NormTest(every), quantities.Alpha(every)]
    cockpit = Cockpit(model, used, log=tmp_path / "run")
    micro_step(cockpit, model, X, y, loss_fn, 0, 3, 3, opt)
    micro_step(cockpit, model, X[:4], y[:4], loss_fn, 1, 2, 3, opt)  # 2 of 3 micro-batches
    expected = gradient_quantities(model, X, y, loss_fn)
    with pytest.warns(UserWarning, match=r"Step 1 had the micro-batches 0, \.\.\., 1 of the 3"):
        micro_step(cockpit, model, X, y, loss_fn, 2, 3, 3, opt)
    output = cockpit.get_output()
    assert sorted(output) == [0, 2]
    assert "Alpha" not in output[0]  # its end, step 1, was skipped
    assert output[2]["NormTest"] == pytest.approx(expected["NormTest"], rel=1e-10)
    cockpit.close()
    assert sorted(read_run(tmp_path / "run").steps) == [0, 2]
    assert hooks(model, opt) == 0
