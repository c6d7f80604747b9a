"""The quantities under bad numbers and bad input, driven by the real Cockpit in real training
loops, against float64 brute force:

* non-finite gradients at a step (finite loss) are recorded as nan, never raised, by every
  quantity of configuration("full") and the others, and later steps are exact (warm starts,
  pending starts, adapted ranges and Distance's theta_0 discard what was not finite);
* a zero mean gradient: the gradient tests store nan with a warning, once;
* float32 gradients near 1e10 (the squares of the gradient tests overflow in float32);
* HessMaxEV and CABS follow the user's loss reduction (and agree with cockpit-for-pytorch
  where it is installed);
* bad constructor arguments, and optimizers a quantity does not support, are refused before
  anything is computed or stored.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import math
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from compare import assert_same_output
from torch import nn
from torch.func import functional_call

import avionics.curvature.algorithms.lanczos as lanczos
import avionics.quantities as Q
from avionics import Cockpit, configuration
from avionics.curvature.algorithms.lanczos import BlockOperator, LanczosState, top_eigenpairs
from tests.models import mlp, per_sample_gradients
from tests.quantities.test_curvature_instruments import dense_hessian
from tests.quantities.test_hess_max_ev import _WithUnused
from tests.quantities.test_histograms import assert_counts_match, brute_force, expected_1d
from tests.reference import flat, gradient_quantities

# Besides configuration("full"): the quantities of no preset (Time's value is the clock).
EXTRA = ("CABS", "EarlyStopping", "MeanGSNR", "TICTrace", "Parameters", "Time")
# The values of a step with non-finite gradients that are nan (or inf) as a whole.
NOT_FINITE = (
    "NormTest", "InnerTest", "OrthoTest", "TICDiag", "TICTrace", "HessMaxEV", "CABS",
    "EarlyStopping", "MeanGSNR",
)  # fmt: skip
LR = 0.05


class _NonFiniteGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient of element [0, 0] (sample 0's
    first feature) by ``value`` (nan or inf), as an overflow in a custom op would: the loss is
    finite, the gradients and the Hessian-vector products through them are not."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        factor = torch.ones_like(grad)
        factor[0, 0] = ctx.value
        return grad * factor, None


class _Poisonable(nn.Module):
    """The test MLP with the non-finite backward after its first layer while ``value`` is
    set."""

    def __init__(self, net: nn.Sequential):
        super().__init__()
        self.net = net
        self.value: float | None = None

    def forward(self, x):
        h = self.net[0](x)
        if self.value is not None:
            h = _NonFiniteGradient.apply(h, self.value)
        return self.net[1:](h)


def _train(quantities, bad_steps=(), value=math.nan, steps=5, before_update=None, n=5):
    """Plain SGD on the test MLP for ``steps`` steps, each tracked; at ``bad_steps`` the
    gradients are not finite (``value``; None: finite all the same) and the update is skipped,
    as a gradient scaler skips it. Returns the output and the warnings' messages."""
    net, X, y, loss_fn = mlp(n=n)
    model = _Poisonable(net)
    cockpit = Cockpit(model, quantities)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            model.value = value if step in bad_steps else None
            opt.zero_grad(set_to_none=True)
            losses = loss_fn(model(X), y)
            info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": n,
                    "optimizer": opt}  # fmt: skip
            with cockpit(step, info):
                losses.mean().backward(create_graph=cockpit.create_graph(step))
            if before_update is not None:
                model.value = None
                before_update(step, model, X, y, loss_fn)
            if step not in bad_steps:
                opt.step()
    for p in model.parameters():
        p.grad = None  # break create_graph's reference cycle
    return cockpit.get_output(), [str(w.message) for w in caught]


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _top_eigenvalue(step, model, X, y, loss_fn, into):
    into[step] = float(torch.linalg.eigvalsh(dense_hessian(model, X, y, loss_fn))[-1])


# ------------------------------------------------------------------ non-finite gradients
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_gradients_are_recorded_and_the_finite_steps_are_exact(value):
    """Steps 0 and 2 have non-finite gradients (a cold and a warm HessMaxEV start): every
    quantity stores nan or inf there and raises nothing; the other steps equal a run whose
    gradients are finite throughout (same updates), HessMaxEV the dense Hessian's."""
    bad = (0, 2)

    def quantities():
        return configuration("full") + [getattr(Q, name)() for name in EXTRA]

    top = {}
    out, _ = _train(quantities(), bad, value, before_update=lambda *a: _top_eigenvalue(*a, top))
    clean, _ = _train(quantities(), bad, None)
    for step in bad:
        values = out[step]
        for name in NOT_FINITE:
            assert not math.isfinite(values[name]), (step, name)
        for name in ("GradNorm", "HessTrace"):
            assert not all(map(math.isfinite, values[name])), (step, name)
        assert math.isfinite(values["Loss"])
        assert_same_output(values["Distance"], clean[step]["Distance"], 1e-10, 1e-14, (step,))
    # Alpha at t needs the gradients of t and t + 1
    assert [_is_nan(out[s]["Alpha"]) for s in range(4)] == [True, True, True, False]
    for step in (1, 3, 4):
        assert out[step]["HessMaxEV"] == pytest.approx(top[step], rel=1e-3), step
        for name, theirs in clean[step].items():
            if name not in ("HessMaxEV", "Time") and not (name == "Alpha" and step == 1):
                assert_same_output(out[step][name], theirs, 1e-10, 1e-14, (step, name))


@pytest.mark.parametrize("flat_below", [1 << 40, 0], ids=["flat", "per_block"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_lanczos_stops_at_a_product_that_is_not_finite(value, flat_below, monkeypatch):
    """A product that is not finite after two finite ones (numpy's eigh raised "Eigenvalues
    did not converge" on the projected matrix): nan, not converged, and the state keeps no
    eigenpair, so that the next call starts afresh and is exact; as is a call whose kept
    eigenvector is not finite."""
    monkeypatch.setattr(lanczos, "FLAT_BELOW", flat_below)
    torch.manual_seed(0)
    D = 30
    basis, _ = torch.linalg.qr(torch.randn(D, D, dtype=torch.float64))
    A = (basis * torch.linspace(-1.0, 4.0, D, dtype=torch.float64)) @ basis.T
    products = 0

    def product(v):
        nonlocal products
        products += 1
        Av = A @ v
        if products == 3:
            Av[5] = value
        return [Av]

    op = BlockOperator(product, [slice(0, D)], torch.float64, torch.device("cpu"))

    def top(state):
        return top_eigenpairs(
            op, tol=1e-10, max_products=300, max_basis=20, seed=0, criterion="eigenvalue",
            state=state,
        )  # fmt: skip

    state = LanczosState()
    result = top(state)
    assert result.num_products == 3 and not result.converged
    assert torch.isnan(result.values).all() and torch.isnan(result.vectors).all()
    assert state.eigenvalue is None and state.eigenvector is None
    assert top(state).converged and state.eigenvalue == pytest.approx(4.0, rel=1e-9)
    state = LanczosState.from_eigenpair(torch.full((D,), value, dtype=torch.float64), 1.0)
    assert top(state).converged and state.eigenvalue == pytest.approx(4.0, rel=1e-9)


def test_histogram_ranges_are_not_adapted_to_a_step_that_is_not_finite():
    """GradAbsMax at a step with nan gradients keeps the range (with a warning): the next
    step is binned on the range adapted at the step before, against numpy."""
    hist_1d = Q.GradHist1d(bins=21, adapt=Q.GradAbsMax(padding=0.1))
    hist_2d = Q.GradHist2d(bins=(7, 5), adapt=(Q.GradAbsMax(), Q.ParamAbsMax()))
    seen = {}

    def record(step, model, X, y, loss_fn):
        seen[step] = brute_force(model, X, y, loss_fn)[:2]

    out, messages = _train([hist_1d, hist_2d], (1,), steps=3, before_update=record)
    for name in ("GradHist1d", "GradHist2d"):
        assert any(f"{name} at step 1: the largest |per-sample gradient element| is nan" in m
                   for m in messages), name  # fmt: skip
    G0, _ = seen[0]
    G2, theta2 = seen[2]
    hi = 1.1 * np.abs(G0).max()  # adapted after step 0, kept through step 1
    counts, edges, ambiguous = expected_1d(G2, 21, -hi, hi)
    assert out[2]["GradHist1d"]["edges"] == pytest.approx(edges.tolist(), rel=1e-12)
    assert_counts_match(out[2]["GradHist1d"]["hist"], counts, ambiguous)
    x_edges, y_edges = out[2]["GradHist2d"]["edges"]
    assert x_edges[-1] == pytest.approx(np.abs(G0).max(), rel=1e-12)
    # the parameters stayed finite: adapted at step 1 as usual (theta_1 = theta_2, the update
    # of step 1 skipped)
    assert y_edges[-1] == pytest.approx(np.abs(theta2).max(), rel=1e-12)


def test_distance_discards_a_start_that_is_not_finite():
    """theta_0 with a nan entry (in a parameter the loss does not reach) is no start: that
    step stores nan for it, and the next step's parameters become theta_0."""
    torch.manual_seed(0)
    model = _WithUnused().double()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    distance = Q.Distance()
    cockpit = Cockpit(model, [distance])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    unused = model.unused.detach().clone()
    with torch.no_grad():
        model.unused[0] = math.nan
    thetas = []
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                model.unused.copy_(unused)  # the user repairs the parameter
        thetas.append([p.detach().clone() for p in model.parameters()])
        opt.zero_grad()
        losses = nn.functional.cross_entropy(model(X), y, reduction="none")
        with cockpit(step, info={"loss": losses.mean()}):
            losses.mean().backward()
        opt.step()
        if step == 0:
            assert distance.initial is None
    out = cockpit.get_output()
    at_start = dict(zip([name for name, _ in model.named_parameters()], out[0]["Distance"]))
    assert _is_nan(at_start.pop("unused")) and list(at_start.values()) == [0.0, 0.0]
    assert out[1]["Distance"] == [0.0, 0.0, 0.0]
    expected = [float((a - b).norm()) for a, b in zip(thetas[2], thetas[1], strict=True)]
    assert out[2]["Distance"] == pytest.approx(expected, rel=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(distance.initial, thetas[1], strict=True))


# ------------------------------------------------------------------ zero gradient
def test_a_zero_mean_gradient_warns_once_per_test_and_stores_nan():
    """From step 1 on the per-sample losses are constant in the parameters: the gradient
    tests are undefined there (nan), each says so once, naming itself and the step."""
    net, X, y, loss_fn = mlp(n=5)
    tests = [Q.NormTest(), Q.InnerTest(), Q.OrthoTest()]
    cockpit = Cockpit(net, [*tests, Q.GradNorm()])
    reference = gradient_quantities(net, X, y, loss_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            out = net(X)
            losses = loss_fn(out, y) if step == 0 else (out * 0).sum(1) + 1.0
            info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 5}
            net.zero_grad()
            with cockpit(step, info):
                losses.mean().backward()
    zero = [str(w.message) for w in caught if "mean gradient is zero" in str(w.message)]
    assert sorted(zero) == sorted(
        f"{q.name} at step 1: the mean gradient is zero, so the test is undefined (it "
        "divides by ||g||^2); stored nan. Warned once."
        for q in tests
    )
    output = cockpit.get_output()
    for q in tests:
        assert output[0][q.name] == pytest.approx(reference[q.name], rel=1e-10)
        assert _is_nan(output[1][q.name]) and _is_nan(output[2][q.name])
    assert output[2]["GradNorm"] == [0.0] * len(list(net.parameters()))


# ------------------------------------------------------------------ float32 overflow
def test_float32_gradients_near_1e10_match_float64_brute_force():
    """||g|| ~ 2e10 with a finite float32 loss: InnerTest was nan and OrthoTest 0 (||g||^4
    and (g_n . g)^2 overflowed); every gradient and curvature quantity against float64."""
    scale = 3e10
    net64, X64, y, cross_entropy = mlp(n=8)

    def loss_fn(out, t):
        return scale * cross_entropy(out, t)

    G = flat(per_sample_gradients(net64, X64, y, loss_fn))
    g = G.mean(0)
    H = dense_hessian(net64, X64, y, loss_fn)  # of the mean loss
    h = torch.diagonal(H)
    loss = float(loss_fn(net64(X64), y).mean().detach())
    expected = gradient_quantities(net64, X64, y, loss_fn)
    expected["CABS"] = LR * expected["_variance_sum"] / loss
    expected["GradNorm"] = float(g.norm())
    m2 = G.pow(2).mean(0)
    expected["TICDiag"] = float((m2 / (h + 1e-7)).sum())
    expected["TICTrace"] = float(m2.sum() / (h.sum() + 1e-7))
    expected["HessTrace"] = float(h.sum())
    expected["HessMaxEV"] = float(torch.linalg.eigvalsh(H)[-1])
    assert expected["GradNorm"] > 3e9
    net = copy.deepcopy(net64).float()
    names = ["NormTest", "InnerTest", "OrthoTest", "MeanGSNR", "EarlyStopping", "CABS",
             "GradNorm", "TICDiag", "TICTrace", "HessTrace", "HessMaxEV"]  # fmt: skip
    cockpit = Cockpit(net, [getattr(Q, name)() for name in names])
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = loss_fn(net(X64.float()), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 8,
            "optimizer": opt}  # fmt: skip
    with cockpit(0, info):
        losses.mean().backward(create_graph=True)
    out = cockpit.get_output()[0]
    for p in net.parameters():
        p.grad = None
    out["GradNorm"] = math.sqrt(sum(v * v for v in out["GradNorm"]))
    out["HessTrace"] = sum(out["HessTrace"])
    for name in names:
        rel = 1e-3 if name == "HessMaxEV" else 1e-4  # HessMaxEV: its tol
        assert out[name] == pytest.approx(expected[name], rel=rel), name


# ------------------------------------------------------------------ the user's reduction
def _user_loss(model, X, y, loss_fn, reduction):
    """theta (flat) -> the loss as the user reduced it."""
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]

    def f(theta):
        tensors = [t.reshape(s) for t, s in zip(theta.split([s.numel() for s in shapes]),
                                                 shapes, strict=True)]  # fmt: skip
        losses = loss_fn(functional_call(model, dict(zip(names, tensors, strict=True)), (X,)), y)
        return losses.mean() if reduction == "mean" else losses.sum()

    return f


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_hess_max_ev_and_cabs_follow_the_users_reduction(reduction):
    """HessMaxEV: the top eigenvalue of the Hessian of the user's loss (dense, by
    torch.autograd.functional.hessian); CABS: lr * sum_d Var_n(c g_{n,d}) / L, c g_n the
    gradients of the terms c l_n whose mean is the user's loss L (c = N for a sum)."""
    n = 5
    expected = {}

    def record(step, model, X, y, loss_fn):
        theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        f = _user_loss(model, X, y, loss_fn, reduction)
        H = torch.autograd.functional.hessian(f, theta)
        c = n if reduction == "sum" else 1
        terms = c * flat(per_sample_gradients(model, X, y, loss_fn))
        variance = terms.pow(2).mean(0) - terms.mean(0).pow(2)
        expected[step] = {
            "HessMaxEV": float(torch.linalg.eigvalsh(H)[-1]),
            "CABS": float(LR * variance.sum() / f(theta)),
        }

    net, X, y, loss_fn = mlp(n=n)
    cockpit = Cockpit(net, [Q.HessMaxEV(tol=1e-6, max_products=400), Q.CABS()])
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(3):
        record(step, net, X, y, loss_fn)
        opt.zero_grad(set_to_none=True)
        losses = loss_fn(net(X), y)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {"loss": loss, "individual_losses": losses, "batch_size": n, "optimizer": opt}
        with cockpit(step, info):
            loss.backward(create_graph=cockpit.create_graph(step))
        opt.step()
    for p in net.parameters():
        p.grad = None
    out = cockpit.get_output()
    for step, values in expected.items():
        assert out[step]["HessMaxEV"] == pytest.approx(values["HessMaxEV"], rel=1e-5), step
        assert out[step]["CABS"] == pytest.approx(values["CABS"], rel=1e-10), step


def _reference_cockpit(monkeypatch):
    """cockpit-for-pytorch (the test is skipped where it is not installed). Its __init__ reads
    its version with pkg_resources, which setuptools 81 and later no longer have: a stand-in
    reads it from the installed package's metadata."""
    pytest.importorskip("backpack")
    if importlib.util.find_spec("cockpit") is None:
        pytest.skip("cockpit-for-pytorch is not installed")
    if importlib.util.find_spec("pkg_resources") is None:
        stand_in = types.ModuleType("pkg_resources")
        stand_in.DistributionNotFound = importlib.metadata.PackageNotFoundError
        stand_in.get_distribution = lambda name: types.SimpleNamespace(
            version=importlib.metadata.version(name)
        )
        monkeypatch.setitem(sys.modules, "pkg_resources", stand_in)
    return pytest.importorskip("cockpit")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_hess_max_ev_and_cabs_agree_with_cockpit_for_pytorch(reduction, monkeypatch):
    reference = _reference_cockpit(monkeypatch)
    from backpack import extend
    from cockpit.quantities import CABS, HessMaxEV
    from cockpit.utils.schedules import linear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 3)).double()
    X, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))

    def one_step(net, cockpit, loss_module, create_graph):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        out = net(X)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        loss = loss_module(out, y)
        info = {"loss": loss, "individual_losses": losses, "batch_size": 6, "optimizer": opt}
        with cockpit(0, info=info):
            loss.backward(create_graph=create_graph(0))
        for p in net.parameters():
            p.grad = None
        return cockpit.get_output()[0]

    net = copy.deepcopy(model)
    cockpit = Cockpit(net, [Q.HessMaxEV(tol=1e-8, max_products=400), Q.CABS()])
    ours = one_step(net, cockpit, nn.CrossEntropyLoss(reduction=reduction), cockpit.create_graph)
    net = extend(copy.deepcopy(model))
    cockpit = reference.Cockpit(
        list(net.parameters()), quantities=[CABS(linear(1)), HessMaxEV(linear(1), use_power=False)]
    )
    loss_module = extend(nn.CrossEntropyLoss(reduction=reduction))
    theirs = one_step(net, cockpit, loss_module, cockpit.create_graph)
    assert ours["CABS"] == pytest.approx(theirs["CABS"], rel=1e-9)
    # theirs: scipy's eigsh on an operator declared float32
    assert ours["HessMaxEV"] == pytest.approx(float(theirs["HessMaxEV"]), rel=1e-5)


def test_every_quantity_says_which_loss_it_refers_to():
    phrases = ("mean loss", "as the user reduced it", "per-sample loss", "no loss")
    docs = {cls.__name__: " ".join(cls.__doc__.split()) for cls in Q.BUILTIN}
    vague = [name for name, doc in docs.items() if not any(p in doc for p in phrases)]
    assert vague == []


# ------------------------------------------------------------------ constructor arguments
BAD_ARGUMENTS = [
    (Q.HessMaxEV, {"tol": -1}, ValueError, r"HessMaxEV\(tol=-1\): tol must be .*>= 0"),
    (Q.HessMaxEV, {"tol": 1.0}, ValueError, r"tol=1.0\): tol must be .*< 1"),
    (Q.HessMaxEV, {"tol": math.nan}, ValueError, r"tol=nan\): tol must be a finite"),
    (Q.HessMaxEV, {"tol": "1e-3"}, TypeError, r"tol='1e-3'\): tol must be a finite number"),
    (Q.HessMaxEV, {"max_products": 0}, ValueError, r"max_products=0\): .* integer >= 1"),
    (Q.HessMaxEV, {"max_products": 2.5}, TypeError, r"max_products=2.5\): .* integer"),
    (Q.HessMaxEV, {"max_products": True}, TypeError, r"max_products=True\)"),
    (Q.HessMaxEV, {"seed": -1}, ValueError, r"seed=-1\): seed must be an integer >= 0"),
    (Q.HessMaxEV, {"seed": 2**32}, ValueError, r"seed=4294967296\): seed must be below"),
    (Q.HessTrace, {"curvature": "diag"}, ValueError, r"curvature='diag'\): choose one of"),
    (Q.HessTrace, {"mc_samples": 0}, ValueError, r"HessTrace\(mc_samples=0\): .* >= 1"),
    (Q.TICDiag, {"mc_samples": "2"}, TypeError, r"TICDiag\(mc_samples='2'\)"),
    (Q.TICDiag, {"seed": 0.5}, TypeError, r"TICDiag\(seed=0.5\): seed must be an integer"),
    (Q.TICTrace, {"max_probes": 0}, ValueError, r"TICTrace\(max_probes=0\): .* >= 1"),
    (Q.GradHist1d, {"bins": 0}, ValueError, r"GradHist1d\(bins=0\): bins must be"),
    (Q.GradHist1d, {"bins": 10.0}, TypeError, r"bins=10.0\): bins must be an integer"),
    (Q.GradHist1d, {"bins": True}, TypeError, r"bins=True\)"),
    (Q.GradHist1d, {"range": (0.0, math.nan)}, ValueError, r"range=\(0.0, nan\)\): range"),
    (Q.GradHist1d, {"range": (-math.inf, 1)}, ValueError, r"range=\(-inf, 1\)\): range"),
    (Q.GradHist1d, {"range": (1, 1)}, ValueError, r"range=\(1, 1\)\): .*lower < upper"),
    (Q.GradHist1d, {"range": (0,)}, TypeError, r"range=\(0,\)\): range must be a pair"),
    (Q.GradHist1d, {"range": "ab"}, TypeError, r"range='ab'\): range must be a pair"),
    (Q.GradHist1d, {"adapt": "grad"}, TypeError, r"adapt='grad'\): adapt takes"),
    (Q.GradHist2d, {"bins": 40}, TypeError, r"GradHist2d\(bins=40\): bins must be a pair"),
    (Q.GradHist2d, {"bins": (40, 0)}, ValueError, r"bins\[1\]=0\): bins\[1\] must be"),
    (Q.GradHist2d, {"range": ((-1, 1),)}, TypeError, r"range=\(\(-1, 1\),\)\): range must"),
    (Q.GradHist2d, {"range": ((-1, 1), (2, 2))}, ValueError, r"range\[1\]=\(2, 2\)\)"),
    (Q.GradHist2d, {"adapt": (None,)}, TypeError, r"adapt=\(None,\)\): adapt must be a pair"),
    (Q.GradHist2d, {"per_parameter": "yes"}, TypeError, r"per_parameter='yes'\)"),
    (Q.GradAbsMax, {"padding": -1}, ValueError, r"GradAbsMax\(padding=-1\): padding must"),
    (Q.GradAbsMax, {"padding": math.inf}, ValueError, r"padding=inf\): padding must be"),
    (Q.ParamAbsMax, {"min_size": 0}, ValueError, r"ParamAbsMax\(min_size=0\): .*> 0"),
    (Q.ParamAbsMax, {"min_size": None}, TypeError, r"min_size=None\): min_size must be"),
]


@pytest.mark.parametrize(("cls", "kwargs", "error", "match"), BAD_ARGUMENTS)
def test_bad_constructor_arguments_are_refused_naming_the_argument(cls, kwargs, error, match):
    """The error names the class, the argument, its value and the valid range; a refused
    construction leaves nothing behind (there is no instance) and draws no random number."""
    rng = torch.random.get_rng_state()
    with pytest.raises(error, match=match):
        cls(**kwargs)
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_valid_constructor_arguments_are_kept():
    q = Q.HessMaxEV(tol=0, max_products=np.int64(3), seed=2**32 - 1)
    assert (q.tol, q.max_products, q.seed) == (0.0, 3, 2**32 - 1)
    assert type(q.max_products) is int
    hist = Q.GradHist2d(bins=[3, 4], range=[[-1, 1], (0, 2.5)], per_parameter=True)
    assert hist.bins == (3, 4) and hist.range == [(-1.0, 1.0), (0.0, 2.5)]
    assert Q.GradAbsMax(padding=0, min_size=1).limits(0.1) == (-0.5, 0.5)


# ------------------------------------------------------------------ unsupported optimizers
class _Recorder:
    """A sink that keeps what it is given."""

    def __init__(self):
        self.written = []

    def write(self, step, values):
        self.written.append((step, values))

    def update_metadata(self, metadata):
        pass

    def close(self):
        pass


@pytest.mark.parametrize(
    ("optimizer", "match"),
    [
        (lambda p: torch.optim.Adam(p, lr=0.01), r"plain SGD only .* info\['optimizer'\] is Adam"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), r"plain SGD only .* momentum=0.9"),
    ],
    ids=["adam", "momentum"],
)
@pytest.mark.parametrize("name", ["CABS", "EarlyStopping"])
def test_plain_sgd_quantities_refuse_other_optimizers_on_entering_the_step(name, optimizer, match):
    """Before the backward, before any other quantity of the step: nothing is computed,
    stored, written or kept."""
    net, X, y, loss_fn = mlp(n=4)
    opt = optimizer(net.parameters())
    distance, update_size, sink = Q.Distance(), Q.UpdateSize(), _Recorder()
    cockpit = Cockpit(net, [distance, update_size, Q.NormTest(), getattr(Q, name)()],
                      sinks=[sink])  # fmt: skip
    losses = loss_fn(net(X), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 4, "optimizer": opt}
    entered = []
    with pytest.raises(ValueError, match=match):
        with cockpit(0, info):
            entered.append(True)
            losses.mean().backward()
    assert entered == [] and all(p.grad is None for p in net.parameters())
    assert cockpit.get_output() == {} and sink.written == []
    assert distance.initial is None and update_size.pending is None


def test_alpha_refuses_a_missing_optimizer_on_entering_the_step():
    net, X, y, loss_fn = mlp(n=4)
    alpha = Q.Alpha()
    cockpit = Cockpit(net, [alpha, Q.Distance()])
    losses = loss_fn(net(X), y)
    info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 4,
            "optimizer": None}  # fmt: skip
    with pytest.raises(TypeError, match=r"Alpha reads info\['optimizer'\].* got None"):
        with cockpit(0, info):
            losses.mean().backward()
    assert all(p.grad is None for p in net.parameters())
    assert cockpit.get_output() == {} and alpha.pending is None
