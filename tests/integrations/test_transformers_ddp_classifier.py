"""CockpitTrainer on a sequence classifier under several processes: the real
``transformers.Trainer`` training a tiny BertForSequenceClassification (random weights, float64)
on 2 gloo processes against one process on the global batch.

The Trainer backpropagates W = 2 times each micro-batch's mean cross entropy (its forward takes
``**kwargs``, so ``Trainer.compute_loss`` scales by the processes, and ``training_step`` does
not divide by the micro-batches k): its gradient is W * k times the step's mean gradient. The
cockpit divides that scale out: every value equals one process's on the global batch, and the
Trainer's actual gradient (read before each optimiser step) is W * k times the cockpit's
GradNorm. SGD with the learning rate divided by W * k (and no clipping) makes the Trainer's
updates one process's, so the runs train the same weights.
"""

import os

import pytest
import torch
from compare import assert_same_output
from spawned import on_ranks

from avionics import configuration

transformers = pytest.importorskip("transformers")
from avionics.integrations.transformers import CockpitTrainer  # noqa: E402

WORLD, PER_PROCESS, LENGTH, VOCAB, PAD = 2, 2, 9, 30, 0
RTOL = 1e-9


def tiny_bert() -> transformers.BertForSequenceClassification:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=LENGTH,
        num_labels=3,
        pad_token_id=PAD,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).double()


class Sentences(torch.utils.data.Dataset):
    """Token sequences padded at the end (attention_mask 0), one class label each."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(3, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH) < lengths[:, None]).long()
        self.ids = self.ids.masked_fill(self.mask == 0, PAD)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class GradientNorms(transformers.TrainerCallback):
    """The norm of the gradient the Trainer's optimiser steps with, at each step."""

    def __init__(self, model):
        self.model, self.norms = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def train(tmp_path, batch: int, accumulation: int, steps: int, scale: int, **args):
    """A CockpitTrainer of economy on the classifier, SGD at a learning rate of 0.1 / scale:
    (its cockpit output, the gradient norms its optimiser stepped with)."""
    model = tiny_bert()
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        disable_tqdm=True,
        **args,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / scale)
    norms = GradientNorms(model)
    trainer = CockpitTrainer(
        model=model,
        args=arguments,
        train_dataset=Sentences(steps * accumulation * WORLD * PER_PROCESS),
        optimizers=(optimizer, None),
        callbacks=[norms],
        cockpit_quantities=configuration("economy"),
    )
    trainer.train()
    output = trainer.cockpit.get_output()
    trainer.cockpit.close()
    return output, norms.norms


def _on_a_rank(rank, world, tmp_path, accumulation, steps):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    return train(
        tmp_path / f"rank{rank}",
        PER_PROCESS,
        accumulation,
        steps,
        scale=world * accumulation,
        ddp_backend="gloo",
    )


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", [1, 2], ids=["one micro-batch", "accumulated"])
def test_a_classifier_on_two_processes_equals_one_process_on_the_global_batch(
    tmp_path, accumulation
):
    steps = 2
    ranks = on_ranks(_on_a_rank, WORLD, tmp_path, tmp_path, accumulation, steps)
    # one process, micro-batches of both processes' sequences: the Trainer's scale is k
    expected, single_norms = train(
        tmp_path / "single", WORLD * PER_PROCESS, accumulation, steps, scale=accumulation
    )
    assert sorted(expected) == list(range(steps))
    expected_lr = {t: expected[t].pop("learning_rate") for t in expected}
    for t in expected:  # the Trainer's gradient is k times the mean loss's on one process
        assert single_norms[t] == pytest.approx(accumulation * _grad_norm(expected[t]), rel=RTOL)
    scale = WORLD * accumulation
    for output, norms in ranks:
        for t in expected:  # the Trainer's gradient is W * k times the mean loss's
            assert norms[t] == pytest.approx(scale * _grad_norm(output[t]), rel=RTOL)
            assert output[t].pop("learning_rate") == expected_lr[t] / WORLD
        assert_same_output(output, expected, rel=RTOL, abs=1e-10)


def _grad_norm(values: dict) -> float:
    """The global gradient norm from the cockpit's per-parameter GradNorm."""
    return float(torch.tensor(values["GradNorm"], dtype=torch.float64).norm())
