"""Every per-sample quantity of the foundation issue against brute force, on every test model."""

import copy

import models
import pytest
import torch
from reference import gradient_quantities

from avionics import Cockpit, quantities, schedules

SINGLE_STEP = ["NormTest", "InnerTest", "OrthoTest", "MeanGSNR", "EarlyStopping", "CABS"]


def run_and_reference(build, n, reduction, steps=3, lr=0.05):
    model, X, y, loss_fn = build(n=n)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cockpit = Cockpit(model, [getattr(quantities, name)() for name in SINGLE_STEP + ["GradNorm"]])
    references = {}
    for step in range(steps):
        ref = gradient_quantities(model, X, y, loss_fn)
        ref["CABS"] = lr * ref["_variance_sum"] / float(loss_fn(model(X), y).mean().detach())
        if reduction == "sum":
            ref["CABS"] *= n  # SGD's step on the sum is that of the mean with lr * N
        references[step] = ref
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {"loss": loss, "individual_losses": losses, "batch_size": n, "optimizer": opt}
        with cockpit(step, info=info):
            loss.backward()
        opt.step()
    return cockpit.get_output(), references


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("architecture", sorted(models.ARCHITECTURES))
def test_quantities_match_brute_force(architecture, reduction):
    output, references = run_and_reference(models.ARCHITECTURES[architecture], 3, reduction)
    for step, ref in references.items():
        for name in SINGLE_STEP:
            assert output[step][name] == pytest.approx(ref[name], rel=1e-9, abs=1e-12), (
                step,
                name,
            )


@pytest.mark.parametrize("architecture", ["mlp", "transformer", "cnn"])
def test_batch_of_two(architecture):
    output, references = run_and_reference(models.ARCHITECTURES[architecture], 2, "mean")
    for step, ref in references.items():
        for name in ["NormTest", "InnerTest", "OrthoTest", "MeanGSNR"]:
            assert output[step][name] == pytest.approx(ref[name], rel=1e-9)


def test_batch_of_one_stores_nan_for_the_tests_and_values_for_the_rest():
    model, X, y, loss_fn = models.mlp(n=1)
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.GradNorm(), quantities.MeanGSNR()])
    losses = loss_fn(model(X), y)
    with pytest.warns(UserWarning, match="at least 2 samples"):
        with cockpit(
            0, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 1}
        ):
            losses.mean().backward()
    out = cockpit.get_output()[0]
    assert out["NormTest"] != out["NormTest"]  # nan
    expected = [float(p.grad.norm()) for p in model.parameters()]
    assert out["GradNorm"] == pytest.approx(expected, rel=1e-12)
    # one sample: the variance is zero, so MeanGSNR = mean_d g_d^2 / eps
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert out["MeanGSNR"] == pytest.approx(float((g**2 / 1e-5).mean()), rel=1e-9)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_norm_distance_update_size(reduction):
    model, X, y, loss_fn = models.cnn(n=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    qs = [quantities.GradNorm(), quantities.Distance(), quantities.UpdateSize(), quantities.Loss()]
    cockpit = Cockpit(model, qs)
    theta0 = [p.detach().clone() for p in model.parameters()]
    history, grads, losses_seen = [], [], []
    for step in range(3):
        history.append([p.detach().clone() for p in model.parameters()])
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        with cockpit(step, info={"loss": loss, "individual_losses": losses, "batch_size": 3}):
            loss.backward()
        grads.append(
            [p.grad.clone() / (1 if reduction == "mean" else 3) for p in model.parameters()]
        )
        losses_seen.append(float(loss))
        opt.step()
    out = cockpit.get_output()
    for step in range(3):
        assert out[step]["Loss"] == losses_seen[step]
        assert out[step]["GradNorm"] == pytest.approx([float(g.norm()) for g in grads[step]])
        distance = [float((p - p0).norm()) for p, p0 in zip(history[step], theta0)]
        assert out[step]["Distance"] == pytest.approx(distance, abs=1e-12)
    for step in range(2):  # the last step's update is never seen by the cockpit
        size = [float((b - a).norm()) for a, b in zip(history[step], history[step + 1])]
        assert out[step]["UpdateSize"] == pytest.approx(size, rel=1e-9)
    assert "UpdateSize" not in out[2]


def test_schedules_per_quantity():
    model, X, y, loss_fn = models.mlp(n=3)
    cockpit = Cockpit(
        model,
        [
            quantities.NormTest(schedule=schedules.linear(2)),
            quantities.GradNorm(schedule=schedules.linear(3, offset=1)),
            quantities.UpdateSize(schedule=schedules.linear(4)),
        ],
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(8):
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        with cockpit(
            step, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        ):
            losses.mean().backward()
        opt.step()
    out = cockpit.get_output()
    assert sorted(s for s in out if "NormTest" in out[s]) == [0, 2, 4, 6]
    assert sorted(s for s in out if "GradNorm" in out[s]) == [1, 4, 7]
    assert sorted(s for s in out if "UpdateSize" in out[s]) == [0, 4]


def test_several_quantities_give_the_same_numbers_as_each_alone():
    names = SINGLE_STEP + ["GradNorm", "Distance", "UpdateSize", "Loss"]

    def run(selected):
        model, X, y, loss_fn = models.transformer(n=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cockpit = Cockpit(model, [getattr(quantities, name)() for name in selected])
        for step in range(2):
            opt.zero_grad()
            losses = loss_fn(model(X), y)
            info = {
                "loss": losses.mean(),
                "individual_losses": losses,
                "batch_size": 3,
                "optimizer": opt,
            }
            with cockpit(step, info=info):
                losses.mean().backward()
            opt.step()
        return cockpit.get_output()

    together = run(names)
    for name in names:
        alone = run([name])
        steps = [step for step in together if name in together[step]]
        assert [step for step in alone if name in alone[step]] == steps
        for step in steps:
            assert alone[step][name] == pytest.approx(together[step][name], rel=1e-12)


def test_gradients_are_bit_identical_with_and_without_the_cockpit():
    model, X, y, loss_fn = models.transformer(n=3)
    twin = copy.deepcopy(model)
    cockpit = Cockpit(model, [getattr(quantities, n)() for n in SINGLE_STEP[:4]])
    losses = loss_fn(model(X), y)
    with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}):
        losses.mean().backward()
    loss_fn(twin(X), y).mean().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_subset_of_the_parameters():
    model, X, y, loss_fn = models.transformer(n=3)
    subset = [model.block.attn.in_proj_weight, model.tok.weight, model.ln.bias]
    cockpit = Cockpit(model, [quantities.NormTest(), quantities.GradNorm()], params=subset)
    G = torch.cat(
        [g.reshape(3, -1) for g in models.per_sample_gradients(model, X, y, loss_fn, subset)], 1
    )
    g = G.mean(0)
    expected = ((G - g).pow(2).sum() / (2 * 3 * g @ g)).sqrt()
    losses = loss_fn(model(X), y)
    with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}):
        losses.mean().backward()
    out = cockpit.get_output()[0]
    assert out["NormTest"] == pytest.approx(float(expected), rel=1e-10)
    assert out["GradNorm"] == pytest.approx([float(p.grad.norm()) for p in subset], rel=1e-12)


def test_quantities_that_keep_theta_t_share_one_copy_per_step():
    model, X, y, loss_fn = models.mlp(n=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    distance, update_size = quantities.Distance(), quantities.UpdateSize()
    cockpit = Cockpit(model, [distance, update_size, quantities.Parameters()])
    theta0 = [p.detach().clone() for p in model.parameters()]
    losses = loss_fn(model(X), y)
    with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}):
        losses.mean().backward()
    opt.step()
    kept = update_size.pending[1]
    assert all(a is b for a, b in zip(distance.initial, kept, strict=True))
    # the shared copy is theta_0, untouched by the update and by the quantities
    assert all(torch.equal(a, b) for a, b in zip(kept, theta0, strict=True))
    assert cockpit.get_output()[0]["Parameters"] == [t.tolist() for t in theta0]


def test_second_moment_quantities_leave_a_single_gradient_untouched():
    # one parameter: the flattened gradient they overwrite must still be a copy of p.grad
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, bias=False).double()
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))

    def run(names):
        net = copy.deepcopy(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        cockpit = Cockpit(net, [getattr(quantities, name)() for name in names])
        losses = torch.nn.functional.cross_entropy(net(X), y, reduction="none")
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 5}
        with cockpit(0, info={**info, "optimizer": opt}):
            losses.mean().backward()
        return net.weight.grad, cockpit.get_output()[0]

    names = ["MeanGSNR", "CABS", "EarlyStopping"]
    grad, together = run(names)
    plain = copy.deepcopy(model)
    torch.nn.functional.cross_entropy(plain(X), y).backward()
    assert torch.equal(grad, plain.weight.grad)
    for name in names:
        assert run([name])[1][name] == together[name]
