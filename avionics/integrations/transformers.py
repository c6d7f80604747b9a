"""The cockpit inside the Hugging Face ``transformers.Trainer``.

    trainer = CockpitTrainer(model=model, args=args, train_dataset=data,
                             cockpit_quantities=configuration("full"), cockpit_log="runs/exp1")
    trainer.train()
    trainer.cockpit.get_output()      # {step: {"GradNorm": [...], ...}}
    trainer.state.log_history         # the Trainer's records, with "cockpit/GradNorm", ...

No callback hook of the Trainer runs between the forward and the backward, so the cockpit
enters :meth:`CockpitMixin.training_step`, which does what ``Trainer.training_step`` does and
runs the backward inside ``with cockpit(step, info)``. It calls the model without the labels
(its output is then the logits alone, which the GGN diagonals need) and computes the
Trainer's loss from them as ``Trainer.compute_loss`` would, with the model's
``loss_function``; a ``compute_loss`` override, ``compute_loss_func`` and label smoothing are
refused when the Trainer is built. The cockpit's step t is the Trainer's
update t (``state.global_step`` before it, counted from 0): the Trainer's log record of that
update is stamped ``"step": t + 1``, and :class:`CockpitLogCallback` merges the cockpit's
values of step t into it.

**Individual losses.** A model that is not a transformers model brings its own
(``cockpit_individual_losses``, see :class:`CockpitMixin`). A transformers model's loss is
the token cross entropy of ``logits`` against
``labels`` (shifted by one for causal language models, label -100 ignored). Within one
optimiser step of S sequences in k micro-batches, the Trainer backpropagates, for each
micro-batch, b = (sum of its tokens' cross entropies) / Z, with Z = ``num_items_in_batch``
when the model takes it (the labels of all k micro-batches that are not -100, as the Trainer
counts them: for a model whose ``loss_type`` is None, GPT2LMHeadModel's, before the shift, so
one more per sequence than the predicted tokens), else Z = k * T (T the micro-batch's
predicted tokens: the model's mean, divided by k). The individual loss of sequence n is

    l_n = S * (sum of sequence n's token cross entropies) / Z,

so the step's loss, the sum of the k backpropagated b, is the mean of the l_n over the S
sequences and the step's gradient is their mean gradient (docs/definitions.md: a sample is a
sequence). With one micro-batch of N sequences and ``num_items_in_batch``, l_n = N * (the
sequence's summed cross entropy) / (the batch's counted tokens): a sequence's share of the
token-averaged loss, times N; a padded sequence weighs by its number of predicted tokens.
A sequence classifier (``loss_function`` ForSequenceClassificationLoss, e.g.
BertForSequenceClassification) has one label per sequence and l_n is its cross entropy: the
step's loss is their mean (see *the Trainer's scale* below).
``info["loss"]`` is the micro-batch's mean of its l_n and the backpropagated tensor is
(N / S) * info["loss"] (info["loss"] itself with one micro-batch; a classifier's: c *
info["loss"], the Trainer's scale c below), whose value is checked against the Trainer's own
loss before the backward.

**Several processes** (``torchrun`` or ``accelerate launch``, one device per process, any
backend): accelerate wraps the model in ``DistributedDataParallel`` and gives each process
the same number of sequences of each step; the cockpit is built on that wrapper at the first
training step (``trainer.cockpit`` is None until then) and every value is the global batch's,
equal on every process (see :class:`~avionics.Cockpit`). With ``average_tokens_across_devices``
(the default) Z counts every process's tokens and S is the step's sequences over all
processes: each process backpropagates W times its share (W processes; DDP averages), as the
Trainer does. The log records of rank 0 get the cockpit's values (its sinks run there).

**The Trainer's scale of a sequence classifier.** ``Trainer.compute_loss`` multiplies the
loss by W (``average_tokens_across_devices``) and ``Trainer.training_step`` skips the division
by k whenever the model's forward takes ``**kwargs`` (``model_accepts_loss_kwargs``) and
``num_items_in_batch`` was counted: it takes the loss for a sum over the step's tokens
divided by their global count. BertForSequenceClassification's forward takes ``**kwargs`` but
computes the mean over its micro-batch (it never reads ``num_items_in_batch``), so the
Trainer backpropagates c = W times each micro-batch's mean (as do the other classifiers
whose forward calls the loss without ``num_items_in_batch``: GenericForSequenceClassification,
Llama's) and its gradient is W * k times
the gradient of the step's mean loss (its logged ``loss`` and ``grad_norm`` too; with Adam
and no clipping the updates hardly change, as Adam is invariant to the gradient's scale up
to its eps). The CockpitTrainer backpropagates what the Trainer would, so the training is the
Trainer's; the cockpit measures c and divides it out (:class:`~avionics.Cockpit`, the
backward scale), so its values are those of the mean loss, equal to one process's with one
micro-batch on the global batch, and its GradNorm is the Trainer's ``grad_norm`` / (W * k).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor
from torch.nn import functional as F
from transformers import PretrainedConfig, Trainer, TrainerCallback
from transformers.loss.loss_utils import ForCausalLMLoss

from avionics.cockpit import Cockpit
from avionics.quantities.outputs import Output
from avionics.records.run import output_of

# The records of the Trainer's log history get the cockpit's values under this prefix.
PREFIX = "cockpit/"
# Labels the Trainer's (and PyTorch's) cross entropy ignores.
IGNORE_INDEX = -100
# Relative agreement of the loss from the individual losses with the Trainer's, by dtype.
LOSS_RTOL = {torch.float64: 1e-10}
DEFAULT_LOSS_RTOL = 1e-4


def token_cross_entropy_sums(logits: Tensor, labels: Tensor, shift: bool) -> Tensor:
    """Per sequence n, sum_t CE(logits[n, t], labels[n, t]) over the labels that are not -100
    (with ``shift``, the logits at t against the label at t + 1, as a causal LM's loss), in
    float32 or wider, as the Trainer's loss computes it: shape [N]."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return per_token.view(labels.shape[0], -1).sum(1)


def predicted_tokens(labels: Tensor, shift: bool) -> Tensor:
    """The number of labels that are not -100 (after the shift of a causal LM)."""
    return (labels[:, 1:] if shift else labels).ne(IGNORE_INDEX).sum()


class CockpitLogCallback(TrainerCallback):
    """Merges the cockpit's values into the Trainer's log records: both a
    :class:`~avionics.records.sink.Sink` of the cockpit, which receives each step's values as
    they finish (the two-step ones, Alpha and UpdateSize, one step later), and a
    ``TrainerCallback``, which on every ``on_log`` (and at the end of training) adds the values
    received since to ``state.log_history``.

    The values of cockpit step t go into the Trainer's training record of update t + 1, the
    first record stamped ``"step": t + 1`` that has the Trainer's ``"loss"``, under
    ``"cockpit/<name>"``: each value's scalar as its quantity declares it (a per-parameter
    value's global one, e.g. the root-sum-of-squares of GradNorm); histograms stay in the
    cockpit's own log and sinks. Values arriving after their record was written (two-step
    values) are added to that record at the next log. Steps without a record of their own
    (``logging_steps`` > 1) are not merged. The records themselves are never dropped or
    replaced, and no record is added.

    The Trainer's own reporting (``report_to``: TensorBoard, W&B, ...) gets the same values:
    this callback runs first on every ``on_log`` and adds what it merged to the ``logs`` the
    reporting callbacks receive next, so they appear under ``cockpit/<name>`` at the update
    the Trainer stamps the log with (cockpit step t at update t + 1). Two-step values reach
    the reporting at the next log after they arrive, stamped with that log's update (one
    update later than in ``log_history``).
    """

    def __init__(self):
        self.outputs: dict[str, Output] = {}
        self._received: dict[int, dict[str, float]] = {}  # by cockpit step, not yet merged

    # ------------------------------------------------------------------ the Sink protocol
    def write(self, step: int, values: dict) -> None:
        scalars = {}
        for name, value in values.items():
            scalar = output_of(name, self.outputs, value).scalar(value)
            if scalar is not None:
                scalars[PREFIX + name] = scalar
        if scalars:
            self._received.setdefault(step, {}).update(scalars)

    def update_metadata(self, metadata: dict) -> None:
        self.outputs.update(
            {name: Output.from_description(d) for name, d in metadata.get("outputs", {}).items()}
        )

    def close(self) -> None:
        """Nothing to release: the values live in the Trainer's state."""

    # ------------------------------------------------------------------ the TrainerCallback
    def on_log(self, args, state, control, logs=None, **kwargs):
        merged = self.merge(state.log_history)
        if logs is not None and "loss" in logs:  # a training record: to the reporting too
            logs.update(merged)

    def on_train_end(self, args, state, control, **kwargs):
        self.merge(state.log_history)

    def merge(self, log_history: list[dict]) -> dict[str, float]:
        """Add the values received so far to their records in ``log_history``; forget those of
        steps whose record will never come (a later update has a record, theirs has none).
        Returns what it added (the latest step's value of each name)."""
        records: dict[int, dict] = {}
        for record in log_history:
            if "loss" in record and "step" in record:
                records.setdefault(record["step"], record)
        last = max(records, default=-1)
        merged: dict[str, float] = {}
        for step in sorted(self._received):
            record = records.get(step + 1)
            if record is not None:
                values = self._received.pop(step)
                record.update(values)
                merged.update(values)
            elif step + 1 < last:
                del self._received[step]
        return merged


class CockpitMixin:
    """A ``transformers.Trainer`` whose training steps a :class:`~avionics.Cockpit` watches.

    Mix in before the Trainer class (``class MyTrainer(CockpitMixin, Trainer)``), or use
    :class:`CockpitTrainer`. Keyword arguments besides the Trainer's:

    Args:
        cockpit_quantities: the cockpit's quantities (``configuration("economy")`` by
            default).
        cockpit_log: the cockpit's run directory (see :class:`~avionics.Cockpit`).
        cockpit_sinks: further sinks of the cockpit's values (e.g. a TensorBoardWriter).
        cockpit_individual_losses: for a model that is not a transformers model (any
            ``nn.Module`` the Trainer calls with the batch's other keys, e.g. a ResNet on
            ``{"x": images, "labels": classes}``), a function ``(outputs, labels)`` -> the
            per-sample losses, shape [N]: the step's loss is their mean over the step's
            samples (each micro-batch backpropagates its share), and the model's output must
            be what they are computed from (the GGN diagonals read it).

    The cockpit is ``self.cockpit``, built on the Trainer's model (under several processes on
    its DDP wrapper, at the first training step); a
    :class:`CockpitLogCallback` (``self.cockpit_callback``) merges its values into
    ``state.log_history``. Close the cockpit with ``trainer.cockpit.close()`` when done.
    Per-sequence losses are defined in the module docstring; ``info["optimizer"]`` is the
    torch optimizer inside accelerate's wrapper (whose step hooks the cockpit uses to measure
    the update, clipped or not).
    """

    def __init__(
        self,
        *args,
        cockpit_quantities=None,
        cockpit_log=None,
        cockpit_sinks=(),
        cockpit_individual_losses=None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if cockpit_individual_losses is not None and not callable(cockpit_individual_losses):
            raise TypeError(
                "CockpitTrainer(cockpit_individual_losses=...) takes a function (outputs, "
                f"labels) -> per-sample losses [N]; got {cockpit_individual_losses!r}."
            )
        self.cockpit_individual_losses = cockpit_individual_losses
        _check_supported(self)
        self.cockpit_callback = CockpitLogCallback()
        self._cockpit_options = {
            "quantities": cockpit_quantities,
            "log": cockpit_log,
            "sinks": [self.cockpit_callback, *cockpit_sinks],
        }
        # on one process the Trainer's model; on several, the DistributedDataParallel wrapper
        # the Trainer trains (built by accelerate inside train()), at the first step
        self.cockpit: Cockpit | None = None
        if self.args.world_size == 1:
            self.cockpit = Cockpit(self.model, **self._cockpit_options)
        # first among the callbacks: it adds the cockpit's values to the logs that the
        # reporting callbacks (report_to) receive after it
        self.callback_handler.callbacks.insert(0, self.cockpit_callback)
        self._step_sequences: int | None = None  # S: the sequences of this optimiser step
        self._micro_batch = 0

    def train(self, *args, **kwargs):
        """``Trainer.train``; a second call on this trainer is refused before it starts (it
        would count the steps from 0 again, which its cockpit has tracked)."""
        resumed = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if self.state.global_step > 0 and not resumed:
            raise RuntimeError(
                f"CockpitTrainer.train() ran before on this trainer (up to step "
                f"{self.state.global_step}): a second train() counts the steps from 0 again, "
                "which its cockpit has already tracked. Build a new CockpitTrainer for another "
                "run (with another cockpit_log=), or continue this one with "
                "train(resume_from_checkpoint=...) from a checkpoint and a larger max_steps."
            )
        return super().train(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer's micro-batches of one optimiser step; counts their sequences."""
        batch_samples, num_items_in_batch = super().get_batch_samples(
            epoch_iterator, num_batches, device
        )
        # (a batch without labels is refused by training_step)
        self._step_sequences = sum(len(b["labels"]) for b in batch_samples if "labels" in b)
        self._micro_batch = 0
        return batch_samples, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None) -> Tensor:
        """``Trainer.training_step`` with the backward inside ``with self.cockpit(...)``."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        if self.cockpit is None:  # several processes: on the wrapper that syncs the gradients
            self.cockpit = Cockpit(model, **self._cockpit_options)
        step, cockpit = self.state.global_step, self.cockpit
        micro_batch, micro_batches = self._micro_batch, self.current_gradient_accumulation_steps
        labels = inputs.get("labels")
        if labels is None:
            raise KeyError(
                f"CockpitTrainer: the batch has no 'labels' (its keys: {sorted(inputs)}); the "
                "per-sequence losses are the cross entropy of the logits against "
                "inputs['labels']. Give the data collator labels (e.g. "
                "DataCollatorForLanguageModeling(tokenizer, mlm=False)); for a model whose "
                "forward takes no labels argument, TrainingArguments(remove_unused_columns="
                "False) keeps them."
            )
        # the model's forward without the labels: its output is then the logits alone (the
        # GGN diagonals need one output tensor), and the loss is computed here as the model
        # would, with its own loss_function
        model_inputs = {key: value for key, value in inputs.items() if key != "labels"}
        tracked = any(q.is_active(step) for q in cockpit.quantities)
        with self.compute_loss_context_manager():
            outputs = model(**model_inputs)
            if self.cockpit_individual_losses is not None:
                info, loss = self._own_losses_info(outputs, labels)
                backpropagated = loss
            else:
                with torch.set_grad_enabled(not tracked):
                    loss = self._trainers_loss(model, outputs, labels, num_items_in_batch)
        if self.cockpit_individual_losses is None and tracked:
            info, backpropagated = self.cockpit_info(loss, outputs, labels, num_items_in_batch)
        elif self.cockpit_individual_losses is None:  # nothing reads this step
            info, backpropagated = {"loss": loss}, loss  # the Trainer's own backward
        protocol = {}
        if micro_batches > 1:
            protocol = {"micro_batch": micro_batch, "micro_batches": micro_batches}
        self._micro_batch += 1
        with cockpit(step, info, **protocol):
            self.accelerator.backward(backpropagated, create_graph=cockpit.create_graph(step))
        return loss.detach()

    def _trainers_loss(self, model, outputs, labels: Tensor, num_items_in_batch) -> Tensor:
        """The loss ``Trainer.training_step`` backpropagates: ``Trainer.compute_loss``'s (the
        model's ``loss_function`` on its logits and the labels, given ``num_items_in_batch``
        where the model takes it), divided by the micro-batches where it is not normalised
        over them."""
        unwrapped = self.accelerator.unwrap_model(model)
        loss_function = unwrapped.loss_function
        if _classifies_sequences(unwrapped):
            # the mean over the batch, as a classifier's forward computes it
            loss = loss_function(
                labels=labels, pooled_logits=outputs["logits"], config=unwrapped.config
            )
        else:
            kwargs = {}
            if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            loss = loss_function(
                logits=outputs["logits"],
                labels=labels,
                vocab_size=unwrapped.config.vocab_size,
                **kwargs,
            )
        if self._tokens_counted_over_processes(num_items_in_batch):
            loss = loss * self.accelerator.num_processes  # as Trainer.compute_loss scales it
        if not self._loss_scaled_for_accumulation(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        return loss

    def _tokens_counted_over_processes(self, num_items_in_batch) -> bool:
        """Whether ``num_items_in_batch`` counts the labels of every process's micro-batches
        (``average_tokens_across_devices``, as ``Trainer.compute_loss`` decides), so that each
        process's loss is multiplied by the number of processes (DDP averages it back)."""
        return (
            self.accelerator.num_processes > 1
            and self.args.average_tokens_across_devices
            and self.model_accepts_loss_kwargs
            and num_items_in_batch is not None
        )

    def _trainers_scale(self, num_items_in_batch) -> float:
        """The factor ``Trainer.training_step`` applies to the loss ``Trainer.compute_loss``
        normalised: the processes W where it counted every process's tokens, divided by the
        micro-batches k where it takes the loss for not normalised over them."""
        processes = self.accelerator.num_processes
        over_processes = (
            processes if self._tokens_counted_over_processes(num_items_in_batch) else 1
        )
        scaled = self._loss_scaled_for_accumulation(num_items_in_batch)
        return over_processes / (1 if scaled else self.current_gradient_accumulation_steps)

    def _loss_scaled_for_accumulation(self, num_items_in_batch) -> bool:
        """Whether the Trainer's loss is already normalised over the step's micro-batches (as
        ``Trainer.training_step`` decides)."""
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return self.model_accepts_loss_kwargs and num_items_in_batch is not None

    def _own_losses_info(self, outputs, labels: Tensor) -> tuple[dict, Tensor]:
        """The cockpit's info of a micro-batch from ``cockpit_individual_losses(outputs,
        labels)``, and the tensor to backpropagate: their mean times this micro-batch's share
        of the step's samples (on each process: DDP averages the processes')."""
        losses = self.cockpit_individual_losses(outputs, labels)
        if not (isinstance(losses, Tensor) and losses.dim() == 1 and len(losses) == len(labels)):
            raise ValueError(
                "CockpitTrainer(cockpit_individual_losses=...) must return the per-sample "
                f"losses, a tensor of shape [{len(labels)}] (one per sample of the batch); got "
                f"{tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__}."
            )
        n, k = len(losses), self.current_gradient_accumulation_steps
        own = self._step_sequences if k > 1 else n
        mean = losses.mean()
        info = {
            "loss": mean,
            "individual_losses": losses,
            "batch_size": n,
            "optimizer": getattr(self.optimizer, "optimizer", self.optimizer),
        }
        return info, mean if own == n else mean * (n / own)

    def cockpit_info(self, loss: Tensor, outputs, labels: Tensor, num_items_in_batch):
        """The cockpit's info of a micro-batch and the tensor to backpropagate, whose value
        is the Trainer's ``loss`` (checked). Override for a loss other than the token cross
        entropy of the module docstring."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        shift = _shifts_labels(unwrapped)
        sums = token_cross_entropy_sums(outputs["logits"], labels, shift)
        n, k = len(sums), self.current_gradient_accumulation_steps
        scale = self._trainers_scale(num_items_in_batch)
        if _classifies_sequences(unwrapped):
            # l_n = sequence n's cross entropy; the Trainer backpropagates its scale times the
            # micro-batch's mean (the module docstring), which the cockpit divides out
            individual_losses = sums
            mean = sums.mean()
            backpropagated = mean if scale == 1 else mean * scale
        else:
            # The Trainer backpropagates (sum of the micro-batch's cross entropies) / Z times
            # its scale; l_n = own * scale * sum_n / Z, so that the mean of the l_n over this
            # process's sequences of the step is what it backpropagates.
            own = self._step_sequences if k > 1 else n  # this process's sequences of the step
            if self._loss_scaled_for_accumulation(num_items_in_batch):
                normaliser = num_items_in_batch
            else:
                normaliser = predicted_tokens(labels, shift)
            # (a count's tensor would make the ratio an integer tensor's true division)
            normaliser = torch.as_tensor(normaliser, dtype=sums.dtype, device=sums.device)
            individual_losses = sums * (own * scale / normaliser)
            mean = individual_losses.mean()
            backpropagated = mean if own == n else mean * (n / own)
        _check_same_loss(backpropagated.detach(), loss.detach())
        info = {
            "loss": mean,
            "individual_losses": individual_losses,
            "batch_size": n,
            "optimizer": getattr(self.optimizer, "optimizer", self.optimizer),
        }
        return info, backpropagated


class CockpitTrainer(CockpitMixin, Trainer):
    """``transformers.Trainer`` watched by a cockpit: see :class:`CockpitMixin`."""


def _classifies_sequences(model) -> bool:
    """Whether the model's loss is a sequence classifier's (ForSequenceClassificationLoss:
    one label per sequence, the mean over the batch)."""
    loss_function = getattr(model, "loss_function", None)
    return (
        loss_function is not None
        and "pooled_logits" in inspect.signature(loss_function).parameters
    )


def _shifts_labels(model) -> bool:
    """Whether the model's loss is a causal LM's, logits at t against labels at t + 1: its
    ``loss_function`` is ForCausalLMLoss (the default of a model whose ``loss_type`` is None,
    as GPT2LMHeadModel's), and it is not an encoder-decoder model."""
    causal = getattr(model, "loss_function", None) is ForCausalLMLoss
    return causal and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)


def _check_supported(trainer) -> None:
    """Refuse, when the Trainer is built, the settings whose loss is not the token cross
    entropy of the module docstring, or whose batch the cockpit does not see whole."""
    if type(trainer).compute_loss is not Trainer.compute_loss:
        raise TypeError(
            f"{type(trainer).__name__} overrides compute_loss; CockpitTrainer computes the loss "
            "from the model's logits with the model's loss_function. Override "
            "CockpitMixin.cockpit_info (the per-sequence losses) instead."
        )
    transformers_model = isinstance(getattr(trainer.model, "config", None), PretrainedConfig)
    if not transformers_model and trainer.cockpit_individual_losses is None:
        raise TypeError(
            f"CockpitTrainer computes the loss of a transformers model (a PreTrainedModel with "
            f"a config and a loss_function); {type(trainer.model).__name__} is none. Give "
            "cockpit_individual_losses=fn, fn(outputs, labels) -> the per-sample losses [N] "
            "(e.g. F.cross_entropy(outputs, labels, reduction='none')), whose mean is the loss."
        )
    if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
        what = "compute_loss_func" if trainer.compute_loss_func is not None else "label_smoother"
        raise ValueError(
            f"CockpitTrainer: the Trainer has a {what} (label_smoothing_factor="
            f"{trainer.args.label_smoothing_factor}); the cockpit's per-sequence losses are "
            "the model's token cross entropy. Remove it, or subclass CockpitMixin and "
            "override cockpit_info to return per-sequence losses of your loss."
        )
    if trainer.args.n_gpu > 1:
        raise ValueError(
            f"CockpitTrainer runs one device per process; this Trainer has n_gpu="
            f"{trainer.args.n_gpu} (torch.nn.DataParallel, which splits each batch inside the "
            "forward). Launch one process per device with torchrun or accelerate launch (DDP), "
            "or train on one device (CUDA_VISIBLE_DEVICES=0)."
        )


def _check_same_loss(ours: Tensor, trainers: Tensor) -> None:
    """The loss from the individual losses must be the one the Trainer backpropagates."""
    if not (math.isfinite(float(ours)) and math.isfinite(float(trainers))):
        return  # the cockpit records a non-finite loss and skips the step's quantities
    rtol = LOSS_RTOL.get(trainers.dtype, DEFAULT_LOSS_RTOL)
    if not torch.isclose(ours.to(trainers.dtype), trainers, rtol=rtol, atol=0.0):
        raise ValueError(
            f"CockpitTrainer: the Trainer's loss is {float(trainers):.8g} but the token cross "
            f"entropy of outputs['logits'] against the labels gives {float(ours):.8g}. The "
            "model's loss is not the cross entropy the cockpit's per-sequence losses are "
            "defined by (see avionics.integrations.transformers); override "
            "CockpitMixin.cockpit_info for this model."
        )
