"""The cockpit's invariant under random misuse: each step either raises on entering and changes
nothing, or stores the values its definitions give (docs/cockpit.md, section 4)."""

from __future__ import annotations

import warnings

import models
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reference import gradient_quantities

from avionics import Cockpit, quantities, read_run, schedules


def good_info(losses, opt):
    return {
        "loss": losses.mean(),
        "individual_losses": losses,
        "batch_size": len(losses),
        "optimizer": opt,
    }


# Each turns a good info into a bad one (the cockpit must refuse it on entering).
BAD_INFO = {
    "not a dict": lambda info: list(info.items()),
    "no loss": lambda info: {k: v for k, v in info.items() if k != "loss"},
    "no per-sample losses": lambda info: {
        k: v for k, v in info.items() if k != "individual_losses"
    },
    "loss a float": lambda info: {**info, "loss": float(info["loss"])},
    "loss a vector": lambda info: {**info, "loss": info["individual_losses"]},
    "losses 2-d": lambda info: {**info, "individual_losses": info["individual_losses"][None]},
    "losses of another dtype": lambda info: {
        **info,
        "individual_losses": info["individual_losses"].float(),
    },
    "batch size a string": lambda info: {**info, "batch_size": str(info["batch_size"])},
    "batch size wrong": lambda info: {**info, "batch_size": info["batch_size"] + 1},
    "batch size zero": lambda info: {**info, "batch_size": 0},
    "optimizer a string": lambda info: {**info, "optimizer": "SGD"},
    "loss neither mean nor sum": lambda info: {**info, "loss": info["loss"] * 3},
}

steps_strategy = st.lists(
    st.tuples(
        st.sampled_from([1, 1, 1, 2, 0, -1, -7]),  # the step's distance from the last one
        st.sampled_from([None] * 6 + sorted(BAD_INFO)),  # the info's defect
        st.booleans(),  # whether the user's block raises
    ),
    min_size=1,
    max_size=7,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(actions=steps_strategy)
def test_a_step_raises_before_any_change_or_stores_correct_values(tmp_path_factory, actions):
    model, X, y, loss_fn = models.mlp(n=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path_factory.mktemp("run")
    used = [quantities.Loss(), quantities.NormTest(), quantities.InnerTest(), quantities.Alpha()]
    cockpit = Cockpit(model, used, log=log)
    last, stored = None, {}
    for delta, defect, user_raises in actions:
        step = 0 if last is None and delta > 0 else (last or 0) + delta
        losses = loss_fn(model(X), y)
        info = good_info(losses, opt)
        if defect is not None:
            info = BAD_INFO[defect](info)
        expected = gradient_quantities(model, X, y, loss_fn)
        before = (
            cockpit.get_output(),
            read_run(log).steps,
            [p.clone() for p in model.parameters()],
        )
        valid_step = step >= 0 and (last is None or step > last)
        ran = []
        try:
            with cockpit(step, info=info):
                ran.append(True)
                info["loss"].backward()
                if user_raises:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            assert ran and user_raises
        except (TypeError, ValueError, KeyError):
            assert not ran, "a refused step must raise on entering, before the block"
            assert defect is not None or not valid_step
        else:
            assert defect is None and valid_step and not user_raises
        after = (cockpit.get_output(), read_run(log).steps)
        if not ran or user_raises:  # nothing changed
            assert after == before[:2]
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[2]))
        else:
            values = after[0][step]
            assert values["Loss"] == pytest.approx(float(losses.mean()), rel=1e-12)
            for name in ("NormTest", "InnerTest"):
                assert values[name] == pytest.approx(expected[name], rel=1e-9)
            stored[step] = values
            last = step
            opt.step()
        opt.zero_grad()
        if not ran and defect is None and valid_step:
            raise AssertionError("a valid step was refused")
    cockpit.close()
    run = read_run(log)
    for step, values in stored.items():
        assert run.steps[step]["NormTest"] == pytest.approx(values["NormTest"], rel=1e-12)


# The faults of a step (issue 28, item 1): gradients not finite after an unscaled backward
# (values computed, the optimizer step skipped by the user), after a scaled one (the cockpit
# skips the values, as GradScaler skips the step), and an exception inside the block.
FAULTS = ["none", "nan", "nan scaled", "raises"]


def faulty_step(cockpit, model, X, y, loss_fn, opt, step, fault, k):
    """One optimizer step of ``k`` micro-batches with ``fault``; the optimizer steps unless
    the gradients are not finite. Returns whether the block raised."""
    for i, (Xi, yi) in enumerate(zip(X.chunk(k), y.chunk(k))):
        losses = loss_fn(model(Xi), yi)
        info = good_info(losses, opt)
        try:
            with cockpit(step, info, micro_batch=i, micro_batches=k):
                (info["loss"] * (2.0 if fault == "nan scaled" else 1.0)).backward()
                if fault.startswith("nan"):
                    model[0].weight.grad.fill_(float("nan"))
                if fault == "raises" and i == k - 1:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            opt.zero_grad()
            return True
    if not fault.startswith("nan"):
        opt.step()  # must never raise because of the cockpit
    opt.zero_grad()
    return False


@settings(max_examples=25, deadline=None)
@given(
    faults=st.lists(st.sampled_from(FAULTS), min_size=1, max_size=4),
    adam=st.booleans(),
    k=st.sampled_from([1, 2]),
)
@example(faults=["nan", "nan scaled", "raises"], adam=False, k=1)  # the audit's sequences
@example(faults=["nan", "raises", "nan scaled"], adam=True, k=2)
def test_faulty_steps_never_break_the_optimizer_and_the_next_step_is_exact(faults, adam, k):
    model, X, y, loss_fn = models.mlp(n=4)
    opt = (torch.optim.Adam if adam else torch.optim.SGD)(model.parameters(), lr=0.01)
    every = schedules.linear(1)
    used = [quantities.Loss(), quantities.NormTest(every), quantities.Alpha(every)]
    used.append(quantities.UpdateSize(every))
    cockpit = Cockpit(model, used)
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-finite steps' warnings
        for fault in [*faults, "none"]:
            faulty_step(cockpit, model, X, y, loss_fn, opt, step, fault, k)
            # a start's hooks on the optimizer: at most the one of the last tracked step
            assert len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks) <= 2
            step += 1
        expected = gradient_quantities(model, X, y, loss_fn)
        loss = float(loss_fn(model(X), y).mean())
        faulty_step(cockpit, model, X, y, loss_fn, opt, step, "none", k)
    values = cockpit.get_output()[step]
    assert values["NormTest"] == pytest.approx(expected["NormTest"], rel=1e-9)
    assert values["Loss"] == pytest.approx(loss, rel=1e-12)
    # the clean step before it: its two-step values, ended by this one
    assert {"Alpha", "UpdateSize"} <= set(cockpit.get_output()[step - 1])
    cockpit.close()
