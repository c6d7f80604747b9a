"""curvature="auto" chooses a curvature diagonal by the cost of a step, says so once, and
computes exactly what the variant it chose computes; errors suggest only what works."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics import Cockpit
from avionics.quantities import HessTrace, TICDiag


def tanh_mlp(width: int, classes: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, classes)).double()
    X, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, classes, (5,))
    return model, X, y


def run(model, X, y, quantities, steps=2):
    cockpit = Cockpit(model, quantities)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            losses = F.cross_entropy(model(X), y, reduction="none")
            with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses}):
                losses.mean().backward(create_graph=cockpit.create_graph(step))
            model.zero_grad()
    said = [str(w.message) for w in caught if "curvature='auto'" in str(w.message)]
    return cockpit.get_output(), said


@pytest.mark.parametrize(
    "width, classes, chosen, why",
    [
        (8, 3, "diag_h", "takes 83 Hessian-vector products"),
        (300, 3, "diag_ggn_exact", "would take 3003 Hessian-vector.*GGN diagonal takes 3"),
        (300, 100, "diag_ggn_mc", "would take 100 backward passes"),
    ],
)
def test_auto_chooses_by_cost_says_it_once_and_equals_its_choice(width, classes, chosen, why):
    model, X, y = tanh_mlp(width, classes)
    auto, said = run(model, X, y, [HessTrace(), TICDiag()])
    assert len(said) == 2  # once per quantity, not per step
    assert all(f"computes {chosen!r}" in message for message in said)
    assert any(__import__("re").search(why, message) for message in said), said
    model, X, y = tanh_mlp(width, classes)
    explicit, said = run(model, X, y, [HessTrace(curvature=chosen), TICDiag(curvature=chosen)])
    assert said == []
    for step in auto:
        for name in ("HessTrace", "TICDiag"):
            assert auto[step][name] == pytest.approx(explicit[step][name], rel=1e-12)


def test_a_piecewise_linear_network_keeps_the_exact_hessian_diagonal():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 3)).double()
    X, y = torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    _, said = run(model, X, y, [HessTrace()], steps=1)
    assert "computes 'diag_h'" in said[0] and "piecewise linear" in said[0]


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 3))

    def forward(self, x):
        out = self.body(x)
        return out, 2 * out


def test_the_too_costly_exact_diagonal_suggests_only_what_works():
    model, X, y = tanh_mlp(300, 3)
    with pytest.raises(ValueError, match="What works for this model: curvature='diag_ggn_exact'"):
        run(model, X, y, [HessTrace(curvature="diag_h", max_probes=100)], steps=1)
    model = TwoOutputs().double()  # no single output tensor: no GGN diagonal runs
    cockpit = Cockpit(model, [HessTrace(curvature="diag_h", max_probes=100)])
    losses = F.cross_entropy(model(X)[0], y, reduction="none")
    with pytest.raises(
        ValueError, match="What works for this model: max_probes=[0-9]+ to accept the cost\\."
    ):
        with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses}):
            losses.mean().backward(create_graph=True)


@pytest.mark.parametrize(
    "width, classes, curvature, message",
    [
        (300, 3, "diag_h", r"3003 Hessian-vector products per step .*max_probes=3003 to"),
        (4, 5000, "diag_ggn_exact", r"5000 here .*curvature='diag_ggn_mc'"),
    ],
)
def test_a_costly_variant_is_refused_before_the_backward(width, classes, curvature, message):
    """The cost is known from the forward: the step is refused on entering the block, before
    the user's (create_graph) backward runs, and nothing is stored or left on the model."""
    model, X, y = tanh_mlp(width, classes)
    cockpit = Cockpit(model, [HessTrace(curvature=curvature, max_probes=1000)])
    losses = F.cross_entropy(model(X), y, reduction="none")
    ran = []
    with pytest.raises(ValueError, match=message):
        with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses}):
            ran.append(True)
    assert ran == [] and cockpit.get_output() == {}
    assert all(p.grad is None for p in model.parameters())


def test_through_a_recurrent_module_each_product_counts_as_a_backward_pass():
    """An LSTM's exact Hessian diagonal (1288 products, each about a backward pass or more
    through the LSTM's double backward) is beyond the 64 backward passes of the budget:
    "auto" takes the exact GGN diagonal (32 output entries a sample), says why, and computes
    exactly what curvature="diag_ggn_exact" computes."""
    from tests import real_models

    outputs, said = [], []
    for curvature in ("auto", "diag_ggn_exact"):
        model, X, y, loss_fn = real_models.lstm_lm(n=3, t=4, vocab=8)
        model.eval()
        cockpit = Cockpit(model, [HessTrace(curvature=curvature), TICDiag(curvature=curvature)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                losses = loss_fn(model(X), y)
                with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses}):
                    losses.mean().backward(create_graph=cockpit.create_graph(step))
                model.zero_grad()
        said.append([str(w.message) for w in caught if "curvature='auto'" in str(w.message)])
        outputs.append(cockpit.get_output())
    assert len(said[0]) == 2 and said[1] == []
    assert all("computes 'diag_ggn_exact'" in m for m in said[0]), said[0]
    assert all("double backward of 'lstm' (LSTM)" in m for m in said[0]), said[0]
    for step in outputs[1]:
        for name in ("HessTrace", "TICDiag"):
            assert outputs[0][step][name] == pytest.approx(outputs[1][step][name], rel=1e-12)


def test_the_choice_is_said_at_the_users_with_line():
    """The warning points at the user's `with cockpit(...)` line, not into the cockpit."""
    model, X, y = tanh_mlp(8, 3)
    cockpit = Cockpit(model, [HessTrace()])
    losses = F.cross_entropy(model(X), y, reduction="none")
    info = {"loss": losses.mean(), "individual_losses": losses}
    with pytest.warns(UserWarning, match="curvature='auto'") as said:
        line = inspect.currentframe().f_lineno + 1
        with cockpit(0, info=info):
            losses.mean().backward(create_graph=cockpit.create_graph(0))
    (warning,) = [w for w in said if "curvature='auto'" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, line)
