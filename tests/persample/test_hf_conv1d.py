"""The closed-form rule of Hugging Face's Conv1D against a loop over samples (float64)."""

import subprocess
import sys

import pytest
import torch
from models import captured_engine_step, per_sample_gradients

from avionics.persample import PerSampleEngine, Request
from avionics.persample.rules import GenericRule, rule_for
from avionics.persample.rules.base import ColumnSums, Rule
from avionics.persample.rules.hf_conv1d import HFConv1DRule

transformers = pytest.importorskip("transformers")
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

TOL = {"rtol": 1e-10, "atol": 1e-12}


def gpt2_block() -> GPT2Block:
    config = transformers.GPT2Config(
        n_embd=16, n_head=2, n_layer=1, n_positions=8, attn_pdrop=0.0, resid_pdrop=0.0
    )
    config._attn_implementation = "eager"
    return GPT2Block(config).double()


class Block(torch.nn.Module):
    """A GPT-2 block returning its hidden states (the block returns a tuple)."""

    def __init__(self):
        super().__init__()
        self.block = gpt2_block()

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def squared_error(out, y):
    """l_n = sum over the sample's positions and features of (out - y)^2 / 2."""
    return 0.5 * (out - y).pow(2).flatten(1).sum(1)


def captured_statistics(model, x, y, reduction):
    """The engine's sq_norms, sum_sq and projections onto the mean gradient and a random
    direction, from one captured forward and backward."""
    _, step, mean_grad, params = captured_engine_step(model, x, y, squared_error, reduction)
    other = [torch.randn_like(p) for p in params]
    request = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad", "other"}))
    stats = step.statistics(request, {"grad": mean_grad, "other": other}, sample_mean="grad")
    return step, stats, mean_grad, other


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt2_block_statistics_equal_a_loop_over_samples(reduction):
    model = Block()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    y = torch.randn(3, 5, 16, dtype=torch.float64)
    step, stats, mean_grad, other = captured_statistics(model, x, y, reduction)
    conv1d = {m for m in model.modules() if isinstance(m, Conv1D)}
    assert len(conv1d) == 4  # c_attn, c_proj of the attention and of the MLP
    for module in conv1d:
        assert isinstance(step.rules[module], HFConv1DRule)
    reference = per_sample_gradients(model, x, y, squared_error)
    checked = 0
    for k, (p, ref) in enumerate(zip(model.parameters(), reference, strict=True)):
        flat = ref.reshape(len(ref), -1)
        torch.testing.assert_close(stats.sq_norms[k], flat.pow(2).sum(1), **TOL)
        torch.testing.assert_close(stats.sum_sq[k], ref.pow(2).sum(0), **TOL)
        for name, v in (("grad", mean_grad[k]), ("other", other[k])):
            torch.testing.assert_close(stats.projections[name][k], flat @ v.reshape(-1), **TOL)
        checked += any(p is q for m in conv1d for q in m.parameters())
    assert checked == 8


def test_a_conv1d_without_shared_axes_materialises_its_transposed_gradients():
    layer = Conv1D(4, 3).double()  # 3 inputs, 4 outputs: weight [3, 4]
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(5, 4, dtype=torch.float64)
    step, stats, _, _ = captured_statistics(layer, x, y, "mean")
    rule = step.rules[layer]
    reference = per_sample_gradients(layer, x, y, squared_error)
    weight, bias = rule.materialize(0, 5)
    torch.testing.assert_close(weight, reference[0], **TOL)
    torch.testing.assert_close(bias, reference[1], **TOL)
    torch.testing.assert_close(stats.sq_norms[0], reference[0].pow(2).sum((1, 2)), **TOL)


@pytest.mark.parametrize("shape", [(5, 3), (5, 2, 3)], ids=["separable", "shared axes"])
@pytest.mark.parametrize("traces", [False, True])
def test_column_sums_equal_per_column_per_sample_gradients(shape, traces):
    """sum_j sum_n g_{n,j}^2 with g_{n,j} the per-sample gradient when column j replaces the
    output gradient (the curvature diagonals), against autograd sample by sample."""
    layer = Conv1D(4, 3).double()
    x = torch.randn(*shape, dtype=torch.float64)
    n = shape[0]
    engine = PerSampleEngine(layer, list(layer.parameters()))
    capture = engine.capture()
    capture.arm()
    out = layer(x)
    capture.disarm()
    capture.record_gradients()
    out.sum().backward()
    capture.stop_recording()
    calls = capture.calls_by_module()[layer]
    columns = [torch.randn(*out.shape, dtype=torch.float64) for _ in range(3)]
    sums = HFConv1DRule.column_sums(layer, calls, ["weight", "bias"], n, traces)
    default = ColumnSums(HFConv1DRule, layer, calls, ["weight", "bias"], n, traces)
    for column in columns:
        grad_outputs = [[None] * len(call.outputs) for call in calls]
        grad_outputs[0][calls[0].node_outputs[0]] = column
        sums.add(grad_outputs)
        default.add(grad_outputs)
    expected = [torch.zeros_like(p) for p in layer.parameters()]
    for column in columns:
        for i in range(n):
            out_i = layer(x[i : i + 1])
            grads = torch.autograd.grad(out_i, list(layer.parameters()), column[i : i + 1])
            for e, g in zip(expected, grads, strict=True):
                e += g.square()
    if traces:
        expected = [e.sum() for e in expected]
    for got, fallback, e in zip(sums.result(2.0), default.result(2.0), expected, strict=True):
        torch.testing.assert_close(got, 2.0 * e, **TOL)
        torch.testing.assert_close(fallback, 2.0 * e, **TOL)


def test_every_conv1d_of_gpt2_takes_the_closed_form_rule():
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=16, n_head=2, n_layer=2, n_positions=8, vocab_size=32)
    )
    conv1d = [m for m in model.modules() if isinstance(m, Conv1D)]
    assert len(conv1d) == 8
    for module in conv1d:
        assert rule_for(module, ["weight", "bias"]) is HFConv1DRule
        assert rule_for(module, ["weight"]) is HFConv1DRule

    class Scaled(Conv1D):
        def forward(self, x):
            return 2 * super().forward(x)

    assert rule_for(Scaled(4, 3), ["weight", "bias"]) is GenericRule
    assert issubclass(HFConv1DRule, Rule)


def test_importing_avionics_does_not_import_transformers():
    code = "import sys, avionics.persample.rules; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
