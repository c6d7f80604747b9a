"""UpdateRatio against ||theta_{t+1} - theta_t|| / ||theta_t|| computed from copies of the
parameters taken by the test, in float64, for plain SGD, momentum SGD and Adam."""

from __future__ import annotations

import math

import models
import pytest
import torch

from avionics import Cockpit
from avionics.quantities import UpdateRatio, UpdateSize
from avionics.quantities.outputs import PER_LAYER
from avionics.schedules import linear

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
}


def train(model, X, y, loss_fn, optimizer, quantities, steps):
    """Train ``steps`` steps under a cockpit; the parameters before each step and after the
    last, as copies."""
    cockpit = Cockpit(model, quantities)
    history = [[p.detach().clone() for p in model.parameters()]]
    for step in range(steps):
        optimizer.zero_grad()
        losses = loss_fn(model(X), y)
        info = {"loss": losses.mean(), "batch_size": len(X), "optimizer": optimizer}
        with cockpit(step, info=info):
            losses.mean().backward()
        optimizer.step()
        history.append([p.detach().clone() for p in model.parameters()])
    cockpit.close()
    return cockpit.get_output(), history


def brute_force(before, after):
    """(global ratio, per-parameter ratios), float64, one flattened vector at a time."""
    per_parameter = [float((a - b).norm() / b.norm()) for a, b in zip(after, before)]
    delta = torch.cat([(a - b).flatten() for a, b in zip(after, before)])
    theta = torch.cat([b.flatten() for b in before])
    return float(delta.norm() / theta.norm()), per_parameter


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_update_ratio_equals_brute_force(name):
    model, X, y, loss_fn = models.mlp(n=6)
    optimizer = OPTIMIZERS[name](model.parameters())
    output, history = train(model, X, y, loss_fn, optimizer, [UpdateRatio()], steps=4)
    assert sorted(s for s in output if "UpdateRatio" in output[s]) == [0, 1, 2]
    for step in (0, 1, 2):
        value = output[step]["UpdateRatio"]
        total, per_parameter = brute_force(history[step], history[step + 1])
        assert value["global"] == pytest.approx(total, rel=1e-12)
        assert value["per_parameter"] == pytest.approx(per_parameter, rel=1e-12)
        assert PER_LAYER.scalar(value) == pytest.approx(total, rel=1e-12)


def test_update_ratio_is_update_size_over_parameter_norm_on_a_sparse_schedule():
    """A start every third step ends at the next tracked step (the one after it), as
    UpdateSize does; the ratio is UpdateSize divided by ||theta_t|| of each parameter."""
    model, X, y, loss_fn = models.cnn()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    quantities = [UpdateRatio(linear(3)), UpdateSize(linear(3))]
    output, history = train(model, X, y, loss_fn, optimizer, quantities, steps=5)
    assert sorted(s for s in output if "UpdateRatio" in output[s]) == [0, 3]
    for step in (0, 3):
        sizes = output[step]["UpdateSize"]
        norms = [float(p.norm()) for p in history[step]]
        expected = [s / n for s, n in zip(sizes, norms)]
        assert output[step]["UpdateRatio"]["per_parameter"] == pytest.approx(expected, rel=1e-12)
        total = math.sqrt(sum(s * s for s in sizes) / sum(n * n for n in norms))
        assert output[step]["UpdateRatio"]["global"] == pytest.approx(total, rel=1e-12)


def test_a_zero_parameter_has_no_ratio_and_is_left_out_of_the_global_one():
    """Biases initialised to zero: at step 0 their ratio is nan (undefined, not inf) and the
    global ratio is that of the other parameters; at step 1 they have moved and count."""
    model, X, y, loss_fn = models.mlp(n=6)
    biases = [k for k, (name, _) in enumerate(model.named_parameters()) if "bias" in name]
    assert biases
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            if k in biases:
                p.zero_()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    output, history = train(model, X, y, loss_fn, optimizer, [UpdateRatio()], steps=3)
    first = output[0]["UpdateRatio"]
    weights = [k for k in range(len(history[0])) if k not in biases]
    assert all(math.isnan(first["per_parameter"][k]) for k in biases)
    _, per_parameter = brute_force(history[0], history[1])
    assert [first["per_parameter"][k] for k in weights] == pytest.approx(
        [per_parameter[k] for k in weights], rel=1e-12
    )
    delta = torch.cat([(history[1][k] - history[0][k]).flatten() for k in weights])
    theta = torch.cat([history[0][k].flatten() for k in weights])
    assert first["global"] == pytest.approx(float(delta.norm() / theta.norm()), rel=1e-12)
    assert math.isfinite(PER_LAYER.scalar(first))
    total, per_parameter = brute_force(history[1], history[2])  # every bias has moved
    assert output[1]["UpdateRatio"]["global"] == pytest.approx(total, rel=1e-12)
    assert output[1]["UpdateRatio"]["per_parameter"] == pytest.approx(per_parameter, rel=1e-12)
