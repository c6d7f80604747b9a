"""A torch.compile'd model: tracked steps run eagerly and equal the uncompiled model's, the
other steps run compiled (one compilation, no recompilation after the tracked steps)."""

import copy

import pytest
import torch
from torch import nn

from avionics import Cockpit, quantities, schedules


def train(model, forward, steps):
    """SGD steps on a fixed batch; every other step (0, 2, ...) tracked."""
    torch.manual_seed(1)
    X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    every_other = schedules.linear(2)
    cockpit = Cockpit(
        forward,
        [
            quantities.Loss(schedule=every_other),
            quantities.NormTest(schedule=every_other),
            quantities.HessMaxEV(schedule=every_other, tol=1e-10),
        ],
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        losses = nn.functional.cross_entropy(forward(X), y, reduction="none")
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": 8}
        with cockpit(step, info):
            info["loss"].backward(create_graph=cockpit.create_graph(step))
        opt.step()
    for p in model.parameters():
        p.grad = None
    cockpit.close()
    return cockpit.get_output()


@pytest.mark.slow  # one compilation: tens of seconds on two shared cores
def test_a_compiled_model_is_tracked_eagerly_and_runs_compiled_otherwise():
    import torch._dynamo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    eager = copy.deepcopy(model)
    expected = train(eager, eager, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    ours = train(model, compiled, 4)
    assert sorted(ours) == [0, 2] and set(ours[2]) == {"Loss", "NormTest", "HessMaxEV"}
    for step in (0, 2):
        for name in ("Loss", "NormTest", "HessMaxEV"):
            assert ours[step][name] == pytest.approx(expected[step][name], rel=1e-5), name
    # steps 1 and 3 ran the compiled graph, compiled once
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch._dynamo.eval_frame._stance.stance == "default"  # restored by close()


def test_a_cockpit_dropped_without_close_restores_the_compiler_stance_and_its_hooks():
    """(issue 28, item 7) The stance is set on construction for the first step; a cockpit
    garbage-collected without close() lets go of it, and of the capture's global hook."""
    import gc

    import torch._dynamo

    model = nn.Sequential(nn.Linear(4, 3))
    hooks = len(torch.nn.modules.module._global_forward_hooks)
    cockpit = Cockpit(torch.compile(model), [quantities.NormTest()])
    assert torch._dynamo.eval_frame._stance.stance == "force_eager"
    del cockpit
    gc.collect()
    assert torch._dynamo.eval_frame._stance.stance == "default"
    assert len(torch.nn.modules.module._global_forward_hooks) == hooks
