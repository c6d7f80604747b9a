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


def logged_cockpit(tmp_path, n, two_step):
    """An MLP of n samples, its SGD, and a logged cockpit of Loss, NormTest and ``two_step``
    at every step."""
    model, X, y, loss_fn = models.mlp(n=n)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    every = schedules.linear(1)
    used = [quantities.Loss(), quantities.NormTest(every), two_step(every)]
    return model, X, y, loss_fn, opt, Cockpit(model, used, log=tmp_path / "run")


# ------------------------------------------------------------------ item 2
def test_a_step_with_fewer_micro_batches_than_declared_is_skipped_with_a_warning(tmp_path):
    model, X, y, loss_fn, opt, cockpit = logged_cockpit(tmp_path, 6, quantities.Alpha)
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


# ------------------------------------------------------------------ item 3
def trained_state(model_fn, steps=2):
    model, X, y, loss_fn = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [quantities.Distance(), quantities.Alpha(), quantities.NormTest()])
    for step in range(steps):
        micro_step(cockpit, model, X, y, loss_fn, step, 1, 1, opt)
    cockpit.close()
    return cockpit.state_dict()


def wider_mlp():
    model, X, y, loss_fn = models.mlp(n=4)
    model[0] = torch.nn.Linear(6, 5).double()
    model[2] = torch.nn.Linear(5, 4, bias=False).double()
    return model, X, y, loss_fn


def corrupt_pending(state):
    state["quantities"]["Alpha"] = {"pending": {}}
    return state


def wrong_shape(state):
    theta = state["quantities"]["Distance"]["initial"]
    theta[0] = theta[0][:, :2]
    return state


BAD_STATES = {
    "another model": (lambda s: trained_state(wider_mlp), r"other parameters: not saved: 2\.bias"),
    "a tensor of the wrong shape": (wrong_shape, r"Distance\['initial'\] holds a tensor of shape"),
    "a corrupt pending start": (corrupt_pending, r"state of Alpha is corrupt \(KeyError"),
    "another version": (lambda s: {**s, "version": 7}, "of version 7"),
    "no quantities": (lambda s: {**s, "quantities": [1]}, "no dict of quantity states"),
}


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_a_state_of_another_model_or_corrupt_is_refused_before_any_change(case):
    make, match = BAD_STATES[case]
    state = make(trained_state(lambda: models.mlp(n=4)))
    model, X, y, loss_fn = models.mlp(n=4, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cockpit = Cockpit(model, [quantities.Distance(), quantities.Alpha(), quantities.NormTest()])
    micro_step(cockpit, model, X, y, loss_fn, 0, 1, 1, opt)
    before = cockpit.state_dict()
    with pytest.raises(ValueError, match=match) as refused:
        cockpit.load_state_dict(state)
    assert "Cockpit.state_dict()" in str(refused.value) or "same quantities" in str(refused.value)
    after = cockpit.state_dict()
    assert torch.equal(
        after["quantities"]["Distance"]["initial"][0],
        before["quantities"]["Distance"]["initial"][0],
    )
    assert after["quantities"]["Alpha"].keys() == before["quantities"]["Alpha"].keys()
    micro_step(cockpit, model, X, y, loss_fn, 1, 1, 1, opt)  # the run goes on
    assert {"Distance", "Alpha"} <= set(cockpit.get_output()[0])
    cockpit.close()
    assert hooks(model, opt) == 0


# ------------------------------------------------------------------ item 4
def replace_a_module(model):
    model[2] = torch.nn.Linear(5, 4).double()
    return r"'2\.weight' is another tensor \(its module was replaced\)"


def freeze_a_parameter(model):
    model[2].weight.requires_grad_(False)
    return r"'2\.weight' no longer requires grad \(frozen\)"


def add_a_module(model):
    model.append(torch.nn.Linear(3, 3).double())
    return r"'5\.weight' is a new parameter that requires grad"


@pytest.mark.parametrize("change", [replace_a_module, freeze_a_parameter, add_a_module])
def test_a_model_changed_between_steps_is_refused_with_what_changed(tmp_path, change):
    model, X, y, loss_fn, opt, cockpit = logged_cockpit(tmp_path, 4, quantities.UpdateSize)
    micro_step(cockpit, model, X, y, loss_fn, 0, 1, 1, opt)
    match = change(model)
    for step in (1, 2):  # refused on entering, at every step, before its block
        losses = loss_fn(model(X), y)
        with pytest.raises(ValueError, match=match) as refused:
            with cockpit(step, info_of(losses, optimizer=opt)):
                pytest.fail("the block must not run")
        assert "build a new Cockpit on the model as it is now" in str(refused.value)
    assert all(p.grad is None for p in model.parameters())
    assert sorted(cockpit.get_output()) == [0]
    cockpit.close()
    assert sorted(read_run(tmp_path / "run").steps) == [0]
    assert hooks(model, opt) == 0


# ------------------------------------------------------------------ item 8
def test_a_complex_parameter_is_refused_at_construction_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"Parameter '0\.weight' is complex.*torch\.view_as_real"):
        Cockpit(model, [quantities.GradNorm()])
    assert len(torch.nn.modules.module._global_forward_hooks) == 0


# ------------------------------------------------------------------ item 5
def test_a_log_folder_deleted_while_training_is_recreated_with_a_warning(tmp_path):
    import shutil

    model, X, y, loss_fn = models.mlp(n=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    cockpit = Cockpit(
        model, [quantities.Loss(), quantities.NormTest(schedules.linear(1))], log=run
    )
    micro_step(cockpit, model, X, y, loss_fn, 0, 1, 1, opt)
    shutil.rmtree(run)
    with pytest.warns(UserWarning, match=r"was deleted while the run wrote it.*recreated it"):
        micro_step(cockpit, model, X, y, loss_fn, 1, 1, 1, opt)
    micro_step(cockpit, model, X, y, loss_fn, 2, 1, 1, opt)
    cockpit.close()
    recreated = read_run(run)
    assert sorted(recreated.steps) == [1, 2]
    assert recreated.steps[2] == pytest.approx(cockpit.get_output()[2])
    assert recreated.metadata["model"] == "Sequential"
    assert recreated.metadata["optimizer"]["name"] == "SGD"  # learnt at step 0, written again
