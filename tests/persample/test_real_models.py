"""The per-sample engine and the presets on models as users bring them (tests/real_models.py).

A BasicBlock ResNet, the Hugging Face GPT-2 (a position table looked up by arange(T), a tied
head), an nn.TransformerEncoder classifier (padding masks, attention dropout, a position
parameter added in the root's forward): per-sample gradients equal a loop over samples in
float64, in eval and in train mode with dropout; no module takes the generic rule (so no
whole-model re-run and no per-sample loop); every preset runs a step in float32 with finite
values; the curvature diagonals equal the dense Hessian on small versions.
"""

import copy
import warnings
from contextlib import contextmanager

import models
import pytest
import real_models
import torch
from acceptance import PRESETS, TINY, assert_the_preset_ran, finite, optimizer_for
from test_engine import assert_exact
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from avionics import Cockpit, configuration
from avionics.persample import PerSampleEngine
from avionics.persample.rules import AttentionRule, EmbeddingRule, GenericRule
from avionics.persample.rules.broadcast import SharedParameterRule
from avionics.quantities import HessTrace, TICDiag

SMALL = {
    "resnet": lambda **kw: real_models.basic_block_resnet(n=4, image=8, **kw),
    "gpt2": lambda **kw: real_models.tiny_gpt2(n=3, t=6, width=16, **kw),
    "encoder": lambda **kw: real_models.transformer_encoder(n=3, t=6, width=16, **kw),
}


@pytest.fixture
def rules(monkeypatch):
    """The rules each captured step builds: {module name: rule class}."""
    built = {}
    step = PerSampleEngine.step

    def spy(engine, *args, **kwargs):
        captured = step(engine, *args, **kwargs)
        built.update({engine.module_name(m): type(r) for m, r in captured.rules.items()})
        return captured

    monkeypatch.setattr(PerSampleEngine, "step", spy)
    return built


@contextmanager
def quiet():
    """Warnings as errors: no slow path, no rerouting, no samples said to be coupled."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*BatchNorm.*statistics of the whole batch")
        yield


@pytest.mark.parametrize("name", sorted(SMALL))
def test_per_sample_gradients_equal_brute_force_in_eval_mode(name, rules):
    model, X, y, loss_fn = SMALL[name]()
    with quiet():
        assert_exact(model.eval(), X, y, loss_fn)
    assert GenericRule not in rules.values(), rules


def test_the_shared_tables_and_the_attention_take_closed_forms(rules):
    model, X, y, loss_fn = SMALL["gpt2"]()
    assert_exact(model.eval(), X, y, loss_fn)
    assert rules["transformer.wpe"] is EmbeddingRule  # looked up by arange(T)
    rules.clear()
    model, X, y, loss_fn = SMALL["encoder"]()
    assert_exact(model.eval(), X, y, loss_fn)
    assert rules["encoder.layers.0.self_attn"] is AttentionRule
    assert rules["the model"] is SharedParameterRule  # pos, added in the root's forward


@pytest.mark.parametrize("name", ["gpt2", "encoder"])
def test_train_mode_with_dropout_equals_brute_force(name, monkeypatch):
    """Dropout modules, the attention's own dropout (drawn again from the call's random state)
    and the root's position parameter: exact per-sample gradients of the masks drawn."""
    model, X, y, loss_fn = SMALL[name]()
    model.train()
    for m in model.modules():  # dropout strong enough that another mask would show
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.5
        if isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.5
    state = torch.get_rng_state()
    brute_force = models.per_sample_gradients

    def same_masks(*args):  # the brute force's forward draws the captured forward's masks
        torch.set_rng_state(state)
        return brute_force(*args)

    monkeypatch.setattr(models, "per_sample_gradients", same_masks)
    with quiet():
        assert_exact(model, X, y, loss_fn)


PRESET_RUNS = [
    pytest.param(
        name, preset, marks=[pytest.mark.slow] if (name, preset) == ("resnet", "full") else []
    )
    for name in sorted(SMALL)
    for preset in ("economy", "business", "full")
]


def tracked_backward(cockpit, step, model, X, y, loss_fn, optimizer) -> None:
    """``step`` tracked: the forward, and its backward with the graph the cockpit asks for
    (no update)."""
    losses = loss_fn(model(X), y)
    loss = losses.mean()
    info = {
        "loss": loss,
        "individual_losses": losses,
        "batch_size": len(losses),
        "optimizer": optimizer,
    }
    with cockpit(step, info):
        loss.backward(create_graph=cockpit.create_graph(step))


def first_step(cockpit, model, X, y, loss_fn, optimizer) -> dict:
    """Step 0 tracked (:func:`tracked_backward`): its values."""
    tracked_backward(cockpit, 0, model, X, y, loss_fn, optimizer)
    return cockpit.get_output()[0]


@pytest.mark.parametrize(("name", "preset"), PRESET_RUNS)
def test_every_preset_runs_a_step_in_float32(name, preset):
    model, X, y, loss_fn = SMALL[name](dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cockpit = Cockpit(model, quantities=configuration(preset))
        output = first_step(cockpit, model, X, y, loss_fn, optimizer)
        cockpit.close()
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "one sample at a time" in m], messages
    assert not [m for m in messages if "do not sum to the batch gradient" in m], messages
    expected = {q.__class__.__name__ for q in configuration(preset)} - {"Alpha", "UpdateSize"}
    assert expected <= set(output), (expected, set(output))  # (Alpha: after the update)
    assert all(finite(output[q]) for q in expected), output


def _dense_hessian_diagonal(model, X, y, loss_fn) -> torch.Tensor:
    """diag of the Hessian of the mean loss, by torch.autograd.functional.hessian."""
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def mean_loss(theta):
        tensors = [t.reshape(s) for t, s in zip(theta.split([s.numel() for s in shapes]), shapes)]
        return loss_fn(functional_call(model, dict(zip(names, tensors)), (X,)), y).mean()

    return torch.autograd.functional.hessian(mean_loss, flat, vectorize=True).diagonal()


@pytest.mark.slow  # (about 20 s each: D Hessian-vector products, and the dense Hessian)
@pytest.mark.parametrize(
    "build",
    [
        lambda: real_models.recurrent("gru", packed=True, batch_first=False, n=3, t=4),
        lambda: real_models.transformer_encoder(n=3, t=4, width=4),
    ],
    ids=["gru_packed", "encoder"],
)
def test_hessian_trace_and_tic_diagonal_equal_the_dense_hessian(build):
    model, X, y, loss_fn = build()
    model.eval()
    with sdpa_kernel(SDPBackend.MATH):  # (the fused attention kernels have no double backward)
        h = _dense_hessian_diagonal(model, X, y, loss_fn)
        quantities = [HessTrace(curvature="diag_h"), TICDiag(curvature="diag_h")]
        cockpit = Cockpit(model, quantities=quantities)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        output = first_step(cockpit, model, X, y, loss_fn, optimizer)
    sizes = [p.numel() for p in model.parameters()]
    traces = torch.stack([d.sum() for d in h.split(sizes)])
    torch.testing.assert_close(
        torch.tensor(output["HessTrace"], dtype=torch.float64), traces, rtol=1e-7, atol=1e-10
    )
    # TICDiag = sum_d E[g_d^2] / (h_d + eps), eps = 1e-7 (docs/definitions.md, section 9)
    g = models.per_sample_gradients(model, X, y, loss_fn)
    m2 = torch.cat([t.pow(2).mean(0).reshape(-1) for t in g])
    assert output["TICDiag"] == pytest.approx(float((m2 / (h + 1e-7)).sum()), rel=1e-6)


def test_a_parameter_the_root_multiplies_by_takes_a_closed_form(rules):
    """models.custom's temperature multiplies the output in the root's forward: sample n's
    gradient is (dh_n * h_n) summed to its shape, with no re-run and no warning."""
    model, X, y, loss_fn = models.custom(n=3)
    with quiet():
        assert_exact(model, X, y, loss_fn)
    assert rules["the model"] is SharedParameterRule


def test_a_parameter_without_a_closed_form_says_it_reruns_the_whole_model():
    """A root parameter that enters through a matrix product (torch.diag(p)) has none: the
    root's generic rule re-runs the model under vmap, and says so once."""

    class Diagonal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 3)
            self.gain = torch.nn.Parameter(torch.rand(3) + 0.5)

        def forward(self, x):
            return self.body(x) @ torch.diag(self.gain)

    torch.manual_seed(0)
    model = Diagonal().double()
    X, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    with pytest.warns(UserWarning, match=r"gain \(used directly in the model's forward\)"):
        engine = assert_exact(model, X, y, real_models._classification_losses)
    with warnings.catch_warnings():  # once per engine
        warnings.simplefilter("error")
        engine.warn_slow_path(model, ["gain"], None, 0.1, 3)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_a_vit_s_class_token_and_position_table_take_closed_forms(mode, rules):
    """The class token (expanded along the batch, concatenated with the patches) and the
    position table (added) of the root: exact per-sample gradients against the loop over
    samples in float64, no generic rule, no warning."""
    model, X, y, loss_fn = real_models.vit(n=3)
    getattr(model, mode)()
    with quiet():
        assert_exact(model, X, y, loss_fn)
    assert rules["the model"] is SharedParameterRule
    assert GenericRule not in rules.values(), rules


def test_a_parameter_no_forward_uses_has_zero_per_sample_gradients(rules):
    """A root parameter and a whole submodule that the forward never calls: zero per-sample
    gradients, no re-run, no "used directly" warning; the others' exact."""
    from avionics.persample import Request

    model, X, y, loss_fn = real_models.vit(n=3)
    model.unused = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    model.spare = torch.nn.Linear(4, 2).double()
    model.eval()
    params = list(model.parameters())
    engine = PerSampleEngine(model, params)
    capture = engine.capture()
    with quiet():
        capture.arm()
        losses = loss_fn(model(X), y)
        capture.disarm()
        capture.record_gradients()
        received = [None] * len(params)
        handles = [
            p.register_hook(lambda g, k=k: received.__setitem__(k, g))
            for k, p in enumerate(params)
        ]
        losses.mean().backward()
        for handle in handles:
            handle.remove()
        capture.stop_recording()
        step = engine.step(capture.calls_by_module(), 3, 3, received)
        stats = step.statistics(Request(sq_norms=True), {})
    assert GenericRule not in rules.values(), rules
    reference = models.per_sample_gradients(model, X, y, loss_fn)
    for k, ref in enumerate(reference):
        expected = ref.reshape(3, -1).pow(2).sum(1)
        torch.testing.assert_close(stats.sq_norms[k], expected, rtol=1e-10, atol=1e-12)
    names = [name for name, _ in model.named_parameters()]
    for name in ("unused", "spare.weight", "spare.bias"):
        assert float(stats.sq_norms[names.index(name)].abs().max()) == 0.0


def two_tracked_steps(model, X, y, loss_fn, preset: str) -> dict:
    """The README's loop for two tracked steps, with a plain forward (gradients on) of another
    copy of the model before each step's forward (an EMA copy, a teacher): the output."""
    other = copy.deepcopy(model)
    optimizer = optimizer_for(preset, model.parameters())
    cockpit = Cockpit(model, quantities=configuration(preset))
    for step in range(2):
        other(X)
        tracked_backward(cockpit, step, model, X, y, loss_fn, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    cockpit.close()
    return cockpit.get_output()


@pytest.mark.slow  # (28 runs of two steps: minutes on two cores)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", sorted(TINY))
def test_every_preset_runs_two_steps_with_another_model_s_forward_between(name, preset):
    """Every preset finishes two tracked steps on every architecture in float32, each of its
    quantities with finite values at step 0 (Alpha and the two-step ones need step 1's
    start), and no refusal: curvature="auto" picks what runs."""
    model, X, y, loss_fn = TINY[name](dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = two_tracked_steps(model, X, y, loss_fn, preset)
    assert_the_preset_ran(output, preset, [str(w.message) for w in caught])


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_architecture_s_per_sample_gradients_equal_brute_force(name, rules):
    """Issue 24's seven architectures as the acceptance runs them (the padded causal LM with
    its shifted labels, the BERT classifier with its attention mask, the LSTM LM's summed
    token losses, the packed GRU, ...), in float64 and eval mode: exact against the loop over
    samples, no generic rule."""
    model, X, y, loss_fn = TINY[name](dtype=torch.float64)
    with quiet():
        assert_exact(model.eval(), X, y, loss_fn)
    assert GenericRule not in rules.values(), rules
