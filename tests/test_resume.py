"""A run resumed from a checkpoint: the cockpit works on its first tracked step whatever the
schedule, and with ``state_dict`` / ``load_state_dict`` every later value equals that of an
uninterrupted run."""

from __future__ import annotations

import io

import models
import pytest
import torch
from compare import assert_same_output

from avionics import Cockpit, quantities, schedules

STEPS, STOP = 8, 4  # the interrupted run stops after step STOP and resumes at STOP + 1


def batch(step: int, n: int = 6):
    generator = torch.Generator().manual_seed(100 + step)
    X = torch.randn(n, 6, generator=generator, dtype=torch.float64)
    return X, torch.randint(0, 3, (n,), generator=generator)


def make_quantities():
    return [
        quantities.Loss(),
        quantities.Distance(),
        quantities.UpdateSize(schedule=schedules.linear(2)),
        quantities.Alpha(schedule=schedules.linear(2)),
        quantities.NormTest(),
        quantities.GradHist1d(bins=7, adapt=quantities.GradAbsMax(padding=0.1)),
        quantities.GradHist2d(
            bins=(5, 4), adapt=(quantities.GradAbsMax(), quantities.ParamAbsMax())
        ),
        quantities.HessMaxEV(tol=1e-6),
    ]


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def train(model, opt, cockpit, loss_fn, steps):
    for step in steps:
        X, y = batch(step)
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        loss = losses.mean()
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(X), "optimizer": opt}
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()


def fresh(optimizer: str, first_step=None):
    model, _, _, loss_fn = models.mlp()
    opt = OPTIMIZERS[optimizer](model.parameters())
    return model, opt, loss_fn, Cockpit(model, make_quantities(), first_step=first_step)


def saved(model, opt, cockpit) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "cockpit": cockpit.state_dict()},
        buffer,
    )
    return buffer.getvalue()


@pytest.mark.parametrize("first_step", [None, STOP + 1])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_resumed_run_equals_an_uninterrupted_one(optimizer, first_step):
    model, opt, loss_fn, cockpit = fresh(optimizer)
    train(model, opt, cockpit, loss_fn, range(STEPS))
    expected = cockpit.get_output()

    model, opt, loss_fn, cockpit = fresh(optimizer)
    train(model, opt, cockpit, loss_fn, range(STOP + 1))
    before = cockpit.get_output()
    checkpoint = torch.load(io.BytesIO(saved(model, opt, cockpit)), weights_only=False)
    cockpit.close()
    del model, opt, cockpit

    model, opt, loss_fn, cockpit = fresh(optimizer, first_step)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    cockpit.load_state_dict(checkpoint["cockpit"])
    train(model, opt, cockpit, loss_fn, range(STOP + 1, STEPS))
    after = cockpit.get_output()
    # the two-step values of the last step before the stop arrive after the resume
    assert set(after[STOP]) == {"UpdateSize", "Alpha"}
    merged = {step: {**before.get(step, {}), **after.get(step, {})} for step in expected}
    assert_same_output(merged, expected, rel=1e-12, abs=1e-14)


def test_a_cockpit_without_its_state_differs_from_the_uninterrupted_run():
    """The comparison above can fail: without load_state_dict, Distance restarts at theta_k
    and the pending starts are lost."""
    model, opt, loss_fn, cockpit = fresh("sgd")
    train(model, opt, cockpit, loss_fn, range(STEPS))
    expected = cockpit.get_output()
    model, opt, loss_fn, cockpit = fresh("sgd")
    train(model, opt, cockpit, loss_fn, range(STOP + 1))
    cockpit = Cockpit(model, make_quantities())
    train(model, opt, cockpit, loss_fn, range(STOP + 1, STEPS))
    after = cockpit.get_output()
    assert STOP not in after
    assert after[STEPS - 1]["Distance"] != pytest.approx(expected[STEPS - 1]["Distance"])


@pytest.mark.parametrize("first_step", [None, 10])
def test_the_first_tracked_step_of_a_resumed_loop_is_captured(first_step):
    """A loop starting at step 10 with a histogram on linear(7, offset=3): step 10 is its
    first tracked step."""
    model, X, y, loss_fn = models.mlp(n=4)
    histogram = quantities.GradHist1d(schedule=schedules.linear(7, offset=3))
    cockpit = Cockpit(model, [histogram, quantities.Loss()], first_step=first_step)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10, 18):
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses,
                                 "batch_size": 4}):  # fmt: skip
            losses.mean().backward()
        opt.step()
    output = cockpit.get_output()
    assert [s for s in output if "GradHist1d" in output[s]] == [10, 17]
    total = sum(p.numel() for p in model.parameters()) * 4
    assert sum(output[10]["GradHist1d"]["hist"]) == total


def test_load_state_dict_refuses_other_quantities_before_changing_anything():
    model, opt, loss_fn, cockpit = fresh("sgd")
    train(model, opt, cockpit, loss_fn, range(2))
    state = cockpit.state_dict()
    other = Cockpit(model, [quantities.Distance()])
    with pytest.raises(ValueError, match="same quantities"):
        other.load_state_dict(state)
    assert other.quantities[0].initial is None
    with pytest.raises(ValueError, match="Cockpit.state_dict"):
        other.load_state_dict({"Distance": {}})
