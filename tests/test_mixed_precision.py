"""Scaled backwards, torch.amp.GradScaler and autocast (docs/definitions.md, section 2).

The backward may be of any positive multiple c * info["loss"]; the cockpit measures c and
every value is of the gradient of info["loss"] itself. Under autocast every statistic is
computed in float32 or better; a step the GradScaler skips stores its Loss only.
"""

import copy
import math
import warnings

import models
import pytest
import torch
from compare import assert_same_output

from avionics import Cockpit, configuration, quantities

# Under autocast the captured layer inputs and output gradients are rounded to 16 bits
# (bfloat16: 8 significant bits, relative 2^-8 ~ 4e-3 per product): the statistics of a
# one-step float32 reference agree to this relative tolerance.
AUTOCAST_RTOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


def full_without_2d_histogram():
    return [q for q in configuration("full") if q.name != "GradHist2d"]


def train(
    model, X, y, loss_fn, make_quantities, steps=2, backward=None, update=None, autocast=None
):
    """SGD steps watched by a cockpit: ``backward(loss, cockpit, step)`` in the block
    (default: loss.backward()), then ``update(opt, step)`` (default: opt.step()). The
    output and the warnings."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, make_quantities())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                losses = loss_fn(model(X), y)
            loss = losses.mean()
            info = {"loss": loss, "individual_losses": losses, "batch_size": len(X)}
            info["optimizer"] = opt
            with cockpit(step, info):
                if backward is None:
                    loss.backward(create_graph=cockpit.create_graph(step))
                else:
                    backward(loss, cockpit, step)
            if update is None:
                opt.step()
            else:
                update(opt, step)
    for p in model.parameters():
        p.grad = None  # (create_graph's reference cycle)
    return cockpit.get_output(), [str(w.message) for w in caught]


def scaled_by(scaler):
    def backward(loss, cockpit, step):
        scaler.scale(loss).backward(create_graph=cockpit.create_graph(step))

    return backward


def stepped_by(scaler):
    def update(opt, step):
        scaler.step(opt)
        scaler.update()

    return update


def test_a_grad_scaler_gives_the_values_of_the_unscaled_loss():
    model, X, y, loss_fn = models.mlp(n=6)
    expected, _ = train(model, X, y, loss_fn, full_without_2d_histogram, steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ours, _ = train(
        model, X, y, loss_fn, full_without_2d_histogram, 2, scaled_by(scaler), stepped_by(scaler)
    )
    assert {"GradNorm", "NormTest", "HessTrace", "HessMaxEV", "TICDiag"} <= set(ours[0])
    assert_same_output(ours, expected, rel=1e-12)


def test_any_positive_multiple_of_the_loss_is_measured_and_divided_out():
    model, X, y, loss_fn = models.cnn(n=4)

    def make():
        return configuration("economy")

    def thrice(loss, cockpit, step):
        (3 * loss).backward()

    def update(opt, step):
        for p in opt.param_groups[0]["params"]:
            p.grad /= 3  # the update of the loss itself
        opt.step()

    expected, _ = train(model, X, y, loss_fn, make)
    ours, _ = train(model, X, y, loss_fn, make, backward=thrice, update=update)
    assert_same_output(ours, expected, rel=1e-12)


def test_a_negative_multiple_of_the_loss_is_refused_and_stores_nothing():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.GradNorm()])
    losses = loss_fn(model(X), y)
    loss = losses.mean()
    info = {"loss": loss, "individual_losses": losses, "batch_size": 4}
    with pytest.raises(ValueError, match=r"-1 \* info\['loss'\]: backpropagate a positive"):
        with cockpit(0, info):
            (-loss).backward()
    assert cockpit.get_output() == {}


def test_a_step_the_scaler_skips_is_recorded_as_skipped():
    model, X, y, loss_fn = models.mlp(n=6)
    model, X = model.float(), X.float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, backoff_factor=2.0**-100)
    names = ("Loss", "GradNorm", "NormTest", "UpdateSize", "Alpha")
    cockpit = Cockpit(model, [getattr(quantities, name)() for name in names])
    expected_norms = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            opt.zero_grad()
            if step == 1:  # the scaled gradients of a large loss overflow
                scaler.update(2.0**127)
            losses = loss_fn(model(X), y) * (100 if step == 1 else 1)
            loss = losses.mean()
            grads = torch.autograd.grad(loss, cockpit.params, retain_graph=True)
            expected_norms[step] = [float(g.norm()) for g in grads]
            info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
            with cockpit(step, info):
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 2.0**27  # step 1 was skipped, once
    skipped = [str(w.message) for w in caught if "Step 1: its gradients are" in str(w.message)]
    assert len(skipped) == 1 and "GradScaler skips" in skipped[0]
    output = cockpit.get_output()
    assert set(output[1]) == {"Loss", "learning_rate"}
    assert math.isfinite(output[1]["Loss"])
    assert set(output[0]) == {"Loss", "GradNorm", "NormTest", "learning_rate"}  # ends lost
    assert {"UpdateSize", "Alpha"} <= set(output[2])
    for step in (0, 2):
        assert output[step]["GradNorm"] == pytest.approx(expected_norms[step], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_values_are_close_to_float32(dtype):
    model, X, y, loss_fn = models.mlp(n=8)
    model, X = model.float(), X.float()

    def make():
        return [q for q in full_without_2d_histogram() if q.name != "GradHist1d"]

    expected, _ = train(model, X, y, loss_fn, make, steps=1)
    backward = update = None
    if dtype == torch.float16:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        backward, update = scaled_by(scaler), stepped_by(scaler)
    ours, caught = train(model, X, y, loss_fn, make, 1, backward, update, autocast=dtype)
    assert not [m for m in caught if "do not sum to the batch gradient" in m]
    assert {"NormTest", "HessTrace", "HessMaxEV", "TICDiag"} <= set(ours[0])
    assert_same_output(ours, expected, rel=AUTOCAST_RTOL[dtype])


def test_the_ggn_diagonal_under_autocast_is_close_to_float32():
    model, X, y, loss_fn = models.mlp(n=8)
    model, X = model.float(), X.float()

    def make():
        return [quantities.HessTrace(curvature="diag_ggn_exact")]

    expected, _ = train(model, X, y, loss_fn, make, steps=1)
    ours, _ = train(model, X, y, loss_fn, make, steps=1, autocast=torch.bfloat16)
    assert_same_output(ours, expected, rel=AUTOCAST_RTOL[torch.bfloat16])
