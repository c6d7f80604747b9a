"""Issue 24's acceptance: every preset finishes two tracked steps on every architecture of
tests/real_models.py, with a plain forward of another copy of the model between them (an EMA
copy, a teacher), in the plain loop, under the Lightning callback and under CockpitTrainer.
This module holds what the three share: the tiny models, the presets, the verdict."""

from __future__ import annotations

import math

import pytest
import real_models
import torch

from avionics import configuration

# The architectures of issue 24, tiny: (model, X, y, individual_loss_fn) in float32.
TINY = {
    "gpt2": lambda **kw: real_models.gpt2_lm(n=3, t=6, width=16, **kw),
    "bert": lambda **kw: real_models.bert_classifier(n=3, t=6, width=16, **kw),
    "encoder": lambda **kw: real_models.transformer_encoder(n=3, t=6, width=16, **kw),
    "resnet": lambda **kw: real_models.basic_block_resnet(n=4, image=8, **kw),
    "lstm_lm": lambda **kw: real_models.lstm_lm(n=3, t=4, vocab=8, **kw),
    "packed_gru": lambda **kw: real_models.packed_gru(n=3, t=4, **kw),
    "vit": lambda **kw: real_models.vit(n=3, **kw),
}
PRESETS = ("economy", "business", "full", "transformer")
# Under the frameworks: economy on every architecture; the richer presets (HessMaxEV's
# Lanczos, the curvature diagonals: slow, minutes on two cores) on the causal LM (token losses,
# auto's Monte-Carlo GGN diagonal), the ViT (root-level parameters) and the ResNet (train-mode
# BatchNorm).
FRAMEWORK_RUNS = [pytest.param(name, "economy", id=f"{name}-economy") for name in sorted(TINY)] + [
    pytest.param(name, preset, id=f"{name}-{preset}", marks=pytest.mark.slow)
    for name in ("gpt2", "vit", "resnet")
    for preset in PRESETS[1:]
]


def optimizer_for(preset: str, params) -> torch.optim.Optimizer:
    """AdamW for the transformer preset (its UpdateRatio and preconditioned sharpness read
    Adam's state), SGD otherwise."""
    make = torch.optim.AdamW if preset == "transformer" else torch.optim.SGD
    return make(params, lr=1e-3)


def finite(value) -> bool:
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(finite(v) for v in value)
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return not isinstance(value, float) or math.isfinite(value)


def assert_the_preset_ran(output: dict, preset: str, messages: list[str]) -> None:
    """Two tracked steps (0 and 1) with every quantity the preset tracks at step 0 finite
    (Alpha, UpdateSize and UpdateRatio need step 1's start; UpdateRatio is nan, no ratio, for
    a zero bias at step 0, never inf), no whole-model per-sample loop."""
    assert not [m for m in messages if "one sample at a time" in m], messages
    assert sorted(output) == [0, 1], sorted(output)
    tracked_at_0 = {type(q).__name__ for q in configuration(preset) if q.is_active(0)}
    assert tracked_at_0 - {"Alpha", "UpdateSize", "UpdateRatio"} <= set(output[0]), output[0]
    for name in tracked_at_0 & set(output[0]):
        value = output[0][name]
        if name == "UpdateRatio":
            assert math.isfinite(value["global"]), value
            assert not any(math.isinf(r) for r in value["per_parameter"]), value
        else:
            assert finite(value), (name, value)
    assert {"Loss", "GradNorm"} <= set(output[1])
