"""The cockpit protocol and its errors (docs/cockpit.md, sections 1 and 4)."""

import gc
import pydoc
import warnings

import models
import pytest
import torch
from torch import nn

from avionics import Cockpit, configuration, quantities, schedules
from avionics.persample.capture import Capture


def global_forward_hooks() -> int:
    return len(torch.nn.modules.module._global_forward_hooks)


def state_of(model):
    """Everything a cockpit could leave behind on a model and its parameters."""
    return [
        (
            sorted(vars(m)),
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._backward_hooks),
            len(m._backward_pre_hooks),
        )
        for m in model.modules()
    ] + [(sorted(vars(p)), len(p._backward_hooks or {})) for p in model.parameters()]


def train(cockpit, model, X, y, loss_fn, steps, reduction="mean", opt=None, start=0):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, start + steps):
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {
            "loss": loss,
            "individual_losses": losses,
            "batch_size": len(losses),
            "optimizer": opt,
        }
        with cockpit(step, info=info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()


def test_nothing_is_left_on_the_model_or_its_parameters():
    model, X, y, loss_fn = models.transformer(n=3)
    before = state_of(model)
    hooks = global_forward_hooks()
    cockpit = Cockpit(model, configuration("economy"))
    for step in range(3):
        train(cockpit, model, X, y, loss_fn, 1, start=step)
        assert state_of(model) == before
    cockpit.close()
    assert global_forward_hooks() == hooks


def test_untracked_steps_have_no_hook_at_all():
    model, X, y, loss_fn = models.mlp(n=3)
    hooks = global_forward_hooks()
    cockpit = Cockpit(model, [quantities.NormTest(schedule=schedules.linear(3))])
    armed = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(7):
        armed.append(global_forward_hooks() - hooks)  # during this step's forward
        losses = loss_fn(model(X), y)
        with cockpit(
            step, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        ):
            losses.mean().backward()
        opt.step()
    assert armed == [1, 0, 0, 1, 0, 0, 1]
    assert sorted(cockpit.get_output()) == [0, 3, 6]


def test_an_unused_cockpit_removes_its_hook_when_collected():
    hooks = global_forward_hooks()
    model = models.mlp()[0]
    cockpit = Cockpit(model, [quantities.NormTest()])
    assert global_forward_hooks() == hooks + 1
    del cockpit
    import gc

    gc.collect()
    model(torch.randn(2, 6, dtype=torch.float64))
    assert global_forward_hooks() == hooks


def test_evaluation_passes_between_steps_do_not_disturb():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.NormTest()])
    losses = loss_fn(model(X), y)
    with torch.no_grad():
        model(torch.randn(7, 6, dtype=torch.float64))  # not recorded
    model(torch.randn(5, 6, dtype=torch.float64)).sum()  # recorded, never backpropagated
    with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 4}):
        losses.mean().backward()
    assert cockpit.get_output()[0]["NormTest"] > 0


@pytest.mark.parametrize("build", [models.cnn, models.transformer])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_a_step_frees_its_captured_tensors_without_the_garbage_collector(build, optimizer):
    """A reference cycle would keep a step's layer inputs and output gradients alive until the
    garbage collector happens to run: into the next step, adding to its peak memory."""
    model, X, y, loss_fn = build()
    cockpit = Cockpit(model, configuration("economy"))
    opt = optimizer(model.parameters(), lr=0.1)
    # a first step compiles the histogram kernels where numba's cache is cold (a fresh
    # checkout): the compiler's own caught exceptions leave cycles through the frames
    train(cockpit, model, X, y, loss_fn, 1, opt=opt)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable stays in gc.garbage
    try:
        train(cockpit, model, X, y, loss_fn, 3, opt=opt, start=1)
        gc.collect()
        in_cycles = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not in_cycles


def test_log_stores_metrics_under_the_step():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.Loss()])
    train(cockpit, model, X, y, loss_fn, 1)
    cockpit.log(0, valid_loss=0.5, valid_accuracy=torch.tensor(0.75), learning_rate=0.1)
    out = cockpit.get_output()[0]
    assert out["valid_loss"] == 0.5 and out["valid_accuracy"] == 0.75
    assert out["learning_rate"] == 0.1 and "Loss" in out


def test_time_and_parameters():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.Time(), quantities.Parameters()])
    before = [p.detach().clone() for p in model.parameters()]
    train(cockpit, model, X, y, loss_fn, 1)
    out = cockpit.get_output()[0]
    assert isinstance(out["Time"], float) and out["Time"] > 1.7e9
    for stored, p in zip(out["Parameters"], before):
        assert torch.equal(torch.tensor(stored, dtype=torch.float64), p)


def test_these_quantities_keep_no_graph():
    cockpit = Cockpit(models.mlp()[0], configuration("economy"))
    assert not any(cockpit.create_graph(step) for step in range(5))


def test_presets_list_the_spec_quantities():
    economy = {q.name for q in configuration("economy")}
    assert {
        "Distance",
        "GradNorm",
        "InnerTest",
        "Loss",
        "NormTest",
        "OrthoTest",
        "UpdateSize",
    } <= economy
    assert economy <= {q.name for q in configuration("business")}
    assert {q.name for q in configuration("business")} <= {q.name for q in configuration("full")}
    for q in configuration("full"):
        assert q.name not in {
            "CABS",
            "EarlyStopping",
            "MeanGSNR",
            "TICTrace",
            "Time",
            "Parameters",
        }
    with pytest.raises(ValueError, match="economy"):
        configuration("first-class")


# ---------------------------------------------------------------------------- errors
def step_once(cockpit, model, X, y, loss_fn, info_update=None, drop=()):
    losses = loss_fn(model(X), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(losses)}
    info.update(info_update or {})
    for key in drop:
        info.pop(key)
    with cockpit(0, info=info):
        info["loss"].backward()


def test_bad_construction_arguments():
    model = models.mlp()[0]
    with pytest.raises(TypeError, match="torch.nn.Module"):
        Cockpit(lambda x: x, [quantities.Loss()])
    with pytest.raises(TypeError, match="is not a quantity"):
        Cockpit(model, [quantities.Loss(), "NormTest"])
    with pytest.raises(ValueError, match="Two NormTest"):
        Cockpit(model, [quantities.NormTest(), quantities.NormTest()])
    with pytest.raises(TypeError, match="schedule"):
        quantities.NormTest(schedule=3)
    frozen = model[0].weight
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="'0.weight' does not require grad"):
        Cockpit(model, [quantities.Loss()], params=[frozen])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        Cockpit(model, [quantities.Loss()], params=[nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        Cockpit(nn.ReLU(), [quantities.Loss()])


def test_missing_info_keys_name_the_key_and_the_quantity_before_any_work():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.Loss(), quantities.NormTest()])
    with pytest.raises(KeyError, match="NormTest reads info\\['batch_size'\\]"):
        step_once(cockpit, model, X, y, loss_fn, drop=["batch_size"])
    assert model[0].weight.grad is None  # the backward never ran
    with pytest.raises(KeyError, match="info\\['loss'\\] is required"):
        step_once(cockpit, model, X, y, loss_fn, drop=["loss"])
    with pytest.raises(KeyError, match="CABS reads info\\['optimizer'\\]"):
        step_once(Cockpit(model, [quantities.CABS()]), model, X, y, loss_fn)


def test_a_loss_that_is_neither_mean_nor_sum():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.NormTest()])
    losses = loss_fn(model(X), y)
    with pytest.raises(ValueError, match="neither the mean .* nor the sum"):
        step_once(cockpit, model, X, y, loss_fn, {"loss": 2 * losses.mean()})
    with pytest.raises(ValueError, match="batch_size'\\] is 5"):
        step_once(cockpit, model, X, y, loss_fn, {"batch_size": 5})
    with pytest.raises(ValueError, match="shape \\[N\\]"):
        step_once(cockpit, model, X, y, loss_fn, {"individual_losses": losses[None]})


@pytest.mark.parametrize("name", ["CABS", "EarlyStopping"])
def test_plain_sgd_quantities_refuse_other_optimizers(name):
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [getattr(quantities, name)()])
    with pytest.raises(ValueError, match="plain SGD only.*Adam"):
        step_once(
            cockpit, model, X, y, loss_fn, {"optimizer": torch.optim.Adam(model.parameters())}
        )
    with pytest.raises(ValueError, match="momentum=0.9"):
        step_once(
            cockpit,
            model,
            X,
            y,
            loss_fn,
            {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)},
        )


def test_non_finite_loss_is_recorded_with_a_warning_and_training_goes_on():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.Loss(), quantities.NormTest()])
    X = X.clone()
    X[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="the loss is nan"):
        step_once(cockpit, model, X, y, loss_fn)
    assert cockpit.get_output()[0]["Loss"] != cockpit.get_output()[0]["Loss"]
    X[0, 0] = 0.0
    model.zero_grad()
    losses = loss_fn(model(X), y)  # the next step works normally
    with cockpit(1, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}):
        losses.mean().backward()
    assert cockpit.get_output()[1]["NormTest"] > 0


def test_a_step_whose_forward_was_not_captured_says_so():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.NormTest(schedule=schedules.linear(5))])
    step_once(cockpit, model, X, y, loss_fn)  # step 0
    losses = loss_fn(model(X), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
    with pytest.warns(UserWarning, match="number steps consecutively"):
        with cockpit(5, info=info):  # steps 1-4 skipped: step 5's forward was not captured
            losses.mean().backward()
    assert sorted(cockpit.get_output()) == [0]


def test_an_exception_inside_the_block_propagates_and_cleans_up():
    model, X, y, loss_fn = models.mlp(n=3)
    before = state_of(model)
    cockpit = Cockpit(model, [quantities.NormTest()])
    losses = loss_fn(model(X), y)
    with pytest.raises(ZeroDivisionError):
        with cockpit(
            0, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        ):
            raise ZeroDivisionError
    assert state_of(model) == before and cockpit.get_output() == {}


def test_schedules():
    assert [s for s in range(12) if schedules.linear(4)(s)] == [0, 4, 8]
    assert [s for s in range(12) if schedules.linear(4, offset=2)(s)] == [2, 6, 10]
    log = schedules.logarithmic(0, 2, steps=5)
    assert [s for s in range(101) if log(s)] == [0, 1, 3, 10, 31, 100]
    assert [s for s in range(101) if schedules.logarithmic(0, 2, steps=5, init=False)(s)] == [
        1,
        3,
        10,
        31,
        100,
    ]
    with pytest.raises(ValueError):
        schedules.linear(0)
    with pytest.raises(ValueError):
        schedules.logarithmic(3, 1)


def test_capture_records_nothing_without_gradients_enabled():
    model = models.mlp()[0]
    capture = Capture(model, list(model.modules()))
    capture.arm()
    with torch.no_grad():
        model(torch.randn(2, 6, dtype=torch.float64))
    capture.disarm()
    assert capture.calls == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 6, dtype=torch.float64))
    assert capture.calls == []


def test_the_output_prints_short_and_holds_every_value():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.Loss(), quantities.GradHist1d()])
    train(cockpit, model, X, y, loss_fn, 30)
    output = cockpit.get_output()
    full = {step: dict(values) for step, values in output.items()}
    assert output == full and len(output[29]["GradHist1d"]["hist"]) == 100
    assert len(repr(output)) < len(repr(full)) / 10 and "..." in repr(output)


def test_help_of_a_call_shows_the_protocol():
    for documented in (Cockpit.__call__, Cockpit(models.mlp()[0], [quantities.Loss()]).__call__):
        text = pydoc.render_doc(documented, renderer=pydoc.plaintext)
        assert "Call self as a function" not in text
        for part in ("micro_batch=i, micro_batches=k", 'c * info["loss"]', "GradScaler"):
            assert part in text, part


def alpha_by_definition(before, after, losses_at, per_sample_at) -> float:
    """Alpha (docs/definitions.md, section 7) from the measured update theta_after -
    theta_before: the per-sample losses and gradients (by a loop over samples) at both ends,
    the fit by its normal equations."""
    s = torch.cat([(a - b).reshape(-1) for a, b in zip(after, before, strict=True)])
    tau = float(s.norm())
    u = s / tau
    f0, f1 = losses_at[0], losses_at[1]
    d0, d1 = per_sample_at[0] @ u, per_sample_at[1] @ u
    y = torch.stack([f0.mean(), f1.mean(), d0.mean(), d1.mean()])
    var = torch.stack([f0.var(), f1.var(), d0.var(), d1.var()])
    var = torch.where(var == 0, torch.full_like(var, 1e-10), var)
    phi = torch.tensor([[1, 0, 0], [1, tau, tau**2], [0, 1, 0], [0, 1, 2 * tau]], dtype=y.dtype)
    w = torch.linalg.solve(phi.T @ (phi / var[:, None]), phi.T @ (y / var))
    return -1.0 if w[2] < 0 else float(tau / (-w[1] / (2 * w[2])) - 1)


@pytest.mark.parametrize("in_closure", [False, True], ids=["after the block", "in a closure"])
@pytest.mark.parametrize("clip", [0.05, None], ids=["clipped", "unclipped"])
def test_clipping_with_plain_sgd_gives_alpha_of_the_measured_update(in_closure, clip):
    """Also when the block and the clipping run inside ``optimizer.step(closure)``, as in
    Lightning, where the step's pre-hook has passed before the backward."""
    model, X, y, loss_fn = models.mlp(n=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cockpit = Cockpit(model, [quantities.Alpha(), quantities.GradNorm()])
    thetas, losses_at, per_sample_at, norms = [], [], [], []
    for step in range(2):
        thetas.append([p.detach().clone() for p in model.parameters()])
        per_sample_at.append(
            torch.cat([g.flatten(1) for g in models.per_sample_gradients(model, X, y, loss_fn)], 1)
        )
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        losses_at.append(losses.detach())
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 6}
        info["optimizer"] = opt

        def closure(info=info, step=step):
            with cockpit(step, info):
                info["loss"].backward()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            else:
                norms.append(float(torch.linalg.vector_norm(_flat_grad(model))))

        if in_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()
        opt.zero_grad()  # (as a validation pass between the steps would)
    output = cockpit.get_output()
    assert clip is None or norms[0] > clip  # the step was clipped
    expected = alpha_by_definition(thetas[0], thetas[1], losses_at, per_sample_at)
    assert output[0]["Alpha"] == pytest.approx(expected, rel=1e-9)
    # GradNorm is read in the block: the norm before clipping
    assert sum(v**2 for v in output[0]["GradNorm"]) ** 0.5 == pytest.approx(norms[0], rel=1e-12)


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_the_learning_rate_of_a_scheduler_is_stored_per_step():
    model, X, y, loss_fn = models.mlp(n=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    cockpit = Cockpit(model, [quantities.Loss()])
    for step in range(3):
        train(cockpit, model, X, y, loss_fn, 1, opt=opt, start=step)
        scheduler.step()
    output = cockpit.get_output()
    assert [output[s]["learning_rate"] for s in range(3)] == pytest.approx([0.1, 0.05, 0.025])
