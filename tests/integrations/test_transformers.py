"""The cockpit inside the real ``transformers.Trainer`` against a plain avionics loop.

A tiny GPT-2 in float64 on CPU; the Trainer's micro-batches are recorded and replayed by a
plain loop (``with cockpit(step, info)`` around ``loss.backward``) from the same weights.
"""

import copy
import math

import pytest
import torch
from compare import assert_same_output
from torch.nn import functional as F

from avionics import Cockpit, configuration

transformers = pytest.importorskip("transformers")
from avionics.integrations.transformers import (  # noqa: E402
    CockpitTrainer,
    token_cross_entropy_sums,
)

VOCAB, LENGTH = 64, 12
RTOL = 1e-9


def tiny_gpt2(n_layer=1) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=n_layer,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).double()


class Sequences(torch.utils.data.Dataset):
    """Token sequences, some padded at the end (attention_mask 0, labels -100)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(4, LENGTH + 1, (n,), generator=g)
        self.mask = (torch.arange(LENGTH) < lengths[:, None]).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


class RecordingTrainer(CockpitTrainer):
    """Keeps each micro-batch and its num_items_in_batch, for the plain loop to replay."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
        return super().training_step(model, inputs, num_items_in_batch)


def trainer_for(
    tmp_path, model, quantities, steps=3, batch=4, accumulation=1, samples=None, **args
):
    """A RecordingTrainer of ``steps`` updates on ``samples`` sequences (by default those of
    ``steps`` updates of ``accumulation`` micro-batches of ``batch``)."""
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        logging_steps=1,
        report_to=args.pop("report_to", "none"),
        use_cpu=True,
        save_strategy="no",
        lr_scheduler_type="constant",
        disable_tqdm=True,
        **args,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    trainer = RecordingTrainer(
        model=model,
        args=arguments,
        train_dataset=Sequences(samples or steps * batch * accumulation),
        optimizers=(optimizer, None),
        cockpit_quantities=quantities,
    )
    trainer.seen = []
    return trainer


def plain_loop(model, quantities, seen, accumulation=1, max_grad_norm=0.0):
    """The cockpit's README loop on the Trainer's batches: l_n = S * (sequence n's summed
    token cross entropy) / num_items_in_batch, the loss their mean, one batch per step of all
    its micro-batches' sequences."""
    cockpit = Cockpit(model, quantities=quantities)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(len(seen) // accumulation):
        micro = seen[step * accumulation : (step + 1) * accumulation]
        batch = {k: torch.cat([inputs[k] for inputs, _ in micro]) for k in micro[0][0]}
        num_items = micro[0][1]
        optimizer.zero_grad()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        sums = token_cross_entropy_sums(logits, batch["labels"], shift=True)
        losses = sums * (len(sums) / torch.as_tensor(num_items, dtype=sums.dtype))
        loss = losses.mean()
        info = {
            "loss": loss,
            "individual_losses": losses,
            "batch_size": len(losses),
            "optimizer": optimizer,
        }
        with cockpit(step, info):
            loss.backward(create_graph=cockpit.create_graph(step))
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    return cockpit


@pytest.mark.parametrize(
    "label, max_grad_norm, steps",
    [
        pytest.param("economy", 0.0, 3, id="economy"),
        pytest.param("economy", 0.05, 3, id="economy clipped"),
        # HessMaxEV's Lanczos iterations and the curvature diagonals: minutes on a busy CPU
        pytest.param("full", 0.05, 2, id="full clipped", marks=pytest.mark.slow),
    ],
)
def test_trainer_equals_a_plain_loop(tmp_path, label, max_grad_norm, steps):
    model = tiny_gpt2()
    initial = copy.deepcopy(model)
    trainer = trainer_for(
        tmp_path, model, configuration(label), steps=steps, max_grad_norm=max_grad_norm
    )
    trainer.train()
    inputs, num_items = trainer.seen[0]
    assert (inputs["labels"] == -100).any() and (inputs["attention_mask"] == 0).any()
    # the Trainer counted the batch's labels, after the shift where it knows the model's
    # loss_type is a causal LM's (GPT2LMHeadModel's loss_type is None: before the shift)
    counted = inputs["labels"][:, 1:] if trainer._loss_shifts_labels else inputs["labels"]
    assert num_items is not None and int(num_items) == int((counted != -100).sum())
    reference = plain_loop(
        initial, configuration(label), trainer.seen, max_grad_norm=max_grad_norm
    )
    got, expected = trainer.cockpit.get_output(), reference.get_output()
    assert sorted(got) == list(range(steps))
    assert_same_output(got, expected, rel=RTOL)
    if label == "full":
        assert all("HessMaxEV" in got[s] and "HessTrace" in got[s] for s in range(steps))
    # the same weights came out of the two loops
    for p, q in zip(model.parameters(), initial.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-12)
    if max_grad_norm:
        # GradNorm is the norm before clipping, the Trainer's own grad_norm
        norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
        assert min(norms) > max_grad_norm
    trainer.cockpit.close()
    reference.close()


def test_the_log_records_get_the_values_of_their_steps(tmp_path):
    model = tiny_gpt2()
    trainer = trainer_for(tmp_path, model, configuration("economy"), steps=3)
    trainer.train()
    output = trainer.cockpit.get_output()
    records = [r for r in trainer.state.log_history if "loss" in r]
    # the Trainer's own records are all there, with their own keys, and no record was added
    assert [r["step"] for r in records] == [1, 2, 3]
    assert len(trainer.state.log_history) == 4  # and the summary record of train()
    for t, record in enumerate(records):
        assert {"loss", "grad_norm", "learning_rate", "epoch"} <= set(record)
        # cockpit step t is the update the Trainer stamps t + 1: the same gradient norm
        assert math.isclose(record["cockpit/GradNorm"], record["grad_norm"], rel_tol=1e-9)
        assert math.isclose(record["cockpit/Loss"], output[t]["Loss"], rel_tol=1e-12)
        assert math.isclose(record["cockpit/Loss"], record["loss"], rel_tol=1e-6)  # float32
        assert math.isclose(record["cockpit/NormTest"], output[t]["NormTest"], rel_tol=1e-12)
        # histograms stay in the cockpit's output
        assert "cockpit/GradHist1d" not in record
    # two-step values arrive a step late and still reach their step's record
    for t in (0, 1):
        assert math.isclose(records[t]["cockpit/Alpha"], output[t]["Alpha"], rel_tol=1e-12)
        assert "cockpit/UpdateSize" in records[t]
    assert "cockpit/Alpha" not in records[2]  # its next step never came
    assert "cockpit/GradNorm" not in trainer.state.log_history[-1]
    trainer.cockpit.close()


def test_individual_losses_average_to_the_trainers_loss(tmp_path):
    """With one micro-batch of N padded sequences, l_n = N * (summed token cross entropy of
    sequence n) / (predicted tokens of the batch), whose mean the Trainer backpropagates."""
    model = tiny_gpt2()
    trainer = trainer_for(tmp_path, model, configuration("economy"), steps=1)
    data = Sequences(4)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in data[0]}
    tokens = (batch["labels"][:, 1:] != -100).sum()
    loss, outputs = trainer.compute_loss(model, batch, True, num_items_in_batch=tokens)
    trainer.current_gradient_accumulation_steps = 1
    info, backpropagated = trainer.cockpit_info(loss, outputs, batch["labels"], tokens)
    logits = outputs["logits"][:, :-1]
    brute = torch.stack(
        [
            sum(
                F.cross_entropy(logits[n, t], batch["input_ids"][n, t + 1])
                for t in range(LENGTH - 1)
                if batch["labels"][n, t + 1] != -100
            )
            for n in range(4)
        ]
    )
    torch.testing.assert_close(info["individual_losses"], 4 * brute / tokens, rtol=1e-12, atol=0)
    assert backpropagated is info["loss"]
    torch.testing.assert_close(info["loss"].float(), loss, rtol=1e-6, atol=0)
    trainer.cockpit.close()


def test_accumulation_equals_one_batch_of_all_micro_batches(tmp_path):
    model = tiny_gpt2()
    initial = copy.deepcopy(model)
    trainer = trainer_for(
        tmp_path,
        model,
        configuration("economy"),
        steps=2,
        batch=2,
        accumulation=2,
        max_grad_norm=0.05,
    )
    trainer.train()
    seen = trainer.seen
    reference = plain_loop(
        initial, configuration("economy"), seen, accumulation=2, max_grad_norm=0.05
    )
    got, expected = trainer.cockpit.get_output(), reference.get_output()
    for values in (got, expected):  # the histograms' counts may differ at bin edges
        for step in values.values():
            step.pop("GradHist1d")
    assert_same_output(got, expected, rel=RTOL)


def test_settings_with_another_loss_are_refused_when_built(tmp_path):
    model = tiny_gpt2()
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, label_smoothing_factor=0.1
    )
    with pytest.raises(ValueError, match=r"label_smoother \(label_smoothing_factor=0.1\)"):
        CockpitTrainer(model=model, args=arguments, train_dataset=Sequences(4))


def test_a_batch_without_labels_is_refused_before_the_step(tmp_path):
    model = tiny_gpt2()
    trainer = trainer_for(tmp_path, model, configuration("economy"), steps=1)
    batch = {"input_ids": Sequences(2).ids}
    trainer.current_gradient_accumulation_steps = 1
    with pytest.raises(KeyError, match=r"no 'labels' \(its keys: \['input_ids'\]\)"):
        trainer.training_step(model, batch)
    assert all(p.grad is None for p in model.parameters())
    assert trainer.cockpit.get_output() == {}


def test_a_loss_that_is_not_the_token_cross_entropy_is_refused_before_the_backward(tmp_path):
    model = tiny_gpt2()
    causal = model.loss_function
    model.loss_function = lambda *args, **kwargs: 2 * causal(*args, **kwargs)
    trainer = trainer_for(tmp_path, model, configuration("economy"), steps=1)
    data = Sequences(4)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in data[0]}
    trainer.current_gradient_accumulation_steps = 1
    with pytest.raises(ValueError, match="the Trainer's loss is .* but the token cross entropy"):
        trainer.training_step(model, batch, num_items_in_batch=None)
    assert all(p.grad is None for p in model.parameters())
    assert trainer.cockpit.get_output() == {}


def test_an_overridden_compute_loss_is_refused_when_built(tmp_path):
    class OwnLoss(CockpitTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True
    )
    with pytest.raises(
        TypeError, match=r"OwnLoss overrides compute_loss; .*CockpitMixin\.cockpit_info"
    ):
        OwnLoss(model=tiny_gpt2(), args=arguments, train_dataset=Sequences(4))


def test_the_trainer_s_tensorboard_reporting_gets_the_cockpit_s_values(tmp_path, monkeypatch):
    """report_to=["tensorboard"]: the Trainer's own event file has cockpit/<name> at the
    update each value belongs to, as in log_history."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model = tiny_gpt2()
    trainer = trainer_for(
        tmp_path, model, configuration("economy"), steps=3, report_to=["tensorboard"]
    )
    trainer.train()
    output = trainer.cockpit.get_output()
    trainer.cockpit.close()
    (run,) = {p.parent for p in (tmp_path / "tb").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]

    def scalars(name):
        return {e.step: e.value for e in events.Scalars(name)}

    assert {"train/cockpit/Loss", "train/cockpit/GradNorm", "train/cockpit/NormTest"} <= set(
        tags
    ), tags
    for name in ("Loss", "NormTest"):
        expected = {t + 1: output[t][name] for t in range(3)}
        assert scalars(f"train/cockpit/{name}") == pytest.approx(expected, rel=1e-6)
    # a two-step value reaches the reporting at the next log: Alpha of step 0 at update 2
    assert scalars("train/cockpit/Alpha") == pytest.approx(
        {t + 2: output[t]["Alpha"] for t in range(2)}, rel=1e-6
    )


def test_full_runs_on_a_causal_language_model(tmp_path, monkeypatch):
    """configuration("full") as the module docstring shows it: the shifted, padded token
    cross entropy is recognised on entering each step (the softmax Hessian per token), so
    curvature="auto" takes the Monte-Carlo GGN diagonal (never the dense loss Hessian) and
    the steps finish with positive, finite traces."""
    import warnings

    from avionics.curvature.step import loss_root

    def dense(*args):
        raise AssertionError("the dense loss-Hessian root was used")

    monkeypatch.setattr(loss_root, "_dense_root", dense)
    model = tiny_gpt2()
    trainer = trainer_for(tmp_path, model, configuration("full"), steps=2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train()
    chosen = [str(w.message) for w in said if "(curvature='auto') computes" in str(w.message)]
    assert chosen and all("computes 'diag_ggn_mc'" in m for m in chosen), chosen
    output = trainer.cockpit.get_output()
    trainer.cockpit.close()
    assert all(math.isfinite(sum(output[t]["HessTrace"])) for t in (0, 1))
    assert all(sum(output[t]["HessTrace"]) > 0 for t in (0, 1))
