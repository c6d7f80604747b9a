"""Issue 24's acceptance under the real Lightning Trainer: every architecture of
tests/real_models.py, two tracked steps through CockpitCallback with a frozen copy of the
network (an EMA copy, a teacher) run forward in each training_step before the network; the
cockpit is built on the network (tracked_model), as the plain loop's. Economy on all seven;
the richer presets on the LM, the ViT and the ResNet (acceptance.FRAMEWORK_RUNS, slow)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from acceptance import FRAMEWORK_RUNS, TINY, assert_the_preset_ran, optimizer_for

pl = pytest.importorskip("lightning.pytorch")

from avionics import configuration  # noqa: E402
from avionics.integrations.lightning import CockpitCallback  # noqa: E402
from integrations.test_lightning import fit  # noqa: E402


class WithTeacher(pl.LightningModule):
    """The network and a frozen copy of it; training_step runs the copy, then the network,
    and returns the per-sample losses."""

    def __init__(self, model, loss_fn, preset: str):
        super().__init__()
        self.model, self.loss_fn, self.preset = model, loss_fn, preset
        self.teacher = copy.deepcopy(model).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.teacher(x)
        losses = self.loss_fn(self.model(x), y)
        return {"loss": losses.mean(), "individual_losses": losses}

    def configure_optimizers(self):
        return optimizer_for(self.preset, self.model.parameters())


def two_steps_under_lightning(name: str, preset: str, tmp_path):
    model, X, y, loss_fn = TINY[name](dtype=torch.float32)
    module = WithTeacher(model, loss_fn, preset)
    callback = CockpitCallback(configuration(preset))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(module, callback, tmp_path, (torch.cat([X, X]), torch.cat([y, y])), len(X))
    assert callback.cockpit.model is model  # the network, not the module around it
    return callback.cockpit.get_output(), [str(w.message) for w in caught]


@pytest.mark.parametrize(("name", "preset"), FRAMEWORK_RUNS)
def test_the_preset_runs_two_steps(name, preset, tmp_path):
    output, messages = two_steps_under_lightning(name, preset, tmp_path)
    assert_the_preset_ran(output, preset, messages)
