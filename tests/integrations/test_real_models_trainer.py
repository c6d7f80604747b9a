"""Issue 24's acceptance under the real ``transformers.Trainer``: every architecture of
tests/real_models.py, two tracked steps of CockpitTrainer with a forward of another copy of
the model (an EMA copy, a teacher) at each step's beginning. GPT-2 (a causal LM on padded
sequences) and the BERT classifier (BertForSequenceClassification with its attention mask)
train with the model's own loss; the other five are plain modules with their per-sample
losses given (cockpit_individual_losses). Economy on all seven; the richer presets on the LM,
the ViT and the ResNet (acceptance.FRAMEWORK_RUNS, slow)."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import real_models
import torch
from acceptance import FRAMEWORK_RUNS, TINY, assert_the_preset_ran, optimizer_for

transformers = pytest.importorskip("transformers")

from avionics import configuration  # noqa: E402
from avionics.integrations.transformers import CockpitTrainer  # noqa: E402


class Samples(torch.utils.data.Dataset):
    """The batch X, y as the Trainer's samples ({input name: X[i], "labels": y[i]}), twice."""

    def __init__(self, inputs: dict, labels):
        self.inputs, self.labels = inputs, labels

    def __len__(self):
        return 2 * len(self.labels)

    def __getitem__(self, i):
        i %= len(self.labels)
        return {**{k: v[i] for k, v in self.inputs.items()}, "labels": self.labels[i]}


class OtherForward(transformers.TrainerCallback):
    """A plain forward of another copy of the model at each step's beginning."""

    def __init__(self, other, inputs: dict):
        self.other, self.inputs = other, inputs

    def on_step_begin(self, args, state, control, **kwargs):
        self.other(**self.inputs)


def as_trained(name: str):
    """(the model the Trainer trains, its inputs by name, labels, per-sample losses or None
    where the model's own loss is the Trainer's)."""
    model, X, y, loss_fn = TINY[name](dtype=torch.float32)
    if name == "gpt2":  # labels: the tokens, IGNORE at the padding (the model shifts them)
        return model, {"input_ids": X}, y, None
    if name == "bert":
        mask = (X != real_models.PAD).long()
        return model.bert, {"input_ids": X, "attention_mask": mask}, y, None
    first = next(iter(inspect.signature(model.forward).parameters))
    return model, {first: X}, y, loss_fn


def two_steps_under_the_trainer(name: str, preset: str, tmp_path):
    model, inputs, labels, loss_fn = as_trained(name)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=2,
        per_device_train_batch_size=len(labels),
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,  # (the plain modules' forwards take no labels)
    )
    trainer = CockpitTrainer(
        model=model,
        args=arguments,
        train_dataset=Samples(inputs, labels),
        optimizers=(optimizer_for(preset, model.parameters()), None),
        callbacks=[OtherForward(copy.deepcopy(model), inputs)],
        cockpit_quantities=configuration(preset),
        cockpit_individual_losses=loss_fn,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    output = trainer.cockpit.get_output()
    trainer.cockpit.close()
    records = [r for r in trainer.state.log_history if "loss" in r]
    for t, record in enumerate(records):  # the Trainer's loss is the cockpit's
        assert record["cockpit/Loss"] == pytest.approx(record["loss"], rel=1e-5)
        assert record["cockpit/Loss"] == pytest.approx(output[t]["Loss"], rel=1e-12)
    return output, [str(w.message) for w in caught]


@pytest.mark.parametrize(("name", "preset"), FRAMEWORK_RUNS)
def test_the_preset_runs_two_steps(name, preset, tmp_path):
    output, messages = two_steps_under_the_trainer(name, preset, tmp_path)
    assert_the_preset_ran(output, preset, messages)


def test_a_plain_module_without_its_losses_is_refused_when_built(tmp_path):
    model, inputs, labels, _ = as_trained("resnet")
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True
    )
    with pytest.raises(TypeError, match=r"ResNet is none\. Give cockpit_individual_losses=fn"):
        CockpitTrainer(model=model, args=arguments, train_dataset=Samples(inputs, labels))


def test_losses_of_another_shape_are_refused_before_the_backward(tmp_path):
    model, inputs, labels, loss_fn = as_trained("resnet")
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1
    )
    trainer = CockpitTrainer(
        model=model,
        args=arguments,
        train_dataset=Samples(inputs, labels),
        cockpit_individual_losses=lambda out, y: loss_fn(out, y).mean(),
    )
    trainer.current_gradient_accumulation_steps = 1
    batch = {**inputs, "labels": labels}
    with pytest.raises(ValueError, match=r"per-sample losses, a tensor of shape \[4\].* got \(\)"):
        trainer.training_step(model, batch)
    assert all(p.grad is None for p in model.parameters())
    assert trainer.cockpit.get_output() == {}
    trainer.cockpit.close()
