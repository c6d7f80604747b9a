"""A long run of configuration("full") with faults injected at random steps: exceptions inside
the ``with`` block (before and after the backward) and NaN gradients. The training goes on,
and every uninterrupted step's values equal their definitions (dense float64 references).

``AVIONICS_FAULT_STEPS`` sets the length (default 120; the closing note of the reliability
issue quotes a 500-step run).
"""

from __future__ import annotations

import os
import warnings

import models
import pytest
import torch
from reference import gradient_quantities

from avionics import Cockpit, configuration

STEPS = int(os.environ.get("AVIONICS_FAULT_STEPS", "120"))


class Injected(Exception):
    pass


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def dense_hessian(model, X, y, loss_fn, theta):
    """The Hessian of the mean loss at theta, by double backward."""
    shapes = [p.shape for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]

    def loss_of(flat):
        parts, k = {}, 0
        for name, shape in zip(names, shapes):
            parts[name] = flat[k : k + shape.numel()].reshape(shape)
            k += shape.numel()
        out = torch.func.functional_call(model, parts, (X,))
        return loss_fn(out, y).mean()

    return torch.autograd.functional.hessian(loss_of, theta)


@pytest.mark.slow
def test_full_cockpit_survives_random_faults_and_stays_exact():
    model, _, _, loss_fn = models.mlp(n=6)
    generator = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model, configuration("full"))
    sizes = [p.numel() for p in model.parameters()]
    theta_0 = flat_params(model)
    kinds = {}
    thetas = {}
    batches = {}
    for step in range(STEPS):
        X = torch.randn(6, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=generator)
        fault = torch.rand(1, generator=generator).item()
        kind = (
            "raise before backward"
            if fault < 0.06
            else "raise after backward"
            if fault < 0.12
            else "nan gradient"
            if fault < 0.17
            else "clean"
        )
        kinds[step], thetas[step], batches[step] = kind, flat_params(model), (X, y)
        out = model(X)
        if kind == "nan gradient":
            out = models.NanGradient.apply(out)
        losses = loss_fn(out, y)
        loss = losses.mean()
        info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with cockpit(step, info=info):
                    if kind == "raise before backward":
                        raise Injected
                    loss.backward(create_graph=cockpit.create_graph(step))
                    if kind == "raise after backward":
                        raise Injected
        except Injected:
            pass
        grads_finite = all(
            p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters()
        )
        if grads_finite and kind != "raise before backward":
            opt.step()  # the user's loop steps even when its own code raised after the backward
        opt.zero_grad(set_to_none=True)
    thetas[STEPS] = flat_params(model)

    output = cockpit.get_output()
    interrupted = {s for s, k in kinds.items() if k.startswith("raise")}
    assert interrupted and set(output).isdisjoint(interrupted)
    assert set(output) == set(kinds) - interrupted
    checked = 0
    for step, values in output.items():
        X, y = batches[step]
        if kinds[step] == "nan gradient":
            assert values["GradNorm"] != values["GradNorm"] or any(
                v != v for v in values["GradNorm"]
            )
            continue
        assert torch.isfinite(torch.tensor(values["Loss"]))
        theta = thetas[step]
        assert values["Distance"] == pytest.approx(
            [float(d.norm()) for d in (theta - theta_0).split(sizes)], rel=1e-10, abs=1e-12
        )
        if step + 1 in output or step + 1 == STEPS:  # the next step was not interrupted
            update = thetas[step + 1] - theta
            assert values["UpdateSize"] == pytest.approx(
                [float(d.norm()) for d in update.split(sizes)], rel=1e-10, abs=1e-12
            )
        else:
            assert "UpdateSize" not in values
        if step % 10 == 0:  # the dense references cost: every tenth step
            reference_model = models.mlp(n=6)[0]
            torch.nn.utils.vector_to_parameters(theta, reference_model.parameters())
            expected = gradient_quantities(reference_model, X, y, loss_fn)
            for name in ("NormTest", "InnerTest", "OrthoTest"):
                assert values[name] == pytest.approx(expected[name], rel=1e-8)
            hessian = dense_hessian(reference_model, X, y, loss_fn, theta)
            top = float(torch.linalg.eigvalsh(hessian)[-1])
            assert values["HessMaxEV"] == pytest.approx(top, rel=1e-3)
            traces = [float(d.sum()) for d in hessian.diagonal().split(sizes)]
            assert values["HessTrace"] == pytest.approx(traces, rel=1e-8, abs=1e-12)
            checked += 1
    assert checked >= STEPS // 20


# The third audit's faults (issue 28): besides exceptions and NaN gradients, gradients not
# finite after a scaled backward (skipped by the cockpit), optimizer steps the user skips,
# and short accumulations (2 of 3 declared micro-batches, then the next step begins).
FAULTS = ["clean"] * 6 + ["raise before", "raise after", "nan", "nan scaled", "skip", "short"]


def faulty_step(cockpit, model, X, y, loss_fn, opt, step, fault):
    """One step with ``fault``; the optimizer steps unless the fault skips it."""
    k = 3 if fault == "short" else 2 if step % 3 == 0 else 1
    parts = 2 if fault == "short" else k
    for i, (Xi, yi) in enumerate(zip(X.chunk(parts), y.chunk(parts))):
        losses = loss_fn(model(Xi), yi)
        info = {"loss": losses.mean(), "individual_losses": losses, "optimizer": opt}
        info["batch_size"] = len(losses)
        protocol = {} if k == 1 else {"micro_batch": i, "micro_batches": k}
        scale = (2.0 if fault == "nan scaled" else 1.0) / parts
        try:
            with cockpit(step, info, **protocol):
                if fault == "raise before" and i == parts - 1:
                    raise Injected
                (info["loss"] * scale).backward(create_graph=cockpit.create_graph(step))
                if fault.startswith("nan"):
                    next(model.parameters()).grad.fill_(float("nan"))
                if fault == "raise after" and i == parts - 1:
                    raise Injected
        except Injected:
            break
    if fault in ("clean", "short"):
        opt.step()  # never raises because of the cockpit
    opt.zero_grad(set_to_none=True)


@pytest.mark.slow
@pytest.mark.parametrize("architecture, optimizer", [("mlp", "SGD"), ("transformer", "Adam")])
def test_every_fault_of_the_third_audit_leaves_the_optimizer_and_the_values(
    architecture, optimizer
):
    model, X, y, loss_fn = getattr(models, architecture)(n=6)
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=0.01)
    cockpit = Cockpit(model, configuration("full"))
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for step in range(STEPS):
        fault = FAULTS[int(torch.randint(len(FAULTS), (1,), generator=generator))]
        permutation = torch.randperm(len(X), generator=generator)
        Xs, ys = X[permutation], y[permutation]
        expected = gradient_quantities(model, Xs, ys, loss_fn) if fault == "clean" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the faults' own warnings
            faulty_step(cockpit, model, Xs, ys, loss_fn, opt, step, fault)
        if expected is not None:
            values = cockpit.get_output()[step]
            for name in ("NormTest", "InnerTest"):
                assert values[name] == pytest.approx(expected[name], rel=1e-10)
            checked += 1
    cockpit.close()
    assert checked >= STEPS // 3
