"""The training survives the cockpit: bad input raises on entering a step with nothing stored,
an exception inside the block leaves the cockpit working, and silent misuse is refused or
warned of (docs/cockpit.md, section 4)."""

from __future__ import annotations

import warnings

import models
import pytest
import torch
from reference import gradient_quantities
from torch import nn
from torch.nn import functional as F

import avionics.cockpit as cockpit_module
from avionics import Cockpit, configuration, quantities, read_run, schedules


def info_of(losses, **extra):
    return {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(losses), **extra}


def tracked_step(cockpit, model, X, y, loss_fn, step, opt=None, **extra):
    losses = loss_fn(model(X), y)
    with cockpit(step, info=info_of(losses, **extra)):
        losses.mean().backward(create_graph=cockpit.create_graph(step))
    if opt is not None:
        opt.step()
        opt.zero_grad()


def norm_test(model, X, y, loss_fn):
    return gradient_quantities(model, X, y, loss_fn)["NormTest"]


# ------------------------------------------------------------------ the training survives
@pytest.mark.parametrize("fault", ["user error", "KeyboardInterrupt", "detached loss"])
def test_an_exception_inside_the_block_leaves_the_cockpit_working(fault):
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.Loss()])
    losses = loss_fn(model(X), y)
    error = {"user error": ValueError, "KeyboardInterrupt": KeyboardInterrupt}.get(
        fault, RuntimeError
    )
    with pytest.raises(error):
        with cockpit(0, info=info_of(losses)):
            if fault == "detached loss":
                losses.mean().detach().backward()
            raise error("inside the user's block")
    assert cockpit.get_output() == {}
    model.zero_grad()
    for step in (0, 1):  # the interrupted step may be retried, and the next one runs
        tracked_step(cockpit, model, X, y, loss_fn, step)
        model.zero_grad()
    expected = norm_test(model, X, y, loss_fn)
    assert sorted(cockpit.get_output()) == [0, 1]
    assert cockpit.get_output()[1]["NormTest"] == pytest.approx(expected, rel=1e-10)


def test_a_forward_before_the_cockpit_existed_skips_only_the_per_sample_quantities():
    model, X, y, loss_fn = models.mlp(n=4)
    losses = loss_fn(model(X), y)  # before the cockpit armed its capture
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.GradNorm()])
    with pytest.warns(UserWarning, match="Step 0: .*captured no forward.*NormTest"):
        with cockpit(0, info=info_of(losses)):
            losses.mean().backward()
    assert set(cockpit.get_output()[0]) == {"GradNorm"}
    model.zero_grad()
    tracked_step(cockpit, model, X, y, loss_fn, 1)
    assert cockpit.get_output()[1]["NormTest"] == pytest.approx(
        norm_test(model, X, y, loss_fn), rel=1e-10
    )


def test_a_loss_from_another_model_is_warned_of():
    model, X, y, loss_fn = models.mlp(n=4)
    other, *_ = models.mlp(n=4, seed=1)
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.Loss()])
    model(X)  # the cockpit's model runs, but the loss comes from another one
    losses = loss_fn(other(X), y)
    with pytest.warns(UserWarning, match="captured no forward.*NormTest"):
        with cockpit(0, info=info_of(losses)):
            losses.mean().backward()
    assert set(cockpit.get_output()[0]) == {"Loss"}


def test_a_step_after_close_says_the_cockpit_is_closed():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.Loss()])
    cockpit.close()
    with pytest.raises(RuntimeError, match="closed"):
        tracked_step(cockpit, model, X, y, loss_fn, 0)
    with pytest.raises(RuntimeError, match="closed"):
        cockpit.log(0, accuracy=1.0)


def test_non_finite_values_are_recorded_with_a_warning_naming_quantity_and_step():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.GradNorm(), quantities.Loss()])
    losses = loss_fn(models.NanGradient.apply(model(X)), y)
    with pytest.warns(UserWarning, match="Step 0: GradNorm is NaN or infinite"):
        with cockpit(0, info=info_of(losses)):
            losses.mean().backward()
    out = cockpit.get_output()[0]
    assert all(v != v for v in out["GradNorm"]) and out["Loss"] == out["Loss"]


# ------------------------------------------------------------------ checked on entering
def entering_raises(cockpit, model, X, y, loss_fn, error, match, step=0, **info_update):
    """Enter step ``step`` with a bad ``info``: it raises before the block runs, and nothing
    is stored, logged or left on the model."""
    losses = loss_fn(model(X), y)
    info = info_of(losses)
    info.update(info_update)
    ran = []
    with pytest.raises(error, match=match):
        with cockpit(step, info=info):
            ran.append(True)
    assert ran == [] and all(p.grad is None for p in model.parameters())


def run_with_log(tmp_path, model, quantity_list):
    return Cockpit(model, quantity_list, log=tmp_path / "run")


def step_records(tmp_path):
    return read_run(tmp_path / "run").steps


@pytest.mark.parametrize(
    "update, error, match",
    [
        ({"optimizer": "sgd"}, TypeError, r"info\['optimizer'\] must be .*step\(\) method.*str"),
        ({"batch_size": "4"}, TypeError, r"info\['batch_size'\] must be .*'4' \(str\)"),
        ({"batch_size": 0}, TypeError, r"info\['batch_size'\] must be .*positive"),
    ],
)
def test_bad_info_raises_on_entering_with_nothing_stored(tmp_path, update, error, match):
    model, X, y, loss_fn = models.mlp(n=4)
    used = [quantities.Loss(), quantities.NormTest(), quantities.Distance()]
    cockpit = run_with_log(tmp_path, model, used)
    entering_raises(cockpit, model, X, y, loss_fn, error, match, **update)
    assert cockpit.get_output() == {} and step_records(tmp_path) == {}


def test_per_sample_losses_of_another_dtype_are_refused_by_name():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.NormTest()])
    losses = loss_fn(model(X), y)
    with pytest.raises(TypeError, match=r"individual_losses'\] is torch.float32"):
        with cockpit(
            0, info={"loss": losses.mean(), "individual_losses": losses.float(), "batch_size": 4}
        ):
            pass


@pytest.mark.parametrize("step", [1.0, "3", None, True, -1])
def test_a_step_that_is_not_a_non_negative_int_is_refused(tmp_path, step):
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = run_with_log(tmp_path, model, [quantities.Loss()])
    entering_raises(cockpit, model, X, y, loss_fn, TypeError, "non-negative int", step=step)
    with pytest.raises(TypeError, match="non-negative int"):
        cockpit.log(step, accuracy=0.5)
    assert cockpit.get_output() == {} and step_records(tmp_path) == {}


def test_repeated_or_decreasing_steps_are_refused_and_keep_the_values():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.Loss(), quantities.NormTest()])
    for step in (0, 1):
        tracked_step(cockpit, model, X, y, loss_fn, step)
        model.zero_grad()
    before = cockpit.get_output()
    entering_raises(cockpit, model, X, y, loss_fn, ValueError, "already tracked.*accumulation", 1)
    entering_raises(cockpit, model, X, y, loss_fn, ValueError, "Step 0 comes after step 1", 0)
    assert cockpit.get_output() == before


def test_a_detached_or_foreign_per_sample_loss_for_curvature_is_refused_on_entering():
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [quantities.HessTrace(curvature="diag_ggn_exact")])
    losses = loss_fn(model(X), y)
    with pytest.raises(ValueError, match="HessTrace backpropagate.*no graph"):
        with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses.detach()}):
            pytest.fail("the block must not run")
    second = loss_fn(model(X), y)  # a second forward: the capture keeps the last one
    with pytest.raises(ValueError, match="do not come from one forward pass"):
        with cockpit(0, info={"loss": second.mean(), "individual_losses": losses}):
            pytest.fail("the block must not run")
    assert cockpit.get_output() == {}
    model.zero_grad()
    tracked_step(cockpit, model, X, y, loss_fn, 0)  # and the cockpit still works
    assert "HessTrace" in cockpit.get_output()[0]


def test_a_backward_without_create_graph_for_curvature_stores_nothing(tmp_path):
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = run_with_log(tmp_path, model, configuration("full"))
    losses = loss_fn(model(X), y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="create_graph=cockpit.create_graph"):
        with cockpit(0, info=info_of(losses, optimizer=opt)):
            losses.mean().backward()
    assert cockpit.get_output() == {} and step_records(tmp_path) == {}


def test_bad_construction_is_named():
    model, *_ = models.mlp(n=4)
    with pytest.raises(TypeError, match=r"single NormTest: pass \[NormTest\(\)\]"):
        Cockpit(model, quantities.NormTest())
    p = next(model.parameters())
    with pytest.raises(ValueError, match=r"params\[1\] is params\[0\] again \('0.weight'\)"):
        Cockpit(model, [quantities.Loss()], params=[p, p])


def test_the_log_options_reach_the_writer(tmp_path):
    model, *_ = models.mlp(n=4)
    Cockpit(model, [quantities.Loss()], log=tmp_path / "run").close()
    with pytest.raises(FileExistsError, match="already holds a run"):
        Cockpit(model, [quantities.Loss()], log=tmp_path / "run", exist="error")
    with pytest.raises(ValueError, match="exist must be one of"):
        Cockpit(model, [quantities.Loss()], log=tmp_path / "other", exist="overwrite")
    Cockpit(model, [quantities.Loss()], log=tmp_path / "synced", fsync=True).close()
    assert read_run(tmp_path / "synced").metadata["model"] == "Sequential"


# ------------------------------------------------------------------ silent results, now said
class Centre(nn.Module):
    """A custom layer that couples the samples: h - mean over the batch, scaled."""

    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, h):
        return (h - h.mean(0)) * self.scale


def test_a_layer_that_couples_samples_is_warned_of():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Centre(4), nn.Tanh(), nn.Linear(4, 2)).double()
    X, y = torch.randn(6, 3).double(), torch.randint(0, 2, (6,))
    cockpit = Cockpit(model, [quantities.NormTest()])
    with pytest.warns(UserWarning, match="1.scale do not sum to the batch gradient.*couples"):
        tracked_step(cockpit, model, X, y, lambda o, t: F.cross_entropy(o, t, reduction="none"), 0)


def test_batchnorm_in_train_mode_is_warned_of_once_per_cockpit_and_module():
    def bn_model(affine):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=affine), nn.Linear(4, 2))

    X, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    loss_fn = lambda o, t: F.cross_entropy(o, t, reduction="none")  # noqa: E731
    for affine in (True, False):
        for _ in range(2):  # a second cockpit (a second model) warns again
            model = bn_model(affine)
            cockpit = Cockpit(model, [quantities.NormTest()])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(3):
                    tracked_step(cockpit, model, X, y, loss_fn, step)
            said = [w for w in caught if "Module '1' (BatchNorm1d)" in str(w.message)]
            assert len(said) == 1


def test_no_global_hook_entry_is_left_per_tracked_step():
    model, X, y, loss_fn = models.mlp(n=3)
    table = torch.nn.modules.module._global_forward_hooks_with_kwargs
    before = len(table)
    cockpit = Cockpit(model, [quantities.NormTest()])
    for step in range(30):
        tracked_step(cockpit, model, X, y, loss_fn, step)
        model.zero_grad()
    cockpit.close()
    assert len(table) == before


def test_with_a_log_the_memory_keeps_a_bounded_window(tmp_path, monkeypatch):
    monkeypatch.setattr(cockpit_module, "OUTPUT_WINDOW", 4)
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = run_with_log(tmp_path, model, [quantities.Loss(), quantities.UpdateSize()])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        tracked_step(cockpit, model, X, y, loss_fn, step, opt=opt)
    cockpit.close()
    assert sorted(cockpit.get_output()) == [6, 7, 8, 9]
    run = read_run(tmp_path / "run")
    assert sorted(run.steps) == list(range(10)) and "UpdateSize" in run.steps[0]


def test_a_refused_log_call_changes_nothing(tmp_path):
    model, *_ = models.mlp(n=3)
    cockpit = run_with_log(tmp_path, model, [quantities.Loss()])
    with pytest.raises(TypeError):
        cockpit.log(2, weights=object())  # not a value a log can hold
    assert cockpit.get_output() == {} and step_records(tmp_path) == {}
    cockpit.log(2, accuracy=0.5)
    assert cockpit.get_output() == {2: {"accuracy": 0.5}}


def test_a_run_starting_late_without_its_state_says_what_starts_afresh():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.Distance(), quantities.Loss()], first_step=7)
    with pytest.warns(UserWarning, match="first tracked step is 7.*Distance measures from step 7"):
        tracked_step(cockpit, model, X, y, loss_fn, 7)
    resumed = Cockpit(model, [quantities.Distance(), quantities.Loss()], first_step=7)
    resumed.load_state_dict(cockpit.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracked_step(resumed, model, X, y, loss_fn, 8)


def test_untracked_schedules_keep_the_arming_after_an_interruption():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.NormTest(schedule=schedules.linear(2))])
    losses = loss_fn(model(X), y)
    with pytest.raises(ValueError):
        with cockpit(0, info=info_of(losses)):
            raise ValueError
    for step in (1, 2):  # step 1 untracked; step 2's forward must be captured
        tracked_step(cockpit, model, X, y, loss_fn, step)
        model.zero_grad()
    assert sorted(cockpit.get_output()) == [2]


def test_a_state_one_quantity_refuses_leaves_every_quantity_as_it_was():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(model, [quantities.Distance(), quantities.GradientNoiseScale()])
    tracked_step(cockpit, model, X, y, loss_fn, 0)
    state = cockpit.state_dict()
    fresh = Cockpit(model, [quantities.Distance(), quantities.GradientNoiseScale()])
    state["quantities"]["GradientNoiseScale"] = {"signal_average": "bad"}
    with pytest.raises((TypeError, ValueError)):
        fresh.load_state_dict(state)
    assert fresh.quantities[0].initial is None  # Distance was not restored either


class EncoderClassifier(nn.Module):
    """nn.TransformerEncoderLayer (scaled_dot_product_attention inside) and a head."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def test_curvature_instruments_run_on_standard_attention_and_restore_its_kernels():
    from test_fault_injection import dense_hessian

    from avionics.curvature._data import MathAttention

    torch.manual_seed(0)
    model = EncoderClassifier().double()
    X, y = torch.randn(4, 5, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss_fn = lambda o, t: F.cross_entropy(o, t, reduction="none")  # noqa: E731
    flags = torch.backends.cuda.flash_sdp_enabled(), torch.backends.mha.get_fastpath_enabled()
    cockpit = Cockpit(model, [quantities.HessMaxEV(tol=1e-8)])
    tracked_step(cockpit, model, X, y, loss_fn, 0)
    cockpit.close()
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with MathAttention():  # the reference's double backward needs it too
        top = float(torch.linalg.eigvalsh(dense_hessian(model, X, y, loss_fn, theta))[-1])
    assert cockpit.get_output()[0]["HessMaxEV"] == pytest.approx(top, rel=1e-6)
    assert (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.mha.get_fastpath_enabled(),
    ) == flags


def test_python_dash_m_avionics_is_the_command_line():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "avionics", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "usage: avionics" in result.stdout
