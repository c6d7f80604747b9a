"""Quantities read per layer (``per_layer=True``) against brute force per parameter from
per-sample gradients by a loop (float64), their global values and the sums that add up to
them, under data parallelism too, and their reading per module from the log."""

from __future__ import annotations

import csv
import math

import models
import pytest
import torch
from reference import flat
from spawned import on_ranks
from torch import nn

from avionics import Cockpit, quantities, read_run
from avionics.records.export import to_csv
from avionics.records.series import ROOT, module_of, parameter_series, per_module

RATIOS = ("NormTest", "InnerTest", "OrthoTest", "SimpleNoiseScale", "MeanGSNR", "EarlyStopping")
SUMS = ("TrueGradSqNorm", "GradCovTrace", "CABS")
SMOOTHED = "GradientNoiseScale"  # a ratio of moving averages of sums
NAMES = (*RATIOS, *SUMS, SMOOTHED)
LR = 0.05


def statistics(G: torch.Tensor, loss: float) -> dict[str, float]:
    """Every per-layer quantity by its definition from per-sample gradients G [N, D]."""
    n = G.shape[0]
    g = G.mean(0)
    g_sq = g @ g
    proj = G @ g
    sum_sq_norms = G.pow(2).sum()
    signal = (n * g_sq - sum_sq_norms / n) / (n - 1)
    noise = (G - g).pow(2).sum() / (n - 1)
    m2 = G.pow(2).mean(0)
    out = {
        "NormTest": ((G - g).pow(2).sum() / ((n - 1) * n * g_sq)).sqrt(),
        "InnerTest": ((proj - g_sq).pow(2).sum() / ((n - 1) * n * g_sq**2)).sqrt(),
        "OrthoTest": ((G - (proj / g_sq)[:, None] * g).pow(2).sum() / ((n - 1) * n * g_sq)).sqrt(),
        "TrueGradSqNorm": signal,
        "GradCovTrace": noise,
        "SimpleNoiseScale": noise / signal,
        "MeanGSNR": (g**2 / (m2 - g**2 + 1e-5)).mean(),
        "EarlyStopping": 1 - n * (g**2 / (G.var(0, correction=1) + 1e-5)).mean(),
        "CABS": LR * (m2 - g**2).sum() / loss,
        "g_sq": g_sq,
    }
    return {k: float(v) for k, v in out.items()}


def train(build, per_layer: bool, steps: int = 2, n: int = 4):
    """Outputs of a cockpit with every per-layer quantity, and the references of each step:
    {step: (global statistics, [statistics of each parameter])}."""
    model, X, y, loss_fn = build(n=n)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    cockpit = Cockpit(model, [getattr(quantities, q)(per_layer=per_layer) for q in NAMES])
    references = {}
    for step in range(steps):
        per_sample = models.per_sample_gradients(model, X, y, loss_fn)
        loss = float(loss_fn(model(X), y).mean().detach())
        G = [g.reshape(n, -1) for g in per_sample]
        references[step] = (statistics(flat(per_sample), loss), [statistics(g, loss) for g in G])
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": n}
        with cockpit(step, info={**info, "optimizer": opt}):
            losses.mean().backward()
        opt.step()
    return cockpit.get_output(), references


@pytest.fixture(scope="module", params=["mlp", "cnn", "transformer"])
def runs(request):
    build = models.ARCHITECTURES[request.param]
    return train(build, per_layer=True), train(build, per_layer=False)[0]


def test_per_layer_values_equal_brute_force_per_parameter(runs):
    (output, references), _ = runs
    for step, (whole, layers) in references.items():
        for name in RATIOS:
            value = output[step][name]
            assert value["global"] == pytest.approx(whole[name], rel=1e-9), (step, name)
            expected = [layer[name] for layer in layers]
            assert value["per_parameter"] == pytest.approx(expected, rel=1e-9), (step, name)
        for name in SUMS:
            expected = [layer[name] for layer in layers]
            assert output[step][name] == pytest.approx(expected, rel=1e-9, abs=1e-15), name


def test_the_smoothed_noise_scale_per_layer_is_the_ratio_of_each_parameter_s_averages(runs):
    (output, references), _ = runs
    beta = 0.9  # GradientNoiseScale's default smoothing
    signal = noise = 0.0
    for step, (_, layers) in references.items():
        signal = beta * signal + (1 - beta) * torch.tensor(
            [s["TrueGradSqNorm"] for s in layers], dtype=torch.float64
        )
        noise = beta * noise + (1 - beta) * torch.tensor(
            [s["GradCovTrace"] for s in layers], dtype=torch.float64
        )
        expected = (noise / signal).tolist()
        assert output[step][SMOOTHED]["per_parameter"] == pytest.approx(expected, rel=1e-9)


def test_a_resumed_smoothed_noise_scale_continues_each_parameter_s_averages():
    def steps(first, last, state=None):
        model, X, y, loss_fn = models.mlp(n=4)
        quantity = quantities.GradientNoiseScale(per_layer=True)
        cockpit = Cockpit(model, [quantity])
        if state is not None:
            cockpit.load_state_dict(state)
        for step in range(first, last):
            model.zero_grad()
            losses = loss_fn(model(X) * (1 + step), y)  # a different gradient at each step
            info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 4}
            with cockpit(step, info=info):
                losses.mean().backward()
        return cockpit, quantity

    whole, _ = steps(0, 3)
    first, quantity = steps(0, 2)
    resumed, _ = steps(2, 3, first.state_dict())
    ours, theirs = resumed.get_output()[2][SMOOTHED], whole.get_output()[2][SMOOTHED]
    assert ours["per_parameter"] == pytest.approx(theirs["per_parameter"], rel=1e-12)
    assert ours["global"] == pytest.approx(theirs["global"], rel=1e-12)

    resumed = quantities.GradientNoiseScale(per_layer=True)
    resumed.load_state_dict(quantity.state_dict())
    state = quantity.state_dict()
    assert state["layer_signal_average"].shape == (6,)
    with pytest.raises(ValueError, match=r"state has the keys \['signal_average', 'noise_av"):
        resumed.load_state_dict({k: state[k] for k in ("signal_average", "noise_average")})
    bad = {**state, "layer_noise_average": torch.tensor([1.0, float("nan")])}
    with pytest.raises(ValueError, match=r"state\['layer_noise_average'\] must be a 1-d tensor"):
        resumed.load_state_dict(bad)
    assert resumed.state_dict()["layer_noise_average"].shape == (6,)  # unchanged


def test_per_layer_sums_add_up_to_the_global_values(runs):
    (output, references), plain = runs
    for step, (whole, _) in references.items():
        for name in SUMS:  # a sum over the parameters: its terms add up to it
            assert math.fsum(output[step][name]) == pytest.approx(plain[step][name], rel=1e-12)
            assert plain[step][name] == pytest.approx(whole[name], rel=1e-9)
        for name in (*RATIOS, SMOOTHED):  # the global value is the one without per_layer
            assert output[step][name]["global"] == pytest.approx(plain[step][name], rel=1e-12)
        # NormTest's numerator, sum_n ||g_n - g||^2 = NormTest^2 (N-1) N ||g||^2, is a sum over
        # the parameters: NormTest_k^2 ||g^(k)||^2 add up to NormTest^2 ||g||^2
        value = output[step]["NormTest"]
        g_sq = [s["g_sq"] for s in references[step][1]]
        terms = [t**2 * s for t, s in zip(value["per_parameter"], g_sq)]
        assert math.fsum(terms) == pytest.approx(value["global"] ** 2 * sum(g_sq), rel=1e-12)


def hessian_diagonal(model, X, y, loss_fn) -> torch.Tensor:
    """The Hessian diagonal of the mean loss by double backward, one coordinate at a time."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss_fn(model(X), y).mean(), params, create_graph=True)
    g = torch.cat([t.reshape(-1) for t in grads])
    rows = [torch.autograd.grad(g[d], params, retain_graph=True) for d in range(len(g))]
    return torch.stack([torch.cat([r.reshape(-1) for r in row])[d] for d, row in enumerate(rows)])


def test_tic_per_layer_equals_brute_force_with_the_hessian_diagonal():
    model, X, y, loss_fn = models.mlp(n=4)
    per_sample = models.per_sample_gradients(model, X, y, loss_fn)
    m2 = flat(per_sample).pow(2).mean(0)
    h = hessian_diagonal(model, X, y, loss_fn)
    eps = quantities.TICDiag.eps
    cockpit = Cockpit(
        model,
        [
            quantities.TICDiag(curvature="diag_h", per_layer=True),
            quantities.TICTrace(curvature="diag_h", per_layer=True),
        ],
    )
    losses = loss_fn(model(X), y)
    with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses}):
        losses.mean().backward(create_graph=True)
    out = cockpit.get_output()[0]
    sizes = [p.numel() for p in model.parameters()]
    diag = [float((a / (b + eps)).sum()) for a, b in zip(m2.split(sizes), h.split(sizes))]
    trace = [float(a.sum() / (b.sum() + eps)) for a, b in zip(m2.split(sizes), h.split(sizes))]
    assert out["TICDiag"] == pytest.approx(diag, rel=1e-9)
    assert math.fsum(out["TICDiag"]) == pytest.approx(float((m2 / (h + eps)).sum()), rel=1e-12)
    assert out["TICTrace"]["per_parameter"] == pytest.approx(trace, rel=1e-9)
    assert out["TICTrace"]["global"] == pytest.approx(float(m2.sum() / (h.sum() + eps)), rel=1e-9)


def test_bad_per_layer_is_refused_by_name_when_the_quantity_is_built():
    with pytest.raises(TypeError, match=r"NormTest\(per_layer='yes'\): per_layer must be True"):
        quantities.NormTest(per_layer="yes")
    with pytest.raises(ValueError, match=r"GradNorm\(per_layer=True\).*per parameter already"):
        quantities.GradNorm(per_layer=True)
    with pytest.raises(ValueError, match=r"HessTrace\(per_layer=True\).*per parameter already"):
        quantities.HessTrace(per_layer=True)
    with pytest.raises(ValueError, match=r"Loss\(per_layer=True\).*take it: CABS, .*NormTest"):
        quantities.Loss(per_layer=True)
    assert quantities.NormTest().output == quantities.SCALAR  # the class's output unchanged
    assert quantities.NormTest(per_layer=True).output.kind == "per_layer"


SIZES = (3, 2)


def ddp_rank(rank, world):
    """Rank ``rank``'s shard of one step of the MLP, trained through DDP."""
    model, X, y, loss_fn = models.mlp(n=sum(SIZES))
    start = sum(SIZES[:rank])
    X, y = X[start : start + SIZES[rank]], y[start : start + SIZES[rank]]
    ddp = nn.parallel.DistributedDataParallel(model)
    cockpit = Cockpit(ddp, [getattr(quantities, q)(per_layer=True) for q in NAMES])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = loss_fn(ddp(X), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "optimizer": opt}
    with cockpit(0, info={**info, "batch_size": len(X)}):
        losses.mean().backward()
    return cockpit.get_output()[0]


@pytest.mark.slow  # starting two processes
def test_under_ddp_per_layer_values_are_the_global_batch_s(tmp_path):
    expected = train(models.mlp, per_layer=True, steps=1, n=sum(SIZES))[0][0]
    for output in on_ranks(ddp_rank, 2, tmp_path):
        for name in (*RATIOS, SMOOTHED):
            ours, theirs = output[name], expected[name]
            assert ours["global"] == pytest.approx(theirs["global"], rel=1e-10)
            assert ours["per_parameter"] == pytest.approx(theirs["per_parameter"], rel=1e-10)
        for name in SUMS:
            assert output[name] == pytest.approx(expected[name], rel=1e-10)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A log of the tiny transformer (tied head, a root parameter) with per-parameter and
    per-layer quantities; and each step's gradients of the mean loss, per parameter."""
    model, X, y, loss_fn = models.transformer(n=3)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    qs = [
        quantities.GradNorm(),
        quantities.GradCovTrace(per_layer=True),
        quantities.NormTest(per_layer=True),
    ]
    tmp_path = tmp_path_factory.mktemp("per_layer")
    cockpit = Cockpit(model, qs, log=tmp_path / "run")
    grads = []
    for step in range(3):
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 3}
        with cockpit(step, info=info):
            losses.mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    cockpit.close()
    return read_run(tmp_path / "run"), grads, tmp_path


def test_module_of_a_parameter_name():
    assert module_of("0.weight") == "0"
    assert module_of("block.attn.in_proj_weight") == "block.attn"
    assert module_of("pos") == ROOT


def test_per_module_groups_parameters_with_the_quantity_s_reduction(logged):
    run, grads, _ = logged
    names = run.parameter_names
    assert "head.weight" not in names and "tok.weight" in names  # tied: one parameter

    by_module = per_module(run, "GradNorm")
    modules = list(dict.fromkeys(module_of(n) for n in names))
    assert by_module.labels == modules and ROOT in modules and "block.attn" in modules
    assert by_module.steps.tolist() == [0, 1, 2]
    for j, step_grads in enumerate(grads):
        for i, module in enumerate(modules):  # the norm of the module's whole gradient
            members = [g.reshape(-1) for n, g in step_grads.items() if module_of(n) == module]
            expected = float(torch.cat(members).norm())
            assert by_module.values[i, j] == pytest.approx(expected, rel=1e-12)

    traces = per_module(run, "GradCovTrace")
    layers = parameter_series(run, "GradCovTrace")
    assert layers.labels == names
    for i, module in enumerate(modules):
        rows = [k for k, n in enumerate(names) if module_of(n) == module]
        assert traces.values[i] == pytest.approx(layers.values[rows].sum(0), rel=1e-12)
    totals = [math.fsum(run.steps[s]["GradCovTrace"]) for s in range(3)]
    assert traces.values.sum(0) == pytest.approx(totals, rel=1e-12)


def test_a_per_layer_ratio_reads_per_parameter_only(logged):
    run, _, _ = logged
    tests = parameter_series(run, "NormTest")
    assert tests.labels == run.parameter_names
    assert tests.values[:, 1].tolist() == run.steps[1]["NormTest"]["per_parameter"]
    with pytest.raises(ValueError, match=r"per_module\(run, 'NormTest'\).*parameter_series\(run"):
        per_module(run, "NormTest")


def test_csv_has_a_column_per_parameter_of_per_layer_values(logged):
    run, _, tmp_path = logged
    with open(to_csv(run, tmp_path / "run.csv")) as f:
        rows = list(csv.DictReader(f))
    name = run.parameter_names[2]
    assert float(rows[1]["NormTest"]) == run.steps[1]["NormTest"]["global"]
    assert float(rows[1][f"NormTest[{name}]"]) == run.steps[1]["NormTest"]["per_parameter"][2]
    assert float(rows[1][f"GradCovTrace[{name}]"]) == run.steps[1]["GradCovTrace"][2]
