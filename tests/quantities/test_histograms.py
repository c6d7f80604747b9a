"""GradHist1d and GradHist2d against numpy on brute-force per-sample gradients."""

import models
import numpy as np
import pytest
import torch
from reference import gradient_quantities

from avionics import Cockpit, quantities


def brute_force(model, X, y, loss_fn):
    """Per-sample gradients [N, D] and parameters [D] as numpy arrays."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_param = models.per_sample_gradients(model, X, y, loss_fn)
    G = torch.cat([g.reshape(g.shape[0], -1) for g in per_param], 1).numpy()
    theta = torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy()
    return G, theta, [g.reshape(g.shape[0], -1).numpy() for g in per_param], params


def run(build, hist_quantities, steps=3, n=4, lr=0.5, extra=()):
    model, X, y, loss_fn = build(n=n)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cockpit = Cockpit(model, list(hist_quantities) + list(extra))
    references = []
    for step in range(steps):
        G, theta, per_param, params = brute_force(model, X, y, loss_fn)
        references.append(
            {
                "G": G,
                "theta": theta,
                "per_param": per_param,
                "thetas": [p.detach().reshape(-1).numpy().copy() for p in params],
                "tests": gradient_quantities(model, X, y, loss_fn),
            }
        )
        opt.zero_grad()
        losses = loss_fn(model(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": n}
        with cockpit(step, info=info):
            losses.mean().backward()
        opt.step()
    return cockpit.get_output(), references


def near_edges(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Which values lie (to rounding) on an inner bin edge, where a bin choice may differ."""
    inner = edges[1:-1]
    width = edges[1] - edges[0]
    index = np.clip(np.searchsorted(inner, values), 0, len(inner) - 1)
    distance = np.abs(values - inner[index])
    distance = np.minimum(distance, np.abs(values - inner[np.clip(index - 1, 0, None)]))
    return distance <= 1e-9 * width


def assert_counts_match(ours, expected, ambiguous: int):
    ours, expected = np.asarray(ours), np.asarray(expected)
    assert ours.shape == expected.shape
    assert ours.sum() == expected.sum()
    # a value on an edge moves one count from one bin to its neighbour: 2 per value at most
    assert np.abs(ours - expected).sum() <= 2 * ambiguous


def expected_1d(G, bins, lo, hi):
    values = np.clip(G.reshape(-1), lo, hi)
    counts, edges = np.histogram(values, bins=bins, range=(lo, hi))
    return counts, edges, int(near_edges(values, edges).sum())


def expected_2d(G, theta, bins, ranges):
    (xlo, xhi), (ylo, yhi) = ranges
    gx = np.clip(G, xlo, xhi).reshape(-1)
    ty = np.clip(np.broadcast_to(theta, G.shape), ylo, yhi).reshape(-1)
    counts, xedges, yedges = np.histogram2d(gx, ty, bins=bins, range=ranges)
    ambiguous = int((near_edges(gx, xedges) | near_edges(ty, yedges)).sum())
    return counts, xedges, yedges, ambiguous


@pytest.mark.parametrize("architecture", sorted(models.ARCHITECTURES))
def test_grad_hist_1d_matches_numpy(architecture):
    # an odd number of bins: 0 (many g_{n,d} are exactly 0) is a bin centre, not an edge
    hist = quantities.GradHist1d(bins=31, range=(-0.5, 0.5))
    output, refs = run(models.ARCHITECTURES[architecture], [hist])
    for step, ref in enumerate(refs):
        value = output[step]["GradHist1d"]
        counts, edges, ambiguous = expected_1d(ref["G"], 31, -0.5, 0.5)
        assert ambiguous <= 2
        assert value["edges"] == pytest.approx(edges.tolist(), abs=0)
        assert sum(value["hist"]) == ref["G"].size  # N * D
        assert_counts_match(value["hist"], counts, ambiguous)


def test_grad_hist_1d_defaults_and_clamping():
    hist = quantities.GradHist1d()
    output, refs = run(models.mlp, [hist], steps=1, lr=0.0)
    value = output[0]["GradHist1d"]
    assert len(value["hist"]) == 100 and value["edges"] == np.linspace(-2, 2, 101).tolist()
    counts, _, ambiguous = expected_1d(refs[0]["G"], 100, -2, 2)
    assert_counts_match(value["hist"], counts, ambiguous)
    # a narrow range: nearly everything is clamped into the two outer bins
    output, refs = run(models.mlp, [quantities.GradHist1d(bins=4, range=(-1e-3, 1e-3))], 1)
    counts, _, ambiguous = expected_1d(refs[0]["G"], 4, -1e-3, 1e-3)
    assert counts[0] + counts[-1] > 0
    assert_counts_match(output[0]["GradHist1d"]["hist"], counts, ambiguous)


@pytest.mark.parametrize("policy", ["grad", "param"])
@pytest.mark.parametrize("architecture", ["mlp", "transformer"])
def test_grad_hist_1d_adaptation_applies_from_the_next_step(architecture, policy):
    adapt = (quantities.GradAbsMax if policy == "grad" else quantities.ParamAbsMax)(
        padding=0.1, min_size=1e-6
    )
    output, refs = run(models.ARCHITECTURES[architecture], [quantities.GradHist1d(
        bins=21, adapt=adapt)])  # fmt: skip
    lo, hi = -2.0, 2.0  # the first step uses the given range
    for step, ref in enumerate(refs):
        value = output[step]["GradHist1d"]
        counts, edges, ambiguous = expected_1d(ref["G"], 21, lo, hi)
        assert value["edges"] == pytest.approx(edges.tolist(), rel=1e-12)
        assert_counts_match(value["hist"], counts, ambiguous)
        m = np.abs(ref["G"]).max() if policy == "grad" else np.abs(ref["theta"]).max()
        hi = 1.1 * max(1e-6 / 2, m)
        lo = -hi


def test_adaptation_minimum_size():
    adapt = quantities.GradAbsMax(min_size=10.0)
    output, _ = run(models.mlp, [quantities.GradHist1d(bins=10, adapt=adapt)], steps=2)
    assert output[1]["GradHist1d"]["edges"][0] == -5.0
    assert output[1]["GradHist1d"]["edges"][-1] == 5.0


@pytest.mark.parametrize("architecture", sorted(models.ARCHITECTURES))
def test_grad_hist_2d_matches_numpy(architecture):
    ranges = ((-0.3, 0.3), (-0.6, 0.6))
    hist = quantities.GradHist2d(bins=(13, 9), range=ranges, per_parameter=True)
    output, refs = run(models.ARCHITECTURES[architecture], [hist], steps=2)
    for step, ref in enumerate(refs):
        value = output[step]["GradHist2d"]
        counts, xedges, yedges, ambiguous = expected_2d(ref["G"], ref["theta"], (13, 9), ranges)
        assert ambiguous <= 2
        assert value["edges"][0] == pytest.approx(xedges.tolist(), abs=0)
        assert value["edges"][1] == pytest.approx(yedges.tolist(), abs=0)
        assert np.sum(value["hist"]) == ref["G"].size
        assert_counts_match(value["hist"], counts, ambiguous)
        assert len(value["param_hist"]) == len(ref["per_param"])
        for ours, G, theta in zip(value["param_hist"], ref["per_param"], ref["thetas"]):
            c, _, _, amb = expected_2d(G, theta, (13, 9), ranges)
            assert_counts_match(ours, c, amb)


def test_grad_hist_2d_defaults_and_adaptation():
    adapt = (quantities.GradAbsMax(padding=0.05), quantities.ParamAbsMax(padding=0.2))
    output, refs = run(models.cnn, [quantities.GradHist2d(adapt=adapt)], steps=3)
    ranges = ((-1.0, 1.0), (-2.0, 2.0))
    for step, ref in enumerate(refs):
        value = output[step]["GradHist2d"]
        assert "param_hist" not in value
        assert np.shape(value["hist"]) == (40, 50)
        counts, xedges, yedges, ambiguous = expected_2d(ref["G"], ref["theta"], (40, 50), ranges)
        assert value["edges"][0] == pytest.approx(xedges.tolist(), rel=1e-12)
        assert value["edges"][1] == pytest.approx(yedges.tolist(), rel=1e-12)
        assert_counts_match(value["hist"], counts, ambiguous)
        gx = 1.05 * np.abs(ref["G"]).max()
        ty = 1.2 * np.abs(ref["theta"]).max()
        ranges = ((-gx, gx), (-ty, ty))


def test_other_statistics_unchanged_when_histograms_materialise():
    hists = [quantities.GradHist1d(), quantities.GradHist2d()]
    tests = [quantities.NormTest(), quantities.InnerTest(), quantities.OrthoTest()]
    output, refs = run(models.transformer, hists, steps=2, extra=tests)
    for step, ref in enumerate(refs):
        for name in ["NormTest", "InnerTest", "OrthoTest"]:
            assert output[step][name] == pytest.approx(ref["tests"][name], rel=1e-9)


def test_bad_arguments():
    with pytest.raises(ValueError, match="lower < upper"):
        quantities.GradHist1d(range=(1, -1))
    with pytest.raises(ValueError, match="bins=0.*integer >= 1"):
        quantities.GradHist1d(bins=0)
    with pytest.raises(TypeError, match="GradAbsMax"):
        quantities.GradHist1d(adapt="grad")
    with pytest.raises(TypeError, match="bins=\\(3,\\).*pair"):
        quantities.GradHist2d(bins=(3,))
