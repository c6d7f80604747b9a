"""The diagnosis on constructed runs: each finding fires when its data says so, and only then."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from synthetic import synthetic_run

from avionics.diagnosis import diagnose, report
from avionics.records import Run

SGD = {"optimizer": {"name": "SGD", "param_groups": [{"lr": 0.1, "momentum": 0.0}]}}


def run_of(num_steps=40, metadata=SGD, **columns) -> Run:
    """A run whose column ``name`` holds ``values`` (a list, or a function of the step)."""
    steps = {}
    for step in range(num_steps):
        steps[step] = {}
        for name, values in columns.items():
            value = values(step) if callable(values) else values[step]
            if value is not None:
                steps[step][name] = value
    return Run.from_output(steps, metadata=metadata)


def checks(run) -> list[str]:
    return [f.check for f in diagnose(run)]


def only(run, check):
    (finding,) = [f for f in diagnose(run) if f.check == check]
    assert re.search(r"\d", finding.evidence), "a finding must state its numbers"
    return finding


def smooth_loss(step):
    return 2.0 * math.exp(-step / 30) + 0.3 + 0.01 * math.sin(7 * step)


def test_a_healthy_run_has_no_findings():
    run = synthetic_run(60)
    run.metadata["batch_size"] = 100  # CABS suggests about 104: no reason to change
    assert diagnose(run) == []
    text = report(run)
    assert "No problems found" in text
    assert "Not checked" not in text


def test_step_size_too_large_fires_on_alpha_mostly_above_one():
    alpha = [0.0] * 20 + [1.6] * 15 + [0.5] * 5  # latest half: 15 of 20 above 1
    finding = only(run_of(Alpha=alpha, Loss=smooth_loss), "step_size_too_large")
    assert "15 of the latest 20 tracked steps (75%, steps 20-39)" in finding.evidence
    assert finding.step == 20
    assert "lower the learning rate" in finding.advice


@pytest.mark.parametrize(
    "alpha",
    [[0.3] * 40, [1.6] * 10 + [0.1] * 30, [1.6] * 4 + [None] * 36, [1.6] * 20 + [0.9] * 20],
)
def test_step_size_too_large_does_not_fire_otherwise(alpha):
    assert "step_size_too_large" not in checks(run_of(Alpha=alpha))


def test_step_size_too_small_fires_on_alpha_near_minus_one():
    finding = only(run_of(Alpha=lambda s: -0.97 + 0.01 * (s % 3)), "step_size_too_small")
    assert "median alpha is -0.96" in finding.evidence
    assert "raise the learning rate" in finding.advice
    assert "step_size_too_small" not in checks(run_of(Alpha=lambda s: -0.5))


def test_edge_of_stability_for_sgd():
    at_edge = only(run_of(HessMaxEV=lambda s: 19.6), "edge_of_stability")
    assert at_edge.title.startswith("The run sits at the edge of stability")
    assert "lr * largest Hessian eigenvalue = 1.96" in at_edge.evidence
    assert "2 / lambda_max = 0.102" in at_edge.advice
    beyond = only(run_of(HessMaxEV=lambda s: 30.0), "edge_of_stability")
    assert beyond.title.startswith("The run is beyond the edge of stability")


def test_edge_of_stability_uses_the_logged_learning_rate():
    lr = [0.1] * 20 + [0.2] * 20  # HessMaxEV 10: 1.0, then 2.0 once the lr doubles
    run = run_of(HessMaxEV=lambda s: 10.0, learning_rate=lr)
    finding = only(run, "edge_of_stability")
    assert "= 2 (median" in finding.evidence and finding.step == 20


@pytest.mark.parametrize(
    "metadata, hess",
    [
        (SGD, 10.0),  # lr * lambda = 1: stable
        ({"optimizer": {"name": "Adam", "param_groups": [{"lr": 0.1}]}}, 19.6),
        ({"optimizer": {"name": "SGD", "param_groups": [{"lr": 0.1, "momentum": 0.9}]}}, 19.6),
        ({}, 19.6),  # no learning rate anywhere
    ],
)
def test_edge_of_stability_does_not_fire_otherwise(metadata, hess):
    assert "edge_of_stability" not in checks(run_of(metadata=metadata, HessMaxEV=lambda s: hess))


def test_edge_of_stability_with_unknown_optimizer_states_its_assumption():
    finding = only(
        run_of(metadata={}, HessMaxEV=lambda s: 19.6, learning_rate=lambda s: 0.1),
        "edge_of_stability",
    )
    assert "this assumes plain SGD" in finding.evidence


def test_gradient_noise_suggests_a_batch_size():
    run = run_of(metadata={**SGD, "batch_size": 32}, NormTest=lambda s: 2.0)
    finding = only(run, "gradient_noise")
    assert finding.title.endswith("a batch size of about 128 (now 32)")
    assert "norm test median 2.00 over the latest 20 tracked steps" in finding.evidence
    unknown = only(run_of(NormTest=lambda s: 2.0), "gradient_noise")
    assert "about 4.0 times the current one" in unknown.title
    assert "gradient_noise" not in checks(run_of(NormTest=lambda s: 0.8))
    assert "gradient_noise" not in checks(run_of(NormTest=[3.0] * 20 + [0.5] * 20))


def test_gradient_noise_uses_the_smoothed_noise_scale_when_the_run_has_it():
    size_32 = {**SGD, "batch_size": 32}
    noise_scale = [10.0] * 25 + [500.0] * 15
    finding = only(
        run_of(metadata=size_32, NormTest=lambda s: 0.5, GradientNoiseScale=noise_scale),
        "gradient_noise",
    )
    assert finding.title == (
        "Gradient noise dominates: the gradient noise scale suggests a batch size of about 500 "
        "(now 32)"
    )
    assert (
        "smoothed gradient noise scale B_simple = tr(Sigma) / |G|^2 = 500.0 at step 39, above "
        "the batch size 32 since step 25" in finding.evidence
    )
    assert "estimate of the critical batch size" in finding.evidence
    assert finding.step == 25
    assert "a batch size of about 500" in finding.advice
    # below the batch size: no finding, though the norm test alone would make one
    quiet = run_of(metadata=size_32, NormTest=lambda s: 2.0, GradientNoiseScale=lambda s: 20.0)
    assert "gradient_noise" not in checks(quiet)


def test_a_negative_noise_scale_says_the_gradient_is_not_resolved():
    run = run_of(metadata={**SGD, "batch_size": 32}, GradientNoiseScale=lambda s: -40.0)
    finding = only(run, "gradient_noise")
    assert finding.title.endswith("suggests a much larger batch size (now 32)")
    assert "= -40.0 at step 39, negative" in finding.evidence
    assert "the gradient is not resolved from the noise" in finding.evidence
    assert finding.step == 0


def test_gradient_noise_falls_back_to_the_norm_test():
    """Without the batch size, or with fewer than 3 noise-scale values, B_simple cannot be
    compared to the batch: the norm test decides."""
    unknown_size = only(
        run_of(NormTest=lambda s: 2.0, GradientNoiseScale=lambda s: 500.0), "gradient_noise"
    )
    assert unknown_size.title.startswith("Gradient noise dominates: the norm test suggests")
    assert "norm test median 2.00" in unknown_size.evidence
    few = [500.0, 500.0] + [None] * 38
    run = run_of(
        metadata={**SGD, "batch_size": 32}, NormTest=lambda s: 2.0, GradientNoiseScale=few
    )
    assert only(run, "gradient_noise").title.endswith(
        "norm test suggests a batch size of about 128 (now 32)"
    )


def test_batch_size_logged_at_steps_wins_over_metadata():
    run = run_of(
        metadata={**SGD, "batch_size": 32}, NormTest=lambda s: 2.0, batch_size=lambda s: 64
    )
    assert only(run, "gradient_noise").title.endswith("about 256 (now 64)")


def test_cabs_fires_when_it_differs_from_the_batch_size():
    run = run_of(metadata={**SGD, "batch_size": 32}, CABS=lambda s: 100.0)
    finding = only(run, "cabs_batch_size")
    assert finding.title == "CABS suggests a batch size of about 100"
    assert "against the batch size in use, 32" in finding.evidence
    close = run_of(metadata={**SGD, "batch_size": 64}, CABS=lambda s: 100.0)
    assert "cabs_batch_size" not in checks(close)


def test_early_stopping_fires_when_the_criterion_turns_positive():
    criterion = [-1.0] * 34 + [0.2] * 6
    finding = only(run_of(EarlyStopping=criterion), "early_stopping")
    assert "criterion > 0 at 5 of the latest 5" in finding.evidence
    assert "positive since step 34" in finding.evidence
    assert "early_stopping" not in checks(run_of(EarlyStopping=lambda s: -0.5))
    assert "early_stopping" not in checks(run_of(EarlyStopping=[-1.0] * 38 + [0.3] * 2))


def test_loss_and_gradient_norm_spikes_say_where_they_began():
    loss = [smooth_loss(s) for s in range(60)]
    loss[30] *= 4
    loss[45:47] = [loss[45] * 6, loss[46] * 3]
    norms = [[1.0 + 0.05 * math.sin(s)] for s in range(60)]
    norms[50] = [5.0]
    findings = diagnose(run_of(60, Loss=loss, GradNorm=norms))
    by_check = {f.check: f for f in findings}
    assert set(by_check) == {"loss_spikes", "gradnorm_spikes"}
    assert by_check["loss_spikes"].title == "Loss spikes: 2 times, the first at step 30"
    assert (
        "spikes began at steps 30, 45; the largest, at step 45" in by_check["loss_spikes"].evidence
    )
    assert by_check["gradnorm_spikes"].step == 50


def test_no_spikes_in_smooth_noisy_or_drifting_series():
    rng = np.random.default_rng(0)
    noisy = (1 + 0.1 * rng.standard_normal(200)).tolist()
    drifting = [0.5 + 0.01 * s for s in range(200)]
    for loss in (noisy, drifting, [smooth_loss(s) for s in range(200)]):
        assert checks(run_of(200, Loss=loss)) == []


def test_non_finite_values_name_the_first_step_and_quantities():
    loss = [1.0] * 30 + [math.nan] * 10
    norms = [[1.0]] * 29 + [[math.inf]] + [[1.0]] * 10
    finding = only(run_of(Loss=loss, GradNorm=norms), "non_finite_values")
    assert finding.title == "Non-finite values from step 29 on"
    assert finding.evidence == (
        "GradNorm is inf at step 29 (1 step(s)); Loss is nan at step 30 (10 step(s))."
    )
    assert "non_finite_values" not in checks(run_of(Loss=lambda s: 1.0))


def test_report_lists_unchecked_groups_and_unreadable_lines():
    run = run_of(Loss=smooth_loss)
    run.problems.append("line 7: not valid JSON; ignored")
    text = report(run)
    assert "Not checked, no data: step size (alpha) (needs Alpha);" in text
    assert "1 problem(s) reading the log:\n  line 7: not valid JSON" in text


def test_findings_are_ordered_by_the_step_where_they_began():
    loss = [1.0] * 30 + [math.nan] * 10
    alpha = [0.0] * 10 + [2.0] * 30
    steps = [f.step for f in diagnose(run_of(Loss=loss, Alpha=alpha))]
    assert steps == sorted(steps) and len(steps) == 2
