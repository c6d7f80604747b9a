"""The report that found the batch-axis bug (helper axis, 2026-12-02): under the real
``transformers.Trainer`` on one process, gradient accumulation over 2 micro-batches of 4
samples of length 8 makes the step's N equal the sequence length, and BERT's position ids
[1, 8] were taken as carrying the batch ("index_add_(): Number of indices (8) should be
equal to source.size(dim): (16)"). The numbers themselves are tested against the loop over
samples in tests/persample/test_batch_axis.py."""

from __future__ import annotations

import pytest
import real_models
import torch

transformers = pytest.importorskip("transformers")

from avionics import configuration  # noqa: E402
from avionics.integrations.transformers import CockpitTrainer  # noqa: E402


class Samples(torch.utils.data.Dataset):
    """The batch X, y as the Trainer's samples ({input name: X[i], "labels": y[i]})."""

    def __init__(self, inputs: dict, labels):
        self.inputs, self.labels = inputs, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {**{k: v[i] for k, v in self.inputs.items()}, "labels": self.labels[i]}


def test_bert_accumulating_two_micro_batches_whose_step_has_n_equal_to_t(tmp_path):
    model, X, y, _ = real_models.bert_classifier(n=8, t=8, dtype=torch.float32)
    inputs = {"input_ids": X, "attention_mask": (X != real_models.PAD).long()}
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = CockpitTrainer(
        model=model.bert,
        args=arguments,
        train_dataset=Samples(inputs, y),
        cockpit_quantities=configuration("economy"),
    )
    trainer.train()
    output = trainer.cockpit.get_output()
    trainer.cockpit.close()
    assert output[0]["Loss"] > 0
    assert {"NormTest", "InnerTest", "GradHist1d"} <= set(output[0])
