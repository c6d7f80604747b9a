"""Convolution per-sample kernels chosen by a measured cost model (issue 17).

Every plan of a convolution (G_n by unfolding, by windows of the flat input, by one grouped
convolution; the Gram form with projections by the unfolded input or the layer's own
convolution) is forced in turn and checked against the loop over samples in float64; the
choice itself is tested with a deterministic clock: made once per layer shape, logged once.
"""

import logging

import models
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics.persample import Request
from avionics.persample.rules import conv, kernels

RTOL, ATOL = 1e-10, 1e-12

# name -> (the layer, built afresh: problem() makes it float64, its input shape)
LAYERS = {
    "1d stride 2 dilation 2": (
        lambda: nn.Conv1d(2, 4, 3, stride=2, dilation=2, padding=2),
        (2, 11),
    ),
    "1d stride 3 uneven": (lambda: nn.Conv1d(3, 4, 4, stride=3), (3, 13)),
    "2d stride 2 uneven": (lambda: nn.Conv2d(4, 6, 3, stride=2), (4, 9, 8)),
    "2d dilation 2": (lambda: nn.Conv2d(3, 4, (3, 2), dilation=2, padding=(1, 2)), (3, 9, 7)),
    "2d groups 2 same circular": (
        lambda: nn.Conv2d(4, 6, (3, 2), groups=2, padding="same", padding_mode="circular"),
        (4, 5, 6),
    ),
    "2d reflect stride (2, 1)": (
        lambda: nn.Conv2d(2, 3, 3, stride=(2, 1), padding=1, padding_mode="reflect"),
        (2, 7, 6),
    ),
    "2d groups 2 stride 2 dilation 2": (
        lambda: nn.Conv2d(4, 4, 3, groups=2, stride=2, dilation=2, padding=2),
        (4, 11, 10),
    ),
    "2d wide stride 1": (lambda: nn.Conv2d(9, 3, 3, padding=1, bias=False), (9, 6, 5)),
    "3d reflect": (
        lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=1, padding_mode="reflect"),
        (2, 3, 4, 3),
    ),
    "3d groups 2 stride 2 dilation": (
        lambda: nn.Conv3d(2, 4, (2, 3, 2), stride=2, dilation=(1, 1, 2), groups=2),
        (2, 5, 7, 6),
    ),
}

GRADIENT_KERNELS = ["unfold + bmm", conv.GROUPED, conv.WINDOWS]
PROJECTION_KERNELS = ["the unfolded input", conv.CONVOLUTION]

# what each request needs of the per-sample gradients
EVERYTHING = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad", "other"}))
NORMS_AND_PROJECTIONS = Request(sq_norms=True, directions=frozenset({"grad", "other"}))
NORMS = Request(sq_norms=True)
PROJECTION = Request(directions=frozenset({"other"}))


@pytest.fixture(autouse=True)
def fresh_choices():
    """Each test starts without measured choices and leaves none behind."""
    kernels.CHOICES.clear()
    yield
    kernels.CHOICES.clear()


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


def problem(make_layer, shape, n=3):
    """(model, X, y, loss_fn) in float64: the layer, tanh and a linear read-out."""
    torch.manual_seed(0)
    model = nn.Sequential(make_layer(), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(1, *shape))  # materialise the lazy layer
    return model.double(), torch.randn(n, *shape).double(), torch.randint(0, 3, (n,)), ce


def assert_matches_the_loop(model, X, y, loss_fn, requests):
    """Each request's statistics equal those of the per-sample gradients of a loop over samples."""
    _, step, mean_grad, params = models.captured_engine_step(model, X, y, loss_fn)
    reference = models.per_sample_gradients(model, X, y, loss_fn, params)
    torch.manual_seed(1)
    directions = {"grad": mean_grad, "other": [torch.randn_like(p) for p in params]}
    for request in requests:
        stats = step.statistics(request, {d: directions[d] for d in request.directions})
        for k, ref in enumerate(reference):
            flat = ref.reshape(len(ref), -1)
            if request.sq_norms:
                expected = flat.pow(2).sum(1)
                torch.testing.assert_close(stats.sq_norms[k], expected, rtol=RTOL, atol=ATOL)
            if request.sum_sq:
                expected = ref.pow(2).sum(0)
                torch.testing.assert_close(stats.sum_sq[k], expected, rtol=RTOL, atol=ATOL)
            for d in request.directions:
                expected = flat @ directions[d][k].reshape(-1)
                torch.testing.assert_close(stats.projections[d][k], expected, rtol=RTOL, atol=ATOL)


def has_windows(make_layer) -> bool:
    layer = make_layer()
    return conv._plain_2d(layer) and tuple(layer.stride) == (1, 1)


@pytest.mark.parametrize("kernel", GRADIENT_KERNELS)
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_materialised_gradients_of_every_kernel_match_the_loop(layer, kernel):
    module, shape = LAYERS[layer]
    if kernel == conv.WINDOWS and not has_windows(module):
        pytest.skip("the windows of the flat input apply to 2d convolutions with stride 1")
    with kernels.forcing(f"G_n by {kernel}"):
        assert_matches_the_loop(*problem(module, shape), [EVERYTHING, NORMS, PROJECTION])


@pytest.mark.parametrize("kernel", PROJECTION_KERNELS)
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_gram_form_and_projections_of_every_kernel_match_the_loop(layer, kernel):
    module, shape = LAYERS[layer]
    names = (f"Gram form, projections by {kernel}", "Gram form", f"projections by {kernel}")
    with kernels.forcing(*names):
        assert_matches_the_loop(
            *problem(module, shape), [NORMS_AND_PROJECTIONS, NORMS, PROJECTION]
        )


def test_grouped_convolution_crops_what_the_stride_leaves_unread():
    """Stride 3 over 14 positions with a kernel of 4: 4 output positions, whose windows
    start at 0, 3, 6, 9 and leave position 13 unread. The grouped convolution (stride 1,
    dilation 3, kernel of 4 positions) has (14 - 3 * 3 - 1) + 1 = 5 outputs: cropped to 4."""
    layer = nn.Conv1d(2, 3, 4, stride=3).double()
    x = torch.randn(2, 2, 14, dtype=torch.float64)
    delta = torch.randn(2, 3, 4, dtype=torch.float64)
    expected = torch.stack(
        [
            torch.autograd.grad(layer(x[n : n + 1]), layer.weight, delta[n : n + 1])[0]
            for n in range(2)
        ]
    )
    rule = object.__new__(conv.ConvRule)
    rule.module, rule.raw_inputs, rule.raw_deltas = layer, [x], [delta]
    rule.output_gradient_factor = 1.0
    torch.testing.assert_close(rule._grouped_gradients(0, 2), expected, rtol=RTOL, atol=ATOL)


def test_the_3c3d_network_matches_the_loop_by_every_kernel():
    """The benchmark's 3c3d CNN (smaller images: the same layers), in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 64, 5), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(64, 96, 3), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Conv2d(96, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        nn.Flatten(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 10),
    ).double()  # fmt: skip
    X, y = torch.randn(2, 3, 16, 16, dtype=torch.float64), torch.randint(0, 10, (2,))
    for forced in [
        (f"G_n by {conv.GROUPED}",),
        (f"G_n by {conv.WINDOWS}", "G_n by unfold + bmm"),
        (f"Gram form, projections by {conv.CONVOLUTION}", f"projections by {conv.CONVOLUTION}"),
    ]:
        with kernels.forcing(*forced):
            requests = [NORMS_AND_PROJECTIONS, PROJECTION]
            if forced[0].startswith("G_n"):
                requests.append(EVERYTHING)
            assert_matches_the_loop(model, X, y, ce, requests)


def test_the_choice_is_measured_once_kept_and_logged_once(monkeypatch, caplog):
    """The fastest plan by the (fake) clock wins whichever it is; a second step reuses it
    without timing, and the layer's choice is logged once."""
    monkeypatch.setattr(kernels, "MEASURED_FLOPS", 0)  # measure even this small layer
    timed: list[str] = []

    def fake_seconds(plans, n, samples, device):
        timed.extend(plans)
        return {name: costs[name] for name in plans}

    monkeypatch.setattr(kernels, "_seconds", fake_seconds)
    # T = 4 positions: the Gram form, 16 (81 + 8) FLOPs, is within 3x of materialising
    layer, shape = (lambda: nn.Conv2d(9, 8, 3)), (9, 4, 4)
    costs = {
        f"G_n by {conv.GROUPED}": 3.0,
        f"G_n by {conv.WINDOWS}": 1.0,  # the fastest by the fake clock
        "G_n by unfold + bmm": 2.0,
        "Gram form": 5.0,
    }
    with caplog.at_level(logging.INFO, logger="avionics"):
        for _ in range(2):
            assert_matches_the_loop(*problem(layer, shape), [NORMS])
    assert sorted(timed) == sorted(costs)  # each plan timed once, at the first step
    (choice,) = kernels.CHOICES.values()
    assert choice.name == f"G_n by {conv.WINDOWS}"
    (record,) = [r for r in caplog.records if r.getMessage().startswith("conv Conv2d(9, 8")]
    message = record.getMessage()
    assert record.levelno == logging.INFO
    assert "[N, 9, 4, 4] -> [N, 8, 2, 2], squared norms: G_n by windows" in message
    assert "(1000.00 ms vs G_n by unfold + bmm 2000.00 ms, G_n by grouped convolution" in message


def test_plans_far_apart_in_flops_are_not_timed(monkeypatch, caplog):
    """The Gram form of a layer with many output positions takes far more FLOPs than
    materialising G_n: it is ruled out without running, and the log says so."""
    monkeypatch.setattr(kernels, "MEASURED_FLOPS", 0)
    layer, shape = (lambda: nn.Conv2d(2, 3, 3)), (2, 12, 12)  # T = 100, I = 18, O = 3
    with caplog.at_level(logging.INFO, logger="avionics"):
        assert_matches_the_loop(*problem(layer, shape), [NORMS])
    (choice,) = kernels.CHOICES.values()
    assert choice.name.startswith("G_n by") and "Gram form" not in choice.seconds
    assert choice.skipped["Gram form"] == pytest.approx(100 * 100 * 21 / (100 * 18 * 3 + 18 * 3))
    assert "not timed, FLOPs over the cheapest: Gram form" in caplog.text


def test_small_layers_take_the_prior_plan_unmeasured(monkeypatch):
    """Below MEASURED_FLOPS nothing is timed or kept: the prior plan runs."""
    monkeypatch.setattr(kernels, "_seconds", lambda *args: pytest.fail("timed a small layer"))
    assert_matches_the_loop(*problem(*LAYERS["2d dilation 2"]), [NORMS, PROJECTION])
    assert kernels.CHOICES == {}


def test_forcing_a_plan_the_layer_lacks_names_the_plans():
    module, shape = LAYERS["2d stride 2 uneven"]
    with kernels.forcing("G_n by magic"), pytest.raises(ValueError, match="G_n by magic"):
        assert_matches_the_loop(*problem(module, shape), [NORMS])


class TiedConvolutions(nn.Module):
    """Two convolutions sharing one weight: its g_n sums both layers' materialised G_n."""

    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(3, 3, 3, padding=1)
        self.second = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.second.weight = self.first.weight
        self.out = nn.Linear(3 * 5 * 4, 3)

    def forward(self, x):
        return self.out(self.second(torch.tanh(self.first(x))).flatten(1))


@pytest.mark.parametrize("kernel", GRADIENT_KERNELS)
def test_tied_weights_sum_the_gradients_of_every_kernel(kernel):
    torch.manual_seed(0)
    model = TiedConvolutions().double()
    X, y = torch.randn(3, 3, 5, 4, dtype=torch.float64), torch.randint(0, 3, (3,))
    with kernels.forcing(f"G_n by {kernel}"):
        assert_matches_the_loop(model, X, y, ce, [NORMS, NORMS_AND_PROJECTIONS])


def test_visitors_see_each_sample_once_when_the_choice_is_measured(monkeypatch):
    """The timing runs leave the visitors (histograms) out: each sample's g_n reaches them
    once, equal to the loop's."""
    monkeypatch.setattr(kernels, "MEASURED_FLOPS", 0)
    model, X, y, loss_fn = problem(*LAYERS["2d wide stride 1"])
    _, step, _, params = models.captured_engine_step(model, X, y, loss_fn)
    reference = models.per_sample_gradients(model, X, y, loss_fn, params)
    seen: dict[int, list] = {}
    step.statistics(Request(visitors=(lambda k, chunk: seen.setdefault(k, []).append(chunk),)), {})
    assert kernels.CHOICES  # the convolution's plan was measured
    for k, ref in enumerate(reference):
        chunks = [c if isinstance(c, torch.Tensor) else c.materialize() for c in seen[k]]
        torch.testing.assert_close(torch.cat(chunks), ref, rtol=RTOL, atol=ATOL)


def test_beyond_max_choices_new_layers_take_the_prior_plan(monkeypatch):
    monkeypatch.setattr(kernels, "MEASURED_FLOPS", 0)
    monkeypatch.setattr(kernels, "MAX_CHOICES", 0)
    monkeypatch.setattr(kernels, "_seconds", lambda *args: pytest.fail("timed past the cap"))
    assert_matches_the_loop(*problem(*LAYERS["2d wide stride 1"]), [NORMS, PROJECTION])
    assert kernels.CHOICES == {}


def test_rules_do_not_keep_themselves_alive():
    """The layer's kernels reach the rule through weak references: dropping the step frees
    its captured tensors without the garbage collector."""
    import gc
    import weakref

    gc.disable()
    try:
        _, step, _, _ = models.captured_engine_step(*problem(*LAYERS["2d wide stride 1"]))
        step.statistics(NORMS, {})
        rule = next(r for r in step.rules.values() if isinstance(r, conv.ConvRule))
        refs = [weakref.ref(rule), weakref.ref(rule._weight()), weakref.ref(rule.delta)]
        del rule, step
        assert [r() for r in refs] == [None] * 3
    finally:
        gc.enable()


def test_timing_takes_turns_and_extrapolates_the_fastest_run_to_the_batch(monkeypatch):
    """With a clock that each run advances by its plan's cost per sample times its samples
    (plus a one-off warm-up on the first run of each plan), every plan's estimate is its
    cost per sample times n: the warm-up is discarded, the plans run in turns, and those
    clearly slower than the fastest stop running."""
    now, order = [0.0], []

    def plan(name, per_sample):
        def run(start, stop):
            order.append(name)
            now[0] += per_sample * (stop - start) + (10.0 if order.count(name) == 1 else 0.0)

        return kernels.Plan(flops=1.0, run=run)

    monkeypatch.setattr(kernels, "_clock", lambda device: now[0])
    plans = {"a": plan("a", 2.0), "b": plan("b", 1.5), "c": plan("c", 0.1)}
    seconds = kernels._seconds(plans, 100, 4, torch.device("cpu"))
    # the first round has the warm-ups (a 18, b 16, c 10.4); after the second (a 8, b 6,
    # c 0.4) a and b are clearly slower and sit the third out
    assert seconds == pytest.approx({"a": 200.0, "b": 150.0, "c": 10.0})
    assert order == ["a", "b", "c", "a", "b", "c", "c"]


def test_the_prior_plan_stays_unless_another_is_clearly_faster(monkeypatch, caplog):
    """The small layer's prior is the Gram form (fewer FLOPs than materialising): a plan
    measured 10% faster does not replace it (one 5x faster does: the test above), and the log
    says why."""
    monkeypatch.setattr(kernels, "MEASURED_FLOPS", 0)
    costs = {
        f"G_n by {conv.GROUPED}": 3.0,
        f"G_n by {conv.WINDOWS}": 1.0,
        "G_n by unfold + bmm": 2.0,
        "Gram form": 1.1,
    }
    monkeypatch.setattr(
        kernels, "_seconds", lambda plans, *args: {name: costs[name] for name in plans}
    )
    with caplog.at_level(logging.INFO, logger="avionics"):
        assert_matches_the_loop(*problem(lambda: nn.Conv2d(9, 8, 3), (9, 4, 4)), [NORMS])
    (choice,) = kernels.CHOICES.values()
    assert choice.name == choice.prior == "Gram form"
    assert f"the prior plan, kept: none is {kernels.PRIOR_MARGIN:g}x faster" in caplog.text
