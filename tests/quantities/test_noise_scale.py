"""The gradient noise scale (McCandlish et al. 2018) against brute-force float64 per-sample
gradients: |G|^2, tr(S) and B_simple on the test models for mean and sum reduced losses, the
smoothed B_simple against a hand-computed bias-corrected EMA, a resumed run, a non-finite
step, data parallelism, the log and CSV, and bad input refused before anything changes."""

from __future__ import annotations

import io
import math
import warnings
from types import SimpleNamespace

import models
import pytest
import torch
from models import per_sample_gradients
from reference import flat
from spawned import on_ranks

from avionics import Cockpit, read_run
from avionics import quantities as Q
from avionics.persample import Request
from avionics.quantities.noise_scale import signal_and_noise
from avionics.records.export import to_csv

PARTS = ("TrueGradSqNorm", "GradCovTrace", "SimpleNoiseScale")
NAMES = PARTS + ("GradientNoiseScale",)
ARCHITECTURES = {"mlp": models.mlp, "cnn": models.cnn, "transformer": models.transformer}


def all_parts(smoothing=0.9):
    return [Q.TrueGradSqNorm(), Q.GradCovTrace(), Q.SimpleNoiseScale(), Q.GradientNoiseScale(
        smoothing=smoothing)]  # fmt: skip


def brute_force(model, X, y, loss_fn) -> dict[str, float]:
    """|G|^2, tr(S) and B_simple from their definitions, by a loop over the samples: tr(S) is
    the trace of the unbiased covariance of the g_n, |G|^2 = ||g||^2 - tr(S) / N."""
    G = flat(per_sample_gradients(model, X, y, loss_fn))  # [N, D]
    g = G.mean(0)
    noise = G.var(0, correction=1).sum()
    signal = g @ g - noise / len(G)
    return {
        "TrueGradSqNorm": float(signal),
        "GradCovTrace": float(noise),
        "SimpleNoiseScale": float(noise / signal),
    }


def batch(step: int, build=models.mlp, n: int = 5):
    """The data of ``step`` (another batch at every step)."""
    _, X, y, _ = build(n=n, seed=100 + step)
    return X, y


def train(model, loss_fn, cockpit, steps, build=models.mlp, n=5, reduction="mean"):
    """SGD steps tracked by ``cockpit``; the brute-force values of each step, before it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    references = {}
    for step in steps:
        X, y = batch(step, build, n)
        references[step] = brute_force(model, X, y, loss_fn)
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        loss = losses.mean() if reduction == "mean" else losses.sum()
        info = {"loss": loss, "individual_losses": losses, "batch_size": n}
        with cockpit(step, info=info):
            loss.backward()
        opt.step()
    return references


def bias_corrected_ema(values: list[float], beta: float) -> list[float]:
    """Adam's bias-corrected moving average m_t / (1 - beta^t), m_t = beta m_{t-1} +
    (1 - beta) x_t, m_0 = 0."""
    m, out = 0.0, []
    for t, x in enumerate(values, start=1):
        m = beta * m + (1 - beta) * x
        out.append(m / (1 - beta**t))
    return out


# ------------------------------------------------------------------ the numbers
def test_the_estimates_are_the_papers_with_one_and_n_samples():
    """(B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small) and (|G_small|^2 -
    |G_big|^2) / (1 / B_small - 1 / B_big), B_small = 1 (|G_small|^2 averaged over the N
    samples), B_big = N."""
    G = torch.randn(7, 11, dtype=torch.float64) + 0.3
    n = len(G)
    small, big = G.pow(2).sum(1).mean(), G.mean(0).pow(2).sum()
    signal, noise = signal_and_noise(small, 1, big, n)
    assert float(signal) == pytest.approx(float((n * big - 1 * small) / (n - 1)), rel=1e-14)
    assert float(noise) == pytest.approx(float((small - big) / (1 / 1 - 1 / n)), rel=1e-14)
    # tr(S) is the unbiased sample covariance's trace, and ||g||^2 = |G|^2 + tr(S) / N
    g = G.mean(0)
    assert float(noise) == pytest.approx(float((G - g).pow(2).sum() / (n - 1)), rel=1e-12)
    assert float(big) == pytest.approx(float(signal + noise / n), rel=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_estimates_and_noise_scale_match_brute_force(architecture, reduction):
    build = ARCHITECTURES[architecture]
    model, _, _, loss_fn = build(n=4)
    cockpit = Cockpit(model, all_parts())
    references = train(model, loss_fn, cockpit, range(3), build, n=4, reduction=reduction)
    output = cockpit.get_output()
    for step, reference in references.items():
        for name in PARTS:
            assert output[step][name] == pytest.approx(reference[name], rel=1e-9), (step, name)
    # the first smoothed value is the step's own: nothing pulls it towards 0
    first = references[0]["SimpleNoiseScale"]
    assert output[0]["GradientNoiseScale"] == pytest.approx(first, rel=1e-9)


def test_smoothed_value_is_the_ratio_of_bias_corrected_emas_over_four_steps():
    model, _, _, loss_fn = models.mlp()
    cockpit = Cockpit(model, all_parts(smoothing=0.7))
    references = train(model, loss_fn, cockpit, range(4))
    signal = bias_corrected_ema([references[s]["TrueGradSqNorm"] for s in range(4)], 0.7)
    noise = bias_corrected_ema([references[s]["GradCovTrace"] for s in range(4)], 0.7)
    smoothed = [cockpit.get_output()[s]["GradientNoiseScale"] for s in range(4)]
    assert smoothed == pytest.approx([s / g for s, g in zip(noise, signal)], rel=1e-9)
    raw = [references[s]["SimpleNoiseScale"] for s in range(4)]
    assert smoothed[1:] != pytest.approx(raw[1:])  # it is smoothed indeed


def test_no_smoothing_is_the_step_s_own_value():
    model, _, _, loss_fn = models.mlp()
    cockpit = Cockpit(model, all_parts(smoothing=0))
    train(model, loss_fn, cockpit, range(3))
    for values in cockpit.get_output().values():
        assert values["GradientNoiseScale"] == pytest.approx(values["SimpleNoiseScale"], rel=1e-12)


def test_only_squared_norms_are_requested_and_their_sum_is_float64():
    q = Q.GradientNoiseScale()
    assert q.request(0) == Request(sq_norms=True)  # no projections: they cost
    sq_norms = [torch.tensor([1.0, 2.0], dtype=torch.float32), torch.tensor([0.5, 0.25])]
    sums = q.sums(SimpleNamespace(statistics=SimpleNamespace(sq_norms=sq_norms)))
    assert list(sums) == ["sq_norms"]
    assert sums["sq_norms"].dtype == torch.float64 and float(sums["sq_norms"]) == 3.75


# ------------------------------------------------------------------ state and resumption
def test_a_resumed_run_continues_the_averages_identically():
    model, _, _, loss_fn = models.mlp()
    uninterrupted = Cockpit(model, [Q.GradientNoiseScale()])
    train(model, loss_fn, uninterrupted, range(4))

    model, _, _, loss_fn = models.mlp()
    first = Cockpit(model, [Q.GradientNoiseScale()])
    train(model, loss_fn, first, range(2))
    buffer = io.BytesIO()
    torch.save({"cockpit": first.state_dict(), "model": model.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model, _, _, loss_fn = models.mlp()
    model.load_state_dict(checkpoint["model"])
    resumed = Cockpit(model, [Q.GradientNoiseScale()], first_step=2)
    resumed.load_state_dict(checkpoint["cockpit"])
    train(model, loss_fn, resumed, range(2, 4))
    expected = uninterrupted.get_output()
    for step in (2, 3):
        assert resumed.get_output()[step] == expected[step]


def test_a_step_with_non_finite_gradients_stores_nan_and_leaves_the_averages():
    """The NaN step stores nan; the later steps are those of a run that never tracked it."""

    def run(tracked, nan_step=None):
        model, _, _, loss_fn = models.mlp()
        cockpit = Cockpit(model, [Q.GradientNoiseScale()])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in tracked:
            X, y = batch(step)
            opt.zero_grad()
            out = model(X)
            if step == nan_step:
                out = models.NanGradient.apply(out)
            losses = loss_fn(out, y)
            with cockpit(step, info={"loss": losses.mean(), "individual_losses": losses,
                                     "batch_size": len(X)}):  # fmt: skip
                losses.mean().backward()
            if step != nan_step:
                opt.step()
        return cockpit.get_output()

    with pytest.warns(UserWarning, match="Step 1: GradientNoiseScale is NaN or infinite"):
        with_nan = run(range(4), nan_step=1)
    without = run([0, 2, 3])
    assert math.isnan(with_nan[1]["GradientNoiseScale"])
    for step in (0, 2, 3):
        assert with_nan[step]["GradientNoiseScale"] == without[step]["GradientNoiseScale"]


def test_a_batch_of_one_stores_nan_with_a_warning():
    model, X, y, loss_fn = models.mlp(n=1)
    q = Q.GradientNoiseScale()
    cockpit = Cockpit(model, [q, Q.TrueGradSqNorm()])
    losses = loss_fn(model(X), y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cockpit(0, info={"loss": losses.mean(), "individual_losses": losses,
                              "batch_size": 1}):  # fmt: skip
            losses.mean().backward()
    messages = [str(w.message) for w in caught]
    for name in ("GradientNoiseScale", "TrueGradSqNorm"):
        assert f"{name} at step 0 is undefined for a batch of one sample; stored nan." in messages
    values = cockpit.get_output()[0]
    assert math.isnan(values["GradientNoiseScale"]) and math.isnan(values["TrueGradSqNorm"])
    assert [float(v) for v in q.state_dict().values()] == [0.0, 0.0]  # nothing averaged


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("smoothing", "error", "match"),
    [
        (1, ValueError, r"GradientNoiseScale\(smoothing=1\): smoothing must be .*>= 0 and < 1"),
        (1.5, ValueError, r"GradientNoiseScale\(smoothing=1.5\): smoothing must be"),
        (-0.1, ValueError, r"GradientNoiseScale\(smoothing=-0.1\): smoothing must be"),
        (math.nan, ValueError, r"GradientNoiseScale\(smoothing=nan\): smoothing must be"),
        ("0.9", TypeError, r"GradientNoiseScale\(smoothing='0.9'\): smoothing must be a finite"),
        (True, TypeError, r"GradientNoiseScale\(smoothing=True\): smoothing must be"),
        (None, TypeError, r"GradientNoiseScale\(smoothing=None\): smoothing must be"),
    ],
)
def test_a_bad_smoothing_is_refused_naming_it(smoothing, error, match):
    with pytest.raises(error, match=match):
        Q.GradientNoiseScale(smoothing=smoothing)


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1.0, 2.0], TypeError, r"load_state_dict\(state\) takes the dict .* got list"),
        ({"signal_average": 1.0}, ValueError, r"state has the keys \['signal_average'\]"),
        ({"signal_average": "1", "noise_average": 1.0}, TypeError,
         r"state\['signal_average'\] must be one finite number .* got '1'"),
        ({"signal_average": 1.0, "noise_average": math.inf}, ValueError,
         r"state\['noise_average'\] must be one finite number .* got inf"),
        ({"signal_average": torch.ones(2), "noise_average": 1.0}, TypeError,
         r"state\['signal_average'\] must be one finite number"),
        ({"signal_average": True, "noise_average": 1.0}, TypeError,
         r"state\['signal_average'\] must be one finite number .* got True"),
    ],
)  # fmt: skip
def test_a_bad_state_is_refused_and_changes_nothing(state, error, match):
    model, _, _, loss_fn = models.mlp()
    q = Q.GradientNoiseScale()
    train(model, loss_fn, Cockpit(model, [q]), range(2))
    before = {k: v.clone() for k, v in q.state_dict().items()}
    with pytest.raises(error, match=match):
        q.load_state_dict(state)
    after = q.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_an_empty_state_restarts_the_averages():
    q = Q.GradientNoiseScale()
    q.load_state_dict({"signal_average": 2.0, "noise_average": 3.0})
    assert {k: float(v) for k, v in q.state_dict().items()} == {
        "signal_average": 2.0,
        "noise_average": 3.0,
    }
    q.load_state_dict({})
    assert q.state_dict() == {}


# ------------------------------------------------------------------ records
def test_the_log_the_reader_and_the_csv_carry_every_part(tmp_path):
    model, _, _, loss_fn = models.mlp()
    cockpit = Cockpit(model, all_parts(), log=tmp_path / "run")
    train(model, loss_fn, cockpit, range(3))
    cockpit.close()
    run = read_run(tmp_path / "run")
    for name in NAMES:
        assert run.output(name).kind == "scalar"
        assert [run.steps[s][name] for s in range(3)] == [
            cockpit.get_output()[s][name] for s in range(3)
        ]
    lines = to_csv(run, tmp_path / "run.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert set(NAMES) <= set(header)
    column = header.index("GradientNoiseScale")
    assert float(lines[3].split(",")[column]) == run.steps[2]["GradientNoiseScale"]


# ------------------------------------------------------------------ data parallelism
SIZES = (5, 2)  # unequal shares of the global batch of 7


def one_rank(rank, world):
    """A process of a data-parallel run: its share of each batch; gradients averaged by hand
    as DDP would (the mean loss's gradient over the global batch, shares being unequal)."""
    model, _, _, loss_fn = models.mlp()
    cockpit = Cockpit(model, all_parts())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = sum(SIZES[:rank])
    for step in range(3):
        X, y = batch(step, n=sum(SIZES))
        X, y = X[start : start + SIZES[rank]], y[start : start + SIZES[rank]]
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X)}
        with cockpit(step, info=info):
            losses.mean().backward()
        for p in model.parameters():  # sum_r N_r g_r / N
            p.grad = p.grad.detach() * (SIZES[rank] / sum(SIZES))
            torch.distributed.all_reduce(p.grad)
        opt.step()
    return cockpit.get_output()


def test_under_data_parallelism_the_batch_is_the_global_one(tmp_path):
    model, _, _, loss_fn = models.mlp()
    cockpit = Cockpit(model, all_parts())
    references = train(model, loss_fn, cockpit, range(3), n=sum(SIZES))
    expected = cockpit.get_output()
    for output in on_ranks(one_rank, len(SIZES), tmp_path):
        for step, reference in references.items():
            for name in PARTS:
                assert output[step][name] == pytest.approx(reference[name], rel=1e-9)
            assert output[step]["GradientNoiseScale"] == pytest.approx(
                expected[step]["GradientNoiseScale"], rel=1e-9
            )


def test_the_per_process_form_needs_several_processes():
    with pytest.raises(TypeError, match="per_process must be True or False"):
        Q.GradientNoiseScale(per_process="yes")
    model, X, y, loss_fn = models.mlp(n=4)
    cockpit = Cockpit(model, [Q.GradientNoiseScale(per_process=True)])
    losses = loss_fn(model(X), y)
    with pytest.warns(UserWarning, match="undefined for one process"):
        with cockpit(0, info={"loss": losses.mean(), "batch_size": 4}):
            losses.mean().backward()
    value = cockpit.get_output()[0]["GradientNoiseScale"]
    assert value != value
