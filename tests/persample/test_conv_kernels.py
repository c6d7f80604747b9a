"""Convolution per-sample kernels chosen by a fixed per-shape rule (issues 17 and 25).

Every plan of a convolution (G_n by unfolding, by one grouped convolution, by the weight
gradient of the samples as groups; the Gram form with projections by the unfolded input or the
layer's own convolution) is forced in turn and checked against the loop over samples in
float64; the rule's choice is checked per layer shape: the same for every dtype and run,
logged once.
"""

import logging

import models
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from avionics.persample import Request
from avionics.persample.rules import bilinear, conv, kernels

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

GRADIENT_KERNELS = ["unfold + bmm", conv.GROUPED, conv.SAMPLES_AS_GROUPS]
PROJECTION_KERNELS = ["the unfolded input", conv.CONVOLUTION]

# what each request needs of the per-sample gradients
EVERYTHING = Request(sq_norms=True, sum_sq=True, directions=frozenset({"grad", "other"}))
NORMS_AND_PROJECTIONS = Request(sq_norms=True, directions=frozenset({"grad", "other"}))
NORMS = Request(sq_norms=True)
PROJECTION = Request(directions=frozenset({"other"}))


@pytest.fixture(autouse=True)
def fresh_log():
    """Each test starts with no choice logged and leaves none behind."""
    kernels.LOGGED.clear()
    yield
    kernels.LOGGED.clear()


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


@pytest.mark.parametrize("kernel", GRADIENT_KERNELS)
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_materialised_gradients_of_every_kernel_match_the_loop(layer, kernel):
    module, shape = LAYERS[layer]
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
        (f"G_n by {conv.SAMPLES_AS_GROUPS}",),
        (f"Gram form, projections by {conv.CONVOLUTION}", f"projections by {conv.CONVOLUTION}"),
    ]:
        with kernels.forcing(*forced):
            requests = [NORMS_AND_PROJECTIONS, PROJECTION]
            if forced[0].startswith("G_n"):
                requests.append(EVERYTHING)
            assert_matches_the_loop(model, X, y, ce, requests)


def rule_plan(make_layer, shape, request, dtype=torch.float64) -> str:
    """The plan the layer's rule takes for ``request`` (no plan forced)."""
    model, X, y, loss_fn = problem(make_layer, shape)
    model, X = model.to(dtype), X.to(dtype)
    _, step, mean_grad, _ = models.captured_engine_step(model, X, y, loss_fn)
    taken = []
    original = bilinear.choose

    def record(key, plans, prior, describe):
        taken.append(original(key, plans, prior, describe))
        return taken[-1]

    bilinear.choose = record
    try:
        step.statistics(request, {d: mean_grad for d in request.directions})
    finally:
        bilinear.choose = original
    (name,) = taken
    return name


@pytest.mark.parametrize(
    "layer, shape, plan",
    [
        # one channel per group: the grouped convolution (4x faster than unfolding)
        (lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4), (4, 8, 8), f"G_n by {conv.GROUPED}"),
        # fewer than 8 input channels: the grouped convolution
        (lambda: nn.Conv2d(3, 8, 3, padding=1), (3, 8, 8), f"G_n by {conv.GROUPED}"),
        # wide, 64 output positions: the weight gradient of the samples as groups, with
        # groups, stride 2 and in 1d too
        (lambda: nn.Conv2d(8, 4, 3, padding=1), (8, 8, 8), f"G_n by {conv.SAMPLES_AS_GROUPS}"),
        (
            lambda: nn.Conv2d(16, 4, 3, padding=1, groups=2),
            (16, 8, 8),
            f"G_n by {conv.SAMPLES_AS_GROUPS}",
        ),
        (
            lambda: nn.Conv2d(8, 4, 3, stride=2, padding=1),
            (8, 16, 16),
            f"G_n by {conv.SAMPLES_AS_GROUPS}",
        ),
        (lambda: nn.Conv1d(8, 4, 3), (8, 66), f"G_n by {conv.SAMPLES_AS_GROUPS}"),
        # wide, 36 output positions: unfolding
        (lambda: nn.Conv2d(8, 4, 3, padding=1), (8, 6, 6), "G_n by unfold + bmm"),
        (lambda: nn.Conv1d(8, 4, 3), (8, 65), "G_n by unfold + bmm"),  # 63 positions
        # a 1 x 1 kernel: unfolding (a copy of the input)
        (lambda: nn.Conv2d(8, 4, 1), (8, 8, 8), "G_n by unfold + bmm"),
    ],
)
def test_the_rule_forms_materialised_gradients_by_the_layers_shape(layer, shape, plan):
    visitor = Request(visitors=(lambda index, chunk: None,))
    assert rule_plan(layer, shape, visitor) == plan


def test_the_rule_projects_by_the_layers_convolution():
    layer, shape = (lambda: nn.Conv2d(3, 8, 3, padding=1)), (3, 8, 8)
    assert rule_plan(layer, shape, PROJECTION) == f"projections by {conv.CONVOLUTION}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_choice_is_the_same_for_every_dtype_and_run(dtype):
    """Deterministic: the same plan for float32 and float64, in one run and the next."""
    layer, shape = (lambda: nn.Conv2d(9, 8, 3)), (9, 4, 4)
    first = rule_plan(layer, shape, NORMS, dtype)
    kernels.LOGGED.clear()
    assert rule_plan(layer, shape, NORMS, dtype) == first == "Gram form"


def test_the_choice_is_logged_once_per_layer_and_request(caplog):
    """A second step takes the same plan without a second log line; the line names the layer,
    the request, the plan and the FLOPs of the others over its."""
    layer, shape = (lambda: nn.Conv2d(9, 8, 3)), (9, 4, 4)
    with caplog.at_level(logging.INFO, logger="avionics"):
        for _ in range(2):
            assert_matches_the_loop(*problem(layer, shape), [NORMS])
    (record,) = [r for r in caplog.records if r.getMessage().startswith("conv Conv2d(9, 8")]
    message = record.getMessage()
    assert record.levelno == logging.INFO
    assert "[N, 9, 4, 4] -> [N, 8, 2, 2], squared norms: Gram form (by the layer's rule" in message
    # T = 4 positions: materialising takes 4 * 81 * 8 + 81 * 8 FLOPs, the Gram form 16 * 89
    assert f"G_n by unfold + bmm {(4 * 648 + 648) / (16 * 89):.1f}x" in message


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


def test_visitors_see_each_sample_once():
    """The materialised gradients reach the visitors (histograms) once per sample, equal to
    the loop's."""
    model, X, y, loss_fn = problem(*LAYERS["2d wide stride 1"])
    _, step, _, params = models.captured_engine_step(model, X, y, loss_fn)
    reference = models.per_sample_gradients(model, X, y, loss_fn, params)
    seen: dict[int, list] = {}
    step.statistics(Request(visitors=(lambda k, chunk: seen.setdefault(k, []).append(chunk),)), {})
    for k, ref in enumerate(reference):
        chunks = [c if isinstance(c, torch.Tensor) else c.materialize() for c in seen[k]]
        torch.testing.assert_close(torch.cat(chunks), ref, rtol=RTOL, atol=ATOL)


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


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_the_checks_total_by_the_weight_gradient_kernel_matches_the_loop(layer):
    """sum_n g_n (what the engine checks against autograd at a first step), formed by the
    convolution's weight-gradient kernel, equals the sum of the loop's per-sample gradients."""
    model, X, y, loss_fn = problem(*LAYERS[layer])
    _, step, _, params = models.captured_engine_step(model, X, y, loss_fn)
    reference = models.per_sample_gradients(model, X, y, loss_fn, params)
    rule = next(r for r in step.rules.values() if isinstance(r, conv.ConvRule))
    for total, p in zip(rule.total(), rule.params, strict=True):
        k = next(i for i, q in enumerate(params) if q is p)
        torch.testing.assert_close(total, reference[k].sum(0), rtol=RTOL, atol=ATOL)
