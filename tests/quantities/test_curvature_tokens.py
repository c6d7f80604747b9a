"""The GGN diagonals on token-level losses (issue 24): a causal language model's per-sequence
mean of token cross-entropies, shifted by one position and with padding left out by
ignore_index (the real Hugging Face GPT-2), and an LSTM language model's per-sequence sum.

The reference is the dense GGN of the mean loss in float64 by brute force,
G = (1/N) J^T H J: J the Jacobian of the whole output [N, T, V] w.r.t. every parameter (one
backward per output entry) and H the Hessian of sum_n l_n w.r.t. that output
(torch.autograd.functional.hessian). The exact GGN diagonal equals it; the Monte-Carlo one's
average over many draws is close to it; the loss Hessian's root is the closed form per token,
never the dense one; "auto" picks a variant that runs, or refuses on entering the step."""

from __future__ import annotations

import warnings

import pytest
import real_models
import torch
from models import per_sample_gradients
from torch.nn import functional as F

from avionics import Cockpit
from avionics.curvature.step import loss_root
from avionics.quantities import HessTrace, TICDiag, curvature

BUILDERS = {
    "gpt2": lambda: real_models.gpt2_lm(n=3, t=6, width=8),
    "lstm_lm": lambda: real_models.lstm_lm(n=3, t=4, vocab=8),
}


def dense_ggn_diagonal(model, X, y, loss_fn) -> torch.Tensor:
    """diag((1/N) J^T H J) over the whole batch, J by one backward per output entry."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(X)
    logits = out.logits if hasattr(out, "logits") else out
    flat = logits.reshape(-1)
    rows = []
    for i in range(len(flat)):
        grads = torch.autograd.grad(flat[i], params, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).reshape(-1)
                    for g, p in zip(grads, params)
                ]
            )
        )
    J = torch.stack(rows)  # [N T V, D]
    H = torch.autograd.functional.hessian(
        lambda z: loss_fn(z.reshape(logits.shape), y).sum(), logits.detach()
    ).reshape(len(flat), len(flat))
    return torch.einsum("od,op,pd->d", J, H, J) / len(X)


def run_step(model, X, y, loss_fn, quantities):
    cockpit = Cockpit(model, quantities=quantities)
    losses = loss_fn(model(X), y)
    loss = losses.mean()
    with cockpit(0, info={"loss": loss, "individual_losses": losses, "batch_size": len(X)}):
        loss.backward(create_graph=cockpit.create_graph(0))
    model.zero_grad(set_to_none=True)
    return cockpit.get_output()[0]


@pytest.fixture
def no_dense_root(monkeypatch):
    def dense(*args):
        raise AssertionError("the dense loss-Hessian root was used")

    monkeypatch.setattr(loss_root, "_dense_root", dense)


def expected(model, X, y, loss_fn):
    """(per-parameter traces of the dense GGN diagonal, TICDiag on it)."""
    h = dense_ggn_diagonal(model, X, y, loss_fn)
    sizes = [p.numel() for p in model.parameters()]
    g = per_sample_gradients(model, X, y, loss_fn)
    m2 = torch.cat([t.pow(2).mean(0).reshape(-1) for t in g])
    return torch.stack([d.sum() for d in h.split(sizes)]), float((m2 / (h + 1e-7)).sum())


# (GPT-2's exact diagonal backpropagates 315 columns, its MC average 400: minutes here)
NAMES = [pytest.param("gpt2", marks=pytest.mark.slow), "lstm_lm"]


@pytest.mark.parametrize("name", NAMES)
def test_the_exact_ggn_diagonal_of_a_token_level_loss_equals_the_dense_one(name, no_dense_root):
    model, X, y, loss_fn = BUILDERS[name]()
    model.eval()  # (the reference's forwards draw no dropout masks)
    assert (y == real_models.IGNORE).any()  # padding is left out of the loss
    traces, tic = expected(model, X, y, loss_fn)
    out = run_step(
        model,
        X,
        y,
        loss_fn,
        [HessTrace(curvature="diag_ggn_exact"), TICDiag(curvature="diag_ggn_exact")],
    )
    torch.testing.assert_close(
        torch.tensor(out["HessTrace"], dtype=torch.float64), traces, rtol=1e-7, atol=1e-12
    )
    assert out["TICDiag"] == pytest.approx(tic, rel=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_the_monte_carlo_ggn_diagonal_of_a_token_level_loss_averages_to_it(name, no_dense_root):
    model, X, y, loss_fn = BUILDERS[name]()
    model.eval()
    traces, _ = expected(model, X, y, loss_fn)
    out = run_step(model, X, y, loss_fn, [HessTrace(curvature="diag_ggn_mc", mc_samples=400)])
    mc = torch.tensor(out["HessTrace"], dtype=torch.float64)
    # 400 draws: a relative error of a few times 1 / sqrt(400) on each trace at most
    big = traces > 1e-3 * traces.max()
    torch.testing.assert_close(mc[big], traces[big], rtol=0.15, atol=0)
    assert float((mc.sum() - traces.sum()).abs() / traces.sum()) < 0.05


@pytest.mark.slow  # (189 columns through GPT-2)
def test_the_causal_shift_s_last_position_and_the_padding_take_no_columns(monkeypatch):
    """The exact diagonal backpropagates V - 1 columns per position a loss reaches: not the
    last position (the shift leaves it out) nor positions padded in every sequence."""
    model, X, y, loss_fn = real_models.gpt2_lm(n=3, t=6, width=8)
    model.eval()
    y[:, -2:] = real_models.IGNORE  # the last two labels padded in every sequence
    counted = []
    columns = loss_root.SoftmaxHessianRoot.columns

    def count(root):
        for column in columns(root):
            counted.append(1)
            yield column

    monkeypatch.setattr(loss_root.SoftmaxHessianRoot, "columns", count)
    run_step(model, X, y, loss_fn, [HessTrace(curvature="diag_ggn_exact")])
    # labels 1..5 of 6, the last two ignored: positions 0..2 of the logits
    assert len(counted) == 3 * 63


def log_cosh_tokens(out, y):
    """A per-token loss with a diagonal Hessian that no closed form here recognises."""
    return torch.log(torch.cosh(out - F.one_hot(y.clamp_min(0), out.shape[-1]))).sum((1, 2))


def test_auto_never_picks_a_variant_that_then_refuses(monkeypatch):
    """Where a sample's output is beyond the dense loss Hessian's reach, the loss decides on
    entering the step: token cross-entropy takes the Monte-Carlo diagonal and runs; an
    unrecognised loss is refused before the backward, naming what works and its cost."""
    monkeypatch.setattr(curvature, "MAX_OUTPUT_SIZE", 8)
    monkeypatch.setattr(loss_root, "MAX_OUTPUT_SIZE", 8)
    monkeypatch.setattr(curvature, "AUTO_MAX_PROBES", 100)  # (the LSTM LM has 1288 weights)
    model, X, y, loss_fn = real_models.lstm_lm(n=3, t=4, vocab=8)
    model.eval()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = run_step(model, X, y, loss_fn, [HessTrace(curvature="auto")])
    assert any("computes 'diag_ggn_mc'" in str(w.message) for w in said)
    assert all(v > 0 for v in out["HessTrace"][-2:])  # the head's weight and bias
    cockpit = Cockpit(model, [HessTrace(curvature="auto")])
    losses = log_cosh_tokens(model(X), y)
    entered = []
    with pytest.raises(ValueError, match=r"not recognised.*'diag_h' \(its 1288 products"):
        with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses}):
            entered.append(True)
    cockpit = Cockpit(model, [HessTrace(curvature="diag_ggn_mc")])
    losses = log_cosh_tokens(model(X), y)
    with pytest.raises(ValueError, match=r"cannot run.*not recognised.*'diag_h' \(1288 Hessian"):
        with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses}):
            entered.append(True)
    assert entered == []  # refused on entering the step, before its backward
