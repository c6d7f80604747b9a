"""PreconditionedSharpness against eigvalsh of the dense P^{-1/2} H P^{-1/2} in float64: H by
torch.autograd.functional.hessian at theta_t, P from the state that the optimizer's own step
leaves (v_t after the step it was about to take), for Adam, AdamW and RMSprop and their
variants; refusals of what it cannot read, before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from spawned import on_ranks
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from avionics import Cockpit
from avionics.quantities import LossOutliers, PreconditionedSharpness
from tests.models import ARCHITECTURES


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _dense_hessian(model, X, y, loss_fn) -> torch.Tensor:
    """The Hessian of the mean loss over the flat parameters (tied weights once)."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = _params(model)
    shapes, sizes = [p.shape for p in params], [p.numel() for p in params]

    def loss(flat):
        tensors = [t.reshape(s) for t, s in zip(flat.split(sizes), shapes, strict=True)]
        out = functional_call(model, dict(zip(names, tensors, strict=True)), (X,))
        return loss_fn(out, y).mean()

    flat = torch.cat([p.detach().reshape(-1) for p in params])
    return torch.autograd.functional.hessian(loss, flat, vectorize=True)


def _preconditioner_after_step(optimizer, params) -> torch.Tensor:
    """diag(P) of the step just taken, from the state torch wrote (flat, zeros -> untouched)."""
    parts = []
    for p in params:
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        state = optimizer.state[p]
        if "exp_avg_sq" in state:  # Adam, AdamW
            beta2, t = group["betas"][1], float(state["step"])
            v = state["max_exp_avg_sq"] if group["amsgrad"] else state["exp_avg_sq"]
            parts.append((v / (1 - beta2**t)).sqrt() + group["eps"])
        else:  # RMSprop
            v = state["square_avg"]
            if group["centered"]:
                v = v - state["grad_avg"].square()
            parts.append(v.sqrt() + group["eps"])
    return torch.cat([t.reshape(-1) for t in parts])


def _train(model, X, y, loss_fn, optimizer, quantity, steps, check, check_at=None):
    """``steps`` steps; ``check(step, value, H)`` after the optimizer step of each step of
    ``check_at`` (default all), H taken at theta_t."""
    cockpit = Cockpit(model, quantities=[quantity])
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        losses = loss_fn(model(X), y)
        loss = losses.mean()
        info = {"loss": loss, "individual_losses": losses, "optimizer": optimizer}
        with cockpit(step, info):
            loss.backward(create_graph=cockpit.create_graph(step))
        value = cockpit.get_output()[step]["PreconditionedSharpness"]
        if check_at is not None and step not in check_at:
            optimizer.step()
            continue
        with sdpa_kernel(SDPBackend.MATH):  # attention with a second derivative
            H = _dense_hessian(model, X, y, loss_fn)
        optimizer.step()
        check(step, value, H)
    for p in model.parameters():
        p.grad = None


OPTIMIZERS = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "Adam amsgrad weight_decay": lambda ps: torch.optim.Adam(
        ps, lr=1e-2, amsgrad=True, weight_decay=0.1, eps=1e-3
    ),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.9), foreach=True),
    "Adam fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "RMSprop centered momentum weight_decay": lambda ps: torch.optim.RMSprop(
        ps, lr=1e-3, centered=True, momentum=0.5, weight_decay=0.1, alpha=0.9
    ),
}


def _check_four_steps(arch, kind, check_at=None):
    model, X, y, loss_fn = ARCHITECTURES[arch]()
    params = _params(model)
    optimizer = OPTIMIZERS[kind](params)
    quantity = PreconditionedSharpness(tol=1e-9, max_products=1000)
    checked = []

    def check(step, value, H):
        s = _preconditioner_after_step(optimizer, params).rsqrt()
        expected = torch.linalg.eigvalsh(s[:, None] * H * s[None, :])[-1]
        assert value == pytest.approx(float(expected), rel=1e-6)
        checked.append(step)

    _train(model, X, y, loss_fn, optimizer, quantity, 4, check, check_at)
    assert checked == (list(range(4)) if check_at is None else sorted(check_at))


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_matches_eigvalsh_of_the_dense_preconditioned_hessian(kind):
    """Four steps: the first without optimizer state, the last after three steps of it."""
    _check_four_steps("mlp", kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Adam", "RMSprop"])
def test_matches_eigvalsh_on_the_tiny_transformer(kind):
    """The tiny GPT (tied weights, attention, LayerNorm) after three steps (752 parameters:
    one dense Hessian)."""
    _check_four_steps("transformer", kind, check_at={3})


def test_parameters_the_optimizer_does_not_hold_do_not_move():
    """Adam on the last layer only: the eigenproblem of that layer's block of H."""
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    last = list(model[-1].parameters())
    optimizer = torch.optim.Adam(last, lr=1e-2)
    size = sum(p.numel() for p in last)

    def check(step, value, H):
        s = _preconditioner_after_step(optimizer, last).rsqrt()
        block = H[-size:, -size:]
        expected = torch.linalg.eigvalsh(s[:, None] * block * s[None, :])[-1]
        assert value == pytest.approx(float(expected), rel=1e-6)

    _train(model, X, y, loss_fn, optimizer, PreconditionedSharpness(tol=1e-9), 2, check)


class _OwnStep(torch.optim.Adam):
    def step(self, closure=None):
        return super().step(closure)


def _two_learning_rates(params):
    return torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}])


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), r"info\['optimizer'\] is SGD"),
        (lambda ps: torch.optim.Adagrad(ps), r"info\['optimizer'\] is Adagrad"),
        (lambda ps: _OwnStep(ps), r"info\['optimizer'\] is _OwnStep"),
        (lambda ps: torch.optim.Adam(ps, maximize=True), "it has maximize=True"),
        (lambda ps: torch.optim.RMSprop(ps, maximize=True), "it has maximize=True"),
        (_two_learning_rates, r"different \(lr, beta1 or momentum\) settings"),
    ],
)
def test_refuses_what_it_cannot_read_before_any_work(make, reason):
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    optimizer = make(_params(model))
    cockpit = Cockpit(model, quantities=[PreconditionedSharpness()])
    losses = loss_fn(model(X), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "optimizer": optimizer}
    with pytest.raises(ValueError, match="PreconditionedSharpness reads the preconditioner.*"):
        with cockpit(0, info):
            losses.mean().backward()
    with pytest.raises(ValueError, match=reason):
        PreconditionedSharpness().validate(0, info)
    assert cockpit.get_output() == {}
    assert all(p.grad is None for p in model.parameters())  # refused before the backward


def test_refuses_complex_parameters():
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2, dtype=torch.cfloat))])
    with pytest.raises(ValueError, match="it holds complex parameters. Use such an optimizer"):
        PreconditionedSharpness().validate(0, {"optimizer": optimizer})


def test_needs_the_optimizer():
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    cockpit = Cockpit(model, quantities=[PreconditionedSharpness()])
    with pytest.raises(KeyError, match="optimizer"):
        with cockpit(0, {"loss": loss_fn(model(X), y).mean()}):
            pass


def _adam_run(rank=None, world=None, sizes=(3, 3), steps=3):
    """Adam on the MLP with PreconditionedSharpness and LossOutliers: on one process with the
    global batch (``rank`` None), else this process's shard under DDP."""
    model, _, _, loss_fn = ARCHITECTURES["mlp"]()
    forward = model if rank is None else torch.nn.parallel.DistributedDataParallel(model)
    quantities = [PreconditionedSharpness(tol=1e-10, max_products=300), LossOutliers(k=1.0)]
    cockpit = Cockpit(forward, quantities)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        _, X, y, _ = ARCHITECTURES["mlp"](n=sum(sizes), seed=100 + step)
        if rank is not None:
            start = sum(sizes[:rank])
            X, y = X[start : start + sizes[rank]], y[start : start + sizes[rank]]
        optimizer.zero_grad(set_to_none=True)
        losses = loss_fn(forward(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "optimizer": optimizer}
        with cockpit(step, info):
            losses.mean().backward(create_graph=cockpit.create_graph(step))
        optimizer.step()
    for p in model.parameters():
        p.grad = None
    return cockpit.get_output()


@pytest.mark.slow
def test_under_ddp_the_values_are_the_global_batch_s(tmp_path):
    """Two gloo processes, DDP: the preconditioned sharpness of the global loss and the loss
    outliers indexed into the concatenated batch, as on one process with that batch."""
    expected = _adam_run()
    for output in on_ranks(_adam_run, 2, tmp_path):
        for step, values in expected.items():
            ours = output[step]
            assert ours["PreconditionedSharpness"] == pytest.approx(
                values["PreconditionedSharpness"], rel=1e-7
            )
            assert ours["LossOutliers"]["indices"] == values["LossOutliers"]["indices"]
            assert ours["LossOutliers"]["losses"] == pytest.approx(
                values["LossOutliers"]["losses"]
            )
    assert any(values["LossOutliers"]["indices"] for values in expected.values())


def test_adamw_built_before_any_adam_is_supported():
    """torch wraps a class's ``step`` when its first instance is built, so AdamW's step is a
    wrapper of Adam's own, distinct from Adam's wrapper, when an AdamW comes first (a fresh
    process, to control the order)."""
    script = (
        "import torch\n"
        "from avionics.quantities.preconditioned_sharpness import why_unsupported\n"
        "m = torch.nn.Linear(2, 2)\n"
        "first, second = torch.optim.AdamW(m.parameters()), torch.optim.Adam(m.parameters())\n"
        "assert torch.optim.AdamW.step is not torch.optim.Adam.step\n"
        "print(why_unsupported(first), why_unsupported(second))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]


def test_steady_adam_steps_of_one_product_stay_within_tol():
    """A slow Adam run (P and H change little per step): some steps stop after the one-product
    check of the shared warm start, and every step is within tol = 1e-3 of eigvalsh."""
    model, X, y, loss_fn = ARCHITECTURES["mlp"]()
    params = _params(model)
    optimizer = torch.optim.Adam(params, lr=1e-6)
    quantity = PreconditionedSharpness()
    errors = []

    def check(step, value, H):
        s = _preconditioner_after_step(optimizer, params).rsqrt()
        expected = float(torch.linalg.eigvalsh(s[:, None] * H * s[None, :])[-1])
        errors.append((expected - value) / abs(expected))

    _train(model, X, y, loss_fn, optimizer, quantity, 8, check)
    assert len(errors) == 8 and all(-1e-12 <= e <= 1e-3 for e in errors), errors
    assert 1 in quantity.num_products.values() and quantity.num_products[0] > 1
