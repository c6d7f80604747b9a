"""Gradient accumulation on time-major models: token ids [T, N] split into micro-batches
along axis 1, through an LSTM or a transformer layer with batch_first=False, to logits
[N, C]. The merged call of the model joined its output along its input's batch axis (axis
1 of [N, C]) and the head's rule crashed; each output is joined along its own batch axis.
Against one batch of all the micro-batches' samples and the float64 loop over samples,
with N != T, N == T, and micro-batches of T == C samples (where sizes alone do not tell an
output's batch axis).
"""

import models
import pytest
import real_models
import torch
from compare import assert_same_output
from test_accumulation import EXACT, run
from test_broadcast_time_major import PositionalTokens, _losses
from torch import nn

from avionics import configuration
from avionics.persample import PerSampleEngine, Request

# (T, N): N != T, N == T, and micro-batches of 3 == T == the number of classes
SIZES = [(5, 4), (4, 4), (3, 6)]


def economy():
    return configuration("economy")


def time_major(body: str, t: int, n: int):
    """A PositionalTokens model (width 8: no width equals N) on time-major ids [T, N]."""
    torch.manual_seed(0)
    model = PositionalTokens(body, batch_first=False, width=8).double()
    torch.manual_seed(1)
    return model, torch.randint(0, 11, (t, n)), torch.randint(0, 3, (n,))


@pytest.mark.parametrize(("t", "n"), SIZES)
@pytest.mark.parametrize("body", ["lstm", "transformer"])
def test_accumulated_economy_on_a_time_major_model_equals_one_batch(body, t, n):
    model, ids, y = time_major(body, t, n)
    one = run(model, ids, y, _losses, 1, economy, batch_axis=1)
    two = run(model, ids, y, _losses, 2, economy, batch_axis=1)
    assert {"Alpha", "NormTest", "GradNorm"} <= set(two[0])
    assert_same_output(two, one, **EXACT)


@pytest.mark.parametrize(("t", "n"), SIZES)
@pytest.mark.parametrize("body", ["lstm", "transformer"])
def test_accumulated_per_sample_gradients_of_a_time_major_model_equal_the_loop(
    body, t, n, monkeypatch
):
    """The engine's step of the merged calls (N samples) gives each sample's squared
    gradient norm and the sum over samples of g_n^2 of the float64 loop."""
    model, ids, y = time_major(body, t, n)
    assert_accumulated_equal_the_loop(model, ids, y, monkeypatch)


def assert_accumulated_equal_the_loop(model, ids, y, monkeypatch, sizes=None):
    """One step accumulated over two micro-batches (of ``sizes``) of time-major ``ids``:
    the engine's step of the merged calls (N samples) gives each sample's squared gradient
    norm and the sum over samples of g_n^2 of the float64 loop."""
    steps, n = [], len(y)
    step = PerSampleEngine.step

    def recorded(engine, calls, size, *args, **kwargs):
        steps.append(step(engine, calls, size, *args, **kwargs))
        return steps[-1]

    monkeypatch.setattr(PerSampleEngine, "step", recorded)
    run(model, ids, y, _losses, 2, economy, steps=1, sizes=sizes, batch_axis=1)
    (merged,) = [s for s in steps if s.n == n]
    params = [p.detach() for p in model.parameters()]
    stats = merged.statistics(Request(sq_norms=True, sum_sq=True), {}, params=params)
    reference = models.per_sample_gradients(model, ids, y, _losses)
    for k, ref in enumerate(reference):
        flat = ref.reshape(n, -1)
        torch.testing.assert_close(stats.sq_norms[k], flat.pow(2).sum(1), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(stats.sum_sq[k], ref.pow(2).sum(0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("t", "n"), [(5, 4), (4, 4)])
def test_accumulated_economy_of_a_time_major_lstm_read_at_the_last_step_equals_one_batch(t, n):
    """Padded ids [T, N], the head on each sample's state after its last token (a gather
    along time)."""
    model, ids, y, loss_fn = real_models.recurrent("lstm", batch_first=False, n=n, t=t)
    one = run(model, ids, y, loss_fn, 1, economy, batch_axis=1)
    two = run(model, ids, y, loss_fn, 2, economy, batch_axis=1)
    assert_same_output(two, one, **EXACT)


class ScaledMean(nn.Module):
    """Time-major token embeddings [T, N, W] times a root scale [W], a head on the mean over
    time: the scale is broadcast along T and N, and no module with a ``batch_first``
    attribute reads the product, so only the model's own attribute tells the batch axis."""

    def __init__(self, vocab=11, width=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.scale = nn.Parameter(torch.randn(width))
        self.head = nn.Linear(width, 3)

    def forward(self, ids):
        return self.head((self.embed(ids) * self.scale).tanh().mean(0))


def scaled_mean(t: int, n: int, batch_first: bool | None):
    torch.manual_seed(2)
    model = ScaledMean().double()
    if batch_first is not None:
        model.batch_first = batch_first
    return model, torch.randint(0, 11, (t, n)), torch.randint(0, 3, (n,))


REFUSED = "parameter 'scale' need the batch axis of the tensor of shape"


@pytest.mark.parametrize(("t", "n", "sizes"), [(4, 4, None), (4, 3, [2, 1]), (4, 6, [4, 2])])
def test_a_shared_parameter_the_check_refuses_on_one_batch_is_refused_accumulated(t, n, sizes):
    """The scale's per-sample map reduced over the root's inherited axis 0 (T), not the
    batch's: refused on one batch, and on the step of two micro-batches (whose merged call
    did not carry the uses' axes, so the check did not run)."""
    model, ids, y = scaled_mean(t, n, None)
    with pytest.raises(ValueError, match=REFUSED):
        run(model, ids, y, _losses, 1, economy, steps=1, batch_axis=1)
    with pytest.raises(ValueError, match=REFUSED):
        run(model, ids, y, _losses, 2, economy, steps=1, sizes=sizes, batch_axis=1)


@pytest.mark.parametrize(("t", "n", "sizes"), [(4, 4, None), (4, 3, [2, 1]), (4, 6, [4, 2])])
def test_a_shared_parameter_the_check_accepts_is_exact_accumulated(t, n, sizes, monkeypatch):
    model, ids, y = scaled_mean(t, n, False)
    one = run(model, ids, y, _losses, 1, economy, batch_axis=1)
    two = run(model, ids, y, _losses, 2, economy, sizes=sizes, batch_axis=1)
    assert_same_output(two, one, **EXACT)
    assert_accumulated_equal_the_loop(model, ids, y, monkeypatch, sizes)
