"""ActivationHealth against a direct count on the activations, hooked by the test itself, in
float64: ReLU (also in place), GELU, Tanh, Sigmoid, Hardtanh on an MLP and a CNN, with a layer
made dead on purpose; only the backpropagated forward counts; the capture keeps no output."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics import Cockpit
from avionics.dashboard.health import activation_layers, plot_health
from avionics.persample import Capture, Request
from avionics.quantities import ActivationHealth, UpdateRatio
from avionics.quantities.activation_health import (
    ACTIVATIONS,
    CallSummary,
    is_activation,
    output_summary,
    packed_sums,
)
from avionics.records import Run
from avionics.records.reader import as_run


def mlp(dead_bias: float | None = None):
    """Linear-ReLU-Linear-GELU-Linear-Tanh-Linear-Sigmoid-Linear-Hardtanh-Linear, float64,
    with 3 of the 8 ReLU units dead and the saturating ones partly saturated; ``dead_bias``
    sets the whole first bias (a large negative one kills every ReLU unit)."""
    torch.manual_seed(0)
    widths = [6, 8, 7, 6, 5, 5, 3]
    activations = [nn.ReLU(inplace=True), nn.GELU(), nn.Tanh(), nn.Sigmoid(), nn.Hardtanh()]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(activations):
            layers.append(activations[i])
    model = nn.Sequential(*layers).double()
    with torch.no_grad():
        model[0].bias[:3] = -30.0  # 3 of the 8 ReLU units dead
        for i in (4, 6, 8):  # saturate the tanh, sigmoid and hardtanh partly
            model[i].weight.mul_(8)
        if dead_bias is not None:
            model[0].bias.fill_(dead_bias)
    return model, 3 * torch.randn(10, 6, dtype=torch.float64)


def cnn():
    """Conv-ReLU (one channel dead) - Conv-Sigmoid - Linear, float64."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 3, 3, stride=2, padding=1),
        nn.Sigmoid(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 3),
    ).double()
    with torch.no_grad():
        model[0].bias[1] = -100.0  # channel 1: every (row, column) unit dead
        model[2].weight.mul_(30)
    return model, torch.randn(7, 2, 8, 8, dtype=torch.float64)


def saturated(module, y):
    if isinstance(module, nn.Tanh):
        return y.abs() > 0.99
    if isinstance(module, nn.Sigmoid):
        return (y < 0.01) | (y > 0.99)
    if isinstance(module, nn.Hardtanh):
        return (y <= -1) | (y >= 1)
    return None


def brute_force(model, outputs):
    """The statistics of each hooked output y [N, *units], one module at a time."""
    names = {m: name for name, m in model.named_modules()}
    expected = {}
    for module, y in outputs:
        flat = y.reshape(len(y), -1)
        value = {
            "dead": float((flat == 0).all(0).double().mean()),
            "mean": float(flat.mean()),
            "rms": float(flat.square().mean().sqrt()),
        }
        mask = saturated(module, flat)
        if mask is not None:
            value["saturated"] = float(mask.double().mean())
        expected[names[module]] = value
    return expected


def hooked_step(model, X, optimizer, cockpit, step, other=None):
    """One training step under ``cockpit``; the activations as the test's own hooks saw them.
    ``other``: a model (an EMA copy) whose forward, with gradients on, runs before the step's
    forward and between it and the step, as a training loop's EMA or teacher would."""
    outputs = []

    def keep(module, args, output):
        outputs.append((module, output.detach().clone()))

    if other is not None:
        other(X)
    activations = [m for m in model.modules() if is_activation(m)]
    handles = [m.register_forward_hook(keep) for m in activations]
    y = torch.arange(len(X)) % 3
    optimizer.zero_grad()
    losses = F.cross_entropy(model(X), y, reduction="none")
    for handle in handles:
        handle.remove()
    if other is not None:
        other(X)
    with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses}):
        losses.mean().backward()
    optimizer.step()
    return outputs


def assert_matches(value, expected):
    assert list(value) == list(expected)
    for name, stats in expected.items():
        assert value[name].keys() == stats.keys(), name
        for key, number in stats.items():
            assert value[name][key] == pytest.approx(number, rel=1e-12, abs=1e-15), (name, key)


@pytest.mark.parametrize("build", [mlp, cnn], ids=["mlp", "cnn"])
def test_activation_health_equals_a_direct_count(build):
    model, X = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model, [ActivationHealth()])
    for step in range(3):
        outputs = hooked_step(model, X, optimizer, cockpit, step)
        assert_matches(cockpit.get_output()[step]["ActivationHealth"], brute_force(model, outputs))
    cockpit.close()


def test_a_layer_with_a_large_negative_bias_is_all_dead():
    model, X = mlp(dead_bias=-1000.0)
    cockpit = Cockpit(model, [ActivationHealth()])
    hooked_step(model, X, torch.optim.SGD(model.parameters(), lr=0.05), cockpit, 0)
    value = cockpit.get_output()[0]["ActivationHealth"]
    assert value["1"] == {"dead": 1.0, "mean": 0.0, "rms": 0.0}
    assert value["3"]["dead"] == 0.0  # GELU's output is not exactly zero
    cockpit.close()


def test_the_conv_map_s_units_are_its_channel_row_column_positions():
    model, X = cnn()
    cockpit = Cockpit(model, [ActivationHealth()])
    hooked_step(model, X, torch.optim.SGD(model.parameters(), lr=0.05), cockpit, 0)
    # channel 1 of 4 is dead everywhere; no other unit is zero for all 7 samples
    assert cockpit.get_output()[0]["ActivationHealth"]["1"]["dead"] == pytest.approx(0.25)
    cockpit.close()


def test_only_the_forward_the_loss_came_from_counts():
    """A forward with gradients on but never backpropagated (an evaluation pass) and one
    under no_grad leave the statistics of the training forward as they are."""
    model, X = mlp()
    cockpit = Cockpit(model, [ActivationHealth()])
    model(torch.randn(4, 6, dtype=torch.float64) - 50)  # would make units dead
    with torch.no_grad():
        model(torch.zeros(3, 6, dtype=torch.float64))
    outputs = hooked_step(model, X, torch.optim.SGD(model.parameters(), lr=0.05), cockpit, 0)
    assert_matches(cockpit.get_output()[0]["ActivationHealth"], brute_force(model, outputs))
    cockpit.close()


def test_another_model_s_forward_between_the_steps_is_not_counted():
    """An EMA copy (the same module types, other objects) runs a forward with gradients on
    before and inside each tracked step's window: only the tracked model's modules count."""
    model, X = mlp()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        ema[0].bias.fill_(-1000.0)  # its units would all be dead
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model, [ActivationHealth()])
    for step in range(2):
        outputs = hooked_step(model, X, optimizer, cockpit, step, other=ema)
        assert_matches(cockpit.get_output()[step]["ActivationHealth"], brute_force(model, outputs))
    cockpit.close()


def hf_activations():
    """Linear layers between Hugging Face's activation modules (transformers.activations)."""
    from transformers import activations

    torch.manual_seed(0)
    kinds = [
        activations.NewGELUActivation(),
        activations.GELUActivation(),
        activations.FastGELUActivation(),
        activations.QuickGELUActivation(),
        activations.ReLUSquaredActivation(),
    ]
    layers: list[nn.Module] = [nn.Linear(6, 5)]
    for kind in kinds:
        layers += [kind, nn.Linear(5, 5)]
    layers.append(nn.Linear(5, 3))
    return nn.Sequential(*layers).double(), 3 * torch.randn(8, 6, dtype=torch.float64)


def test_hugging_face_activation_modules_are_watched():
    from transformers.activations import LinearActivation

    model, X = hf_activations()
    assert not is_activation(LinearActivation())  # the identity
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model, [ActivationHealth()])
    outputs = hooked_step(model, X, optimizer, cockpit, 0)
    value = cockpit.get_output()[0]["ActivationHealth"]
    assert list(value) == ["1", "3", "5", "7", "9"]
    assert_matches(value, brute_force(model, outputs))
    assert value["9"]["dead"] > 0  # ReLU^2 has dead units; the GELUs have none
    cockpit.close()


class Encoder(nn.Module):
    def __init__(self, activation):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=activation)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def test_a_transformer_encoder_s_functional_activation_is_named_once():
    """nn.TransformerEncoderLayer applies F.relu as a function: not seen, said once with the
    fix; given activation=nn.GELU() (a module), each layer's activation is watched."""
    torch.manual_seed(0)
    X = torch.randn(5, 4, 8, dtype=torch.float64)
    model = Encoder("relu").double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model, [ActivationHealth()])
    with pytest.warns(UserWarning, match=r"'encoder.layers.0', 'encoder.layers.1'.*activation="):
        hooked_step(model, X, optimizer, cockpit, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        hooked_step(model, X, optimizer, cockpit, 1)
    cockpit.close()
    model = Encoder(nn.GELU()).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model, [ActivationHealth()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        outputs = hooked_step(model, X, optimizer, cockpit, 0)
    value = cockpit.get_output()[0]["ActivationHealth"]
    assert list(value) == ["encoder.layers.0.activation", "encoder.layers.1.activation"]
    assert_matches(value, brute_force(model, outputs))
    cockpit.close()


def test_the_capture_keeps_no_activation():
    """What the capture keeps of the activation modules' calls is their summary: small
    tensors, of one number per unit at most, none of them the output itself."""
    model, X = mlp()
    capture = Capture(model, [m for m in model if isinstance(m, nn.Linear)])
    capture.arm(Request(module_outputs=(output_summary,)))
    model(X)
    capture.disarm()
    (root,) = [c for c in capture.calls if c.module is model]
    assert [type(m) for _, m, _ in root.summaries] == [
        nn.ReLU,
        nn.GELU,
        nn.Tanh,
        nn.Sigmoid,
        nn.Hardtanh,
    ]
    assert all(not isinstance(c.module, ACTIVATIONS) for c in capture.calls)
    for _, module, summary in root.summaries:
        assert summary.alive.shape == (module_width(model, module),)
        assert summary.total.shape == summary.squares.shape == ()
    capture.release()


def module_width(model, module) -> int:
    index = list(model).index(module)
    return model[index - 1].out_features


def test_the_cockpit_arms_its_capture_with_the_step_s_request():
    model, X = mlp()
    cockpit = Cockpit(model, [ActivationHealth()])
    outputs = hooked_step(model, X, torch.optim.SGD(model.parameters(), lr=0.05), cockpit, 0)
    assert_matches(cockpit.get_output()[0]["ActivationHealth"], brute_force(model, outputs))


def test_the_health_screen_draws_what_the_run_recorded(tmp_path):
    """plot_health: the dead and saturated heat-maps hold the recorded fractions, module by
    module; the update-ratio panel has a line per weight, the global ratio and the band."""
    model, X = mlp(dead_bias=-1000.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    cockpit = Cockpit(model, [ActivationHealth(), UpdateRatio()])
    for step in range(4):
        hooked_step(model, X, optimizer, cockpit, step)
    cockpit.close()
    output = cockpit.get_output()
    run = as_run(cockpit)
    dead = activation_layers(run, "dead")
    assert dead.labels == ["1", "3", "5", "7", "9"]
    assert dead.steps.tolist() == [0, 1, 2, 3]
    expected = [[output[s]["ActivationHealth"][m]["dead"] for s in range(4)] for m in dead.labels]
    assert dead.values.tolist() == expected and dead.values[0].tolist() == [1.0] * 4
    saturated = activation_layers(run, "saturated")
    assert saturated.labels == ["5", "7", "9"]  # Tanh, Sigmoid, Hardtanh
    fig = plot_health(cockpit, tmp_path / "health.png")
    assert (tmp_path / "health.png").stat().st_size > 0
    titles = [ax.get_title() for ax in fig.axes]
    for title in ("Dead units per module", "Saturated values per module", "Activation RMS"):
        assert title in titles
    (ratio,) = [ax for ax in fig.axes if ax.get_title() == "Update-to-weight ratio"]
    labels = [line.get_label() for line in ratio.get_lines()]
    assert labels == [f"{i}.weight" for i in range(0, 12, 2)] + ["global"]
    assert ratio.get_lines()[-1].get_ydata().tolist() == [
        output[s]["UpdateRatio"]["global"] for s in range(3)
    ]


def test_the_health_screen_of_a_run_without_them_names_what_to_add():
    fig = plot_health(Run.from_output({0: {"Loss": 1.0}}))
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "no data\n(needs UpdateRatio())" in texts
    assert texts.count("no data\n(needs ActivationHealth())") == 3


def test_a_model_without_activation_modules_is_warned_of_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    X = torch.randn(5, 4, dtype=torch.float64)
    cockpit = Cockpit(model, [ActivationHealth()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(
        UserWarning, match=r"no activation module .* \(F.relu\(x\)\) is not a module"
    ):
        hooked_step(model, X, optimizer, cockpit, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hooked_step(model, X, optimizer, cockpit, 1)
    assert cockpit.get_output()[1]["ActivationHealth"] == {}
    cockpit.close()


def data_parallel_rank(rank, world, sizes):
    """One process of a DDP run of :func:`mlp` on its shard (``sizes[rank]`` samples of the
    batch): ActivationHealth and UpdateRatio of each step."""
    model, X = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    start = sum(sizes[:rank])
    X = X[start : start + sizes[rank]]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(ddp, [ActivationHealth(), UpdateRatio()])
    for step in range(2):
        y = torch.arange(start, start + len(X)) % 3
        optimizer.zero_grad()
        losses = F.cross_entropy(ddp(X), y, reduction="none")
        with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses}):
            losses.mean().backward()
        optimizer.step()
    cockpit.close()
    return cockpit.get_output()


@pytest.mark.slow
def test_under_ddp_the_statistics_are_the_global_batch_s(tmp_path):
    """Two processes with 5 of the 10 samples each (equal shards: DDP's update is then the
    global batch's): the fractions, means and RMS of the whole batch, and UpdateRatio, as
    one process on the whole batch has them."""
    from spawned import on_ranks

    model, X = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cockpit = Cockpit(model, [ActivationHealth(), UpdateRatio()])
    expected = [brute_force(model, hooked_step(model, X, optimizer, cockpit, s)) for s in (0, 1)]
    cockpit.close()
    ratio = cockpit.get_output()[0]["UpdateRatio"]
    for output in on_ranks(data_parallel_rank, 2, tmp_path, (5, 5)):
        for step in (0, 1):
            assert_matches(output[step]["ActivationHealth"], expected[step])
        assert output[0]["UpdateRatio"]["global"] == pytest.approx(ratio["global"], rel=1e-12)


class MixedDtypes(nn.Module):
    """Activations of different widths and dtypes, one of them called twice: Linear(6, 8)
    float64 - ReLU - Linear(8, 5) float32 - Tanh - Linear(5, 7) float32 - the same ReLU -
    Linear(7, 4) bfloat16 - Sigmoid - Linear(4, 3) float64. Each layer's outputs are shifted
    apart so that a mixed-up layer cannot match another's statistics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8).double()
        self.relu = nn.ReLU()
        self.b = nn.Linear(8, 5)
        self.tanh = nn.Tanh()
        self.c = nn.Linear(5, 7)
        self.d = nn.Linear(7, 4).bfloat16()
        self.sigmoid = nn.Sigmoid()
        self.e = nn.Linear(4, 3).double()
        with torch.no_grad():
            self.a.bias[:2] = -50.0  # 2 of the first call's 8 ReLU units dead
            self.b.weight.mul_(6)  # the tanh partly saturated
            self.c.bias.fill_(-1.5)  # the second ReLU call mostly dead
            self.d.bias.fill_(3.0)  # the sigmoid partly saturated

    def forward(self, x):
        x = self.relu(self.a(x)).float()
        x = self.relu(self.c(self.tanh(self.b(x))))
        return self.e(self.sigmoid(self.d(x.bfloat16())).double())


def combined_brute_force(model, outputs):
    """Per module, in float64: its calls' outputs [N, units_c] side by side (a call's units
    are its own), as one output of the module docstring's statistics."""
    names = {m: name for name, m in model.named_modules()}
    calls: dict = {}
    for module, y in outputs:
        calls.setdefault(module, []).append(y.double().reshape(len(y), -1))
    expected = {}
    for module, ys in calls.items():
        flat = torch.cat(ys, dim=1)
        value = {
            "dead": float((flat == 0).all(0).double().mean()),
            "mean": float(flat.mean()),
            "rms": float(flat.square().mean().sqrt()),
        }
        mask = saturated(module, flat)
        if mask is not None:
            value["saturated"] = float(mask.double().mean())
        expected[names[module]] = value
    return expected


def test_the_packed_statistics_keep_layers_of_other_sizes_and_dtypes_apart():
    """All calls are reduced together (two packed tensors a step): each module's statistics
    are still its own calls' (a module called twice adds its calls), against the per-layer
    definition in float64; the sums of the float32 and bfloat16 outputs are theirs as
    rounded in their dtype (relative 1e-5, 1e-2: far below the layers' differences)."""
    model = MixedDtypes()
    X = 3 * torch.randn(16, 6, dtype=torch.float64)
    y = torch.arange(16) % 3
    cockpit = Cockpit(model, [ActivationHealth()])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        outputs = []
        modules = [model.relu, model.tanh, model.sigmoid]
        handles = [
            m.register_forward_hook(lambda m, a, o, kept=outputs: kept.append((m, o.detach())))
            for m in modules
        ]
        optimizer.zero_grad()
        losses = F.cross_entropy(model(X), y, reduction="none")
        for handle in handles:
            handle.remove()
        with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses}):
            losses.mean().backward()
        optimizer.step()
        value = cockpit.get_output()[step]["ActivationHealth"]
        expected = combined_brute_force(model, outputs)
        assert list(value) == ["relu", "tanh", "sigmoid"]
        assert value["relu"]["dead"] > 0 and 0 < value["tanh"]["saturated"] < 1
        for name, rel in (("relu", 1e-5), ("tanh", 1e-5), ("sigmoid", 1e-2)):
            assert value[name].keys() == expected[name].keys()
            for key in ("dead", "saturated"):  # counts: exact
                assert value[name].get(key) == expected[name].get(key), (name, key)
            for key in ("mean", "rms"):
                assert value[name][key] == pytest.approx(expected[name][key], rel=rel), name
    cockpit.close()


def test_packed_sums_widen_each_count_from_its_own_dtype():
    """A saturated count above 2^24 (which float32 would round) is packed exactly beside
    the float64 sums, in call order."""
    double = torch.float64
    summaries = [
        CallSummary(torch.tensor([3, 0]), torch.tensor(1.5, dtype=double),
                    torch.tensor(0.25, dtype=double), torch.tensor(2**40 + 1), 2**41),
        CallSummary(torch.tensor([[0, 2]]), torch.tensor(-2.5, dtype=double),
                    torch.tensor(9.0, dtype=double), 0, 4),
    ]  # fmt: skip
    sums = packed_sums(summaries)
    assert sums["alive"].tolist() == [3, 0, 0, 2]
    assert sums["moments"].dtype == double
    assert sums["moments"].tolist() == [1.5, -2.5, 0.25, 9.0, 2.0**40 + 1]
