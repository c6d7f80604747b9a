"""nn.MultiheadAttention's per-sample gradients against a loop over samples, in float64.

The closed form takes dq, dk, dv from inside the user's backward (``rules.attention.inside``)
for self-attention, encoder-decoder attention (key is value) and separate key and value, with
either batch layout, masks, padding masks, returned attention weights (used in the loss or
not), dropout, queries and keys of different lengths and a module called twice; it re-runs
the attention where those gradients are missing (another backpropagated column), and the
layouts it does not cover (kdim/vdim, add_bias_kv, add_zero_attn) take the generic rule.
"""

import pytest
import torch
from test_engine import assert_exact, ce
from torch import nn

from avionics.persample.rules import attention
from avionics.persample.rules.attention import AttentionRule
from avionics.persample.rules.generic import GenericRule


class Attending(nn.Module):
    """h = attention(q, k, v) and a linear head on its mean over positions, c = context(x);
    ``kind``: what q, k and v are ('self': c, c, c; 'cross': x and c (twice as long) for k and
    v; 'separate': x, c, tanh(c))."""

    def __init__(self, kind, batch_first, weights, mask, padding, dropout=0.0, twice=False, **kw):
        super().__init__()
        self.kind, self.batch_first, self.weights = kind, batch_first, weights
        self.mask, self.padding, self.twice = mask, padding, twice
        self.attn = nn.MultiheadAttention(4, 2, batch_first=batch_first, dropout=dropout, **kw)
        self.context = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        t = 1 if self.batch_first else 0
        c = self.context(x)
        if self.kind == "cross" and self.twice is False:
            c = torch.cat([c, c.flip(t)], t)  # keys twice as long as the queries
        if self.kind == "self":
            x = key = value = c
        else:
            key, value = (c, c) if self.kind == "cross" else (c, torch.tanh(c))
        s = key.shape[t]
        kwargs = {"need_weights": self.weights is not None}
        if self.mask:
            kwargs["attn_mask"] = torch.triu(torch.ones(x.shape[t], s, dtype=torch.bool), 1)
        if self.padding:
            n = x.shape[1 - t]
            pad = torch.zeros(n, s, dtype=torch.bool)
            pad[0, -2:] = True  # sample 0 ignores its last two keys
            kwargs["key_padding_mask"] = pad
        h, w = self.attn(x, key, value, **kwargs)
        if self.twice:
            h, _ = self.attn(h, h, h)
        if self.weights == "used":
            focus = w.pow(2).sum(-1)  # [N, T]
            h = h + (focus if self.batch_first else focus.T).unsqueeze(-1)
        return self.out(h.mean(t))


def _data(batch_first, n=3, t=5):
    x = torch.randn(n, t, 4) if batch_first else torch.randn(t, n, 4)
    return x.double(), torch.randint(0, 3, (n,))


@pytest.fixture
def paths(monkeypatch):
    """How the attention rule took each call's factors: 'inside' or 're-run'."""
    taken = []
    for name, label in (("_inside_factors", "inside"), ("_call_factors", "re-run")):
        original = getattr(attention, name)

        def wrapped(*args, _original=original, _label=label):
            taken.append(_label)
            return _original(*args)

        monkeypatch.setattr(attention, name, wrapped)
    return taken


CASES = [
    dict(kind="self", weights=None, mask=False, padding=False),
    dict(kind="self", weights="returned", mask=True, padding=True),
    dict(kind="self", weights="used", mask=False, padding=True),
    dict(kind="cross", weights=None, mask=False, padding=True),
    dict(kind="cross", weights="used", mask=True, padding=False),
    dict(kind="separate", weights="returned", mask=True, padding=True),
    dict(kind="cross", weights=None, mask=False, padding=False, twice=True),
    dict(kind="self", weights=None, mask=False, padding=False, bias=False),
]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_projections_gradients_from_inside_the_backward_are_exact(case, batch_first, paths):
    torch.manual_seed(0)
    model = Attending(batch_first=batch_first, **case).double()
    X, y = _data(batch_first)
    assert_exact(model, X, y, ce)
    assert paths and set(paths) == {"inside"}


def test_dropout_in_train_mode_is_the_drawn_one(paths):
    """The brute force re-runs the forward once: its masks are the ones the backward saw."""
    torch.manual_seed(0)
    model = Attending("self", True, None, True, False, dropout=0.5).double()
    X, y = _data(True)
    engine_stats = _stats_of_one_forward(model, X, y)
    for got, ref in engine_stats:
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    assert set(paths) == {"inside"}


def _stats_of_one_forward(model, X, y):
    """(engine's sq_norms, loop's ||g_n||^2) per parameter, from one captured forward."""
    from avionics.persample import PerSampleEngine, Request

    params = [p for p in model.parameters() if p.requires_grad]
    engine = PerSampleEngine(model, params)
    capture = engine.capture()
    capture.arm()
    losses = ce(model(X), y)
    capture.disarm()
    rows = [torch.autograd.grad(l, params, retain_graph=True) for l in losses]
    capture.record_gradients()
    losses.mean().backward()
    capture.stop_recording()
    n = len(losses)
    step = engine.step(capture.calls_by_module(), n, n, [p.grad for p in params])
    stats = step.statistics(Request(sq_norms=True), {})
    return [
        (stats.sq_norms[k], torch.stack([r[k] for r in rows]).flatten(1).pow(2).sum(1))
        for k in range(len(params))
    ]


def test_without_the_backward_s_gradients_the_rule_re_runs_the_attention(paths):
    """A call whose output gradients are replaced (a GGN column) drops what the backward
    stored inside: the re-run gives the same factors."""
    torch.manual_seed(0)
    model = Attending("self", True, None, True, True).double()
    X, y = _data(True)
    from models import captured_engine_step

    _, step, _, _ = captured_engine_step(model, X, y, ce)
    calls = step.calls[model.attn]
    paths.clear()
    names = ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    inside = AttentionRule(model.attn, calls, names, 3, 3.0)
    rerun = AttentionRule(
        model.attn, [c.with_grad_outputs(c.grad_outputs) for c in calls], names, 3, 3.0
    )
    assert paths == ["inside", "re-run"]
    for a, b in zip(inside.total(), rerun.total(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "options", [dict(kdim=3, vdim=2), dict(add_bias_kv=True), dict(add_zero_attn=True)]
)
def test_layouts_outside_the_closed_form_take_the_generic_rule(options, monkeypatch):
    class Different(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True, **options)
            self.out = nn.Linear(4, 3)

        def forward(self, x):
            k = x[..., : options.get("kdim", 4)]
            v = x[..., : options.get("vdim", 4)]
            return self.out(self.attn(x, k, v)[0].mean(1))

    built = []
    original = GenericRule.__init__

    def record(self, module, *args):
        built.append((module, type(self)))
        original(self, module, *args)

    monkeypatch.setattr(GenericRule, "__init__", record)
    torch.manual_seed(0)
    model = Different().double()
    assert_exact(model, *_data(True), ce)
    assert any(m is model.attn and cls is GenericRule for m, cls in built)
