"""The cockpit in a Lightning ``Trainer``: :class:`CockpitCallback` (Lightning 2.x).

    trainer = Trainer(callbacks=[CockpitCallback(configuration("full"), log="runs/exp1")])

    def training_step(self, batch, batch_idx):          # automatic optimisation
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        return {"loss": losses.mean(), "individual_losses": losses}

Where the callback enters the protocol (docs/cockpit.md, section 1): every backward Lightning
runs goes through ``trainer.strategy.backward(loss, optimizer, **kwargs)`` (the automatic
loop's closure, and ``self.manual_backward`` in manual optimisation). For the fit, the
callback wraps that method of the trainer's strategy and runs it inside
``with cockpit(trainer.global_step, info)``: the block opens after the forward (the
``training_step``), closes right after the backward, and so before Lightning's
``on_before_optimizer_step``, its gradient clipping and the optimiser step (GradNorm is the
norm before clipping). It also wraps ``trainer.strategy.training_step``, to read what
``training_step`` returned. On a step whose quantities differentiate the gradient again
(HessMaxEV, HessTrace, TIC) it adds ``create_graph=True`` to the backward's keyword arguments,
which Lightning hands on to ``LightningModule.backward`` and from there to
``loss.backward`` (a ``backward`` you override must pass its keyword arguments on). Both
wrappers are removed when the fit ends or fails.

``info["loss"]`` is the loss ``training_step`` returned (Lightning backpropagates a positive
multiple of it: divided by ``accumulate_grad_batches``, multiplied by the AMP loss scale),
``info["optimizer"]`` the trainer's optimiser (when it has one), ``info["batch_size"]`` the
number of per-sample losses. The per-sample losses are read
from the key ``individual_losses`` (the name is an argument) of ``training_step``'s returned
dict, or are ``loss_fn(output, batch)`` of a ``loss_fn`` the callback is given (e.g. from
logits ``training_step`` returns). In manual optimisation, where the backward runs inside
``training_step``, they are passed to it: ``self.manual_backward(loss,
individual_losses=losses)`` (the callback takes the keyword out before Lightning sees it).

With ``accumulate_grad_batches=k`` the k backwards of one optimiser step are the micro-batches
of one cockpit step (``cockpit(step, info, micro_batch=i, micro_batches=k)``, fewer at the end
of an epoch whose batches do not divide by k, as Lightning steps there).

The cockpit is built on the network the LightningModule holds where it holds one (see
:func:`tracked_model`), so that the curvature instruments see its output as in a plain loop.
Under Lightning's DDP strategy (``strategy="ddp"``, any backend) it is built on the
strategy's ``DistributedDataParallel`` wrapper and every value is that of the global batch (see
:class:`~avionics.Cockpit`); give each process its own shard of the data set. ``"ddp"`` is the
strategy tested (``"ddp_spawn"`` pickles the callback into each process: not tested).

Values go to the cockpit's own sinks (the run log ``log``, ``sinks``) and to the trainer's
loggers, each at the step it belongs to (two-step values, Alpha and UpdateSize of step t,
arrive at step t + 1 and are logged at t): scalars with ``logger.log_metrics({"avionics/Name":
x, "avionics/Name/<parameter>": x_k, ...}, step=t)`` (``"avionics/Name_per_parameter/<parameter>"``
for an ``MLFlowLogger``: :class:`LoggerSink`), histograms to a ``TensorBoardLogger`` as
TensorBoard histograms (a 2d one as its two marginals, ``.../gradient`` and
``.../parameter``, as :class:`~avionics.records.TensorBoardWriter` does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import wraps

import lightning.pytorch as pl
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger

from avionics.cockpit import Cockpit
from avionics.quantities.base import PER_SAMPLE_LOSSES
from avionics.records.mlflow_sink import PER_PARAMETER
from avionics.records.tensorboard import add_histogram
from avionics.records.tracking import Tracking


class CockpitCallback(pl.Callback):
    """Tracks a Lightning fit with a :class:`~avionics.Cockpit` (see the module docstring).

    Args:
        quantities: the instruments, as for :class:`~avionics.Cockpit` (``configuration
            ("economy")`` by default).
        log: the cockpit's run directory (None: no run log; the values still reach the
            trainer's loggers and :attr:`cockpit`'s ``get_output()``).
        individual_losses: the key of ``training_step``'s returned dict that holds the
            per-sample losses, shape [N], and the keyword of ``manual_backward`` that takes
            them in manual optimisation.
        loss_fn: instead of that key, ``loss_fn(output, batch)``: the per-sample losses from
            what ``training_step`` returned and its batch (automatic optimisation).
        prefix: what the names logged to the trainer's loggers start with.
        **cockpit_options: further arguments of :class:`~avionics.Cockpit` (``params``,
            ``sinks``, ``exist``, ``fsync``).

    The cockpit is built when the fit starts (``first_step=trainer.global_step``), on the
    network (:func:`tracked_model`), and is :attr:`cockpit` from then on; it is closed when
    the fit ends or fails. Its
    ``state_dict`` travels in Lightning's checkpoints, so that a resumed fit continues it.
    """

    def __init__(
        self,
        quantities=None,
        log: str | None = None,
        individual_losses: str = PER_SAMPLE_LOSSES,
        loss_fn: Callable | None = None,
        prefix: str = "avionics/",
        **cockpit_options,
    ):
        if not isinstance(individual_losses, str) or not individual_losses:
            raise TypeError(
                "CockpitCallback(individual_losses=...) is the key of training_step's returned "
                f"dict that holds the per-sample losses, a non-empty str; got "
                f"{individual_losses!r}."
            )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                "CockpitCallback(loss_fn=...) takes a function loss_fn(output, batch) that "
                f"returns the per-sample losses, shape [N]; got {loss_fn!r}."
            )
        if not isinstance(prefix, str):
            raise TypeError(f"CockpitCallback(prefix=...) must be a str, got {prefix!r}.")
        unknown = set(cockpit_options) - {"params", "sinks", "exist", "fsync"}
        if unknown:
            raise TypeError(
                f"CockpitCallback got {sorted(unknown)}, which are no options of the Cockpit "
                "(params, sinks, exist, fsync); first_step is the trainer's global_step."
            )
        # (not self.log: Lightning gives its callbacks the module's log method under that name)
        self.quantities, self.run_log, self.loss_fn, self.prefix = quantities, log, loss_fn, prefix
        self.individual_losses = individual_losses
        self.cockpit_options = cockpit_options
        self.cockpit: Cockpit | None = None
        self._restored: dict | None = None  # a checkpoint's cockpit state, until the fit starts
        self._strategy = None  # the strategy whose methods are wrapped, during the fit
        self._step_output = None  # (training_step's output, its batch), until its backward

    # ------------------------------------------------------------------ Lightning's hooks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = tracked_model(trainer.strategy.model)
        sinks = list(self.cockpit_options.get("sinks", ()))
        if trainer.loggers:
            # (the loggers name parameters as the LightningModule does)
            owner = {m: f"{name}." for name, m in trainer.strategy.model.named_children()}
            sinks.append(LoggerSink(trainer.loggers, self.prefix, owner.get(model, "")))
        options = {**self.cockpit_options, "sinks": sinks}
        cockpit = Cockpit(
            model,
            self.quantities,
            log=self.run_log,
            first_step=trainer.global_step,
            **options,
        )
        if self._restored is not None:
            cockpit.load_state_dict(self._restored)
        self.cockpit = cockpit
        self._wrap(trainer)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._release()

    def state_dict(self) -> dict:
        return {"cockpit": self.cockpit.state_dict()} if self.cockpit is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        self._restored = state_dict.get("cockpit")

    # ------------------------------------------------------------------ the protocol
    def _wrap(self, trainer: pl.Trainer) -> None:
        """Wrap the strategy's training_step (to read its output) and backward (to track it)
        for this fit; :meth:`_release` removes both."""
        strategy = self._strategy = trainer.strategy
        training_step, backward = strategy.training_step, strategy.backward

        @wraps(training_step)
        def tracked_training_step(*args, **kwargs):
            output = training_step(*args, **kwargs)
            self._step_output = (output, args[0] if args else kwargs.get("batch"))
            return output

        @wraps(backward)
        def tracked_backward(closure_loss, optimizer, *args, **kwargs):
            losses = kwargs.pop(self.individual_losses, None)
            step = trainer.global_step
            info = self._info(trainer, step, closure_loss, losses)
            with self.cockpit(step, info, **micro_batch(trainer)):
                if self.cockpit.create_graph(step):
                    kwargs["create_graph"] = True
                return backward(closure_loss, optimizer, *args, **kwargs)

        strategy.training_step, strategy.backward = tracked_training_step, tracked_backward

    def _release(self) -> None:
        """Unwrap the strategy and close the cockpit (once, at the fit's end or failure)."""
        if self._strategy is None:
            return
        del self._strategy.training_step, self._strategy.backward  # the class's again
        self._strategy, self._step_output = None, None
        self.cockpit.close()

    def _info(self, trainer: pl.Trainer, step: int, closure_loss, losses) -> dict:
        """The cockpit's ``info`` for the backward of ``closure_loss`` at ``step``."""
        module = trainer.lightning_module
        if module.automatic_optimization:
            (output, batch), self._step_output = self._step_output, None
            loss = output["loss"] if isinstance(output, Mapping) else output
            if self.loss_fn is not None:
                losses = self.loss_fn(output, batch)
            elif isinstance(output, Mapping):
                losses = output.get(self.individual_losses)
        else:  # manual_backward(loss, individual_losses=...) inside training_step
            loss = closure_loss
        info = {"loss": loss}
        if losses is not None:
            info[PER_SAMPLE_LOSSES], info["batch_size"] = losses, len(losses)
        elif readers := self._per_sample_readers(step):
            raise KeyError(self._no_losses_message(step, readers, module))
        if len(trainer.optimizers) == 1:
            info["optimizer"] = trainer.optimizers[0]
        return info

    def _per_sample_readers(self, step: int) -> list[str]:
        return [
            q.name
            for q in self.cockpit.quantities
            if q.is_active(step) and PER_SAMPLE_LOSSES in q.required_info(step)
        ]

    def _no_losses_message(self, step: int, readers: list[str], module) -> str:
        key = self.individual_losses
        if module.automatic_optimization:
            where = (
                f"return them from training_step, {{'loss': loss, '{key}': losses}} with "
                "losses = criterion(out, y, reduction='none') and loss = losses.mean(), or "
                "give CockpitCallback(loss_fn=...)"
            )
        else:
            where = f"pass them on: self.manual_backward(loss, {key}=losses)"
        return (
            f"Step {step}: {', '.join(readers)} read the per-sample losses, which the "
            f"training step did not give: {where}; or leave these quantities out."
        )


def tracked_model(model):
    """The module the cockpit is built on, so that it sees the network's own forward and its
    output (the structure the curvature instruments read: the GGN diagonals need the model's
    output tensor, and without it ``curvature="auto"`` has only the exact Hessian diagonal):

    * under DDP, the strategy's ``DistributedDataParallel`` wrapper (every value is then the
      global batch's);
    * a LightningModule with no trainable parameter of its own and exactly one child module
      that holds trainable parameters (``self.model``, ``self.net``): that child, whether
      ``training_step`` calls ``self(x)`` or ``self.model(x)``; frozen modules beside it (a
      teacher) and parameter-free ones (a criterion, metrics) do not count;
    * otherwise the LightningModule itself (its ``forward`` must then be what
      ``training_step`` calls).
    """
    if not isinstance(model, pl.LightningModule):
        return model
    if any(p.requires_grad for p in model.parameters(recurse=False)):
        return model
    trainable = [c for c in model.children() if any(p.requires_grad for p in c.parameters())]
    return trainable[0] if len(trainable) == 1 else model


def micro_batch(trainer: pl.Trainer) -> dict:
    """The cockpit's ``micro_batch``/``micro_batches`` of the backward Lightning is about to
    run ({} when it is an optimiser step's only one): Lightning steps the optimiser after
    ``accumulate_grad_batches`` batches, or earlier at the end of an epoch."""
    k = trainer.accumulate_grad_batches
    if k == 1 or not trainer.lightning_module.automatic_optimization:
        return {}
    batch = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1  # in the epoch
    i = batch % k  # this batch's place in its group
    # an epoch's last group has its remainder of batches (every micro-batch of a step
    # declares the same number; an epoch of unknown length: the cockpit skips a short step)
    micro_batches = min(k, trainer.num_training_batches - (batch - i))
    return {} if micro_batches == 1 else {"micro_batch": i, "micro_batches": int(micro_batches)}


class LoggerSink:
    """A :class:`~avionics.records.sink.Sink` that writes a cockpit's values to Lightning
    loggers with ``log_metrics(..., step=step)``, read as the trackers' sinks read them
    (:class:`~avionics.records.tracking.Tracking`): each value's one number under its name,
    per-parameter values under ``Name/<parameter name>`` (the name after ``parameter_prefix``;
    ``Name_per_parameter/<parameter name>`` for an ``MLFlowLogger``, whose file store keeps a
    metric in a file of its name, so that ``Name`` and ``Name/...`` cannot both exist there),
    and histograms to the ``TensorBoardLogger`` among them (a 2d one as its marginals)."""

    def __init__(self, loggers, prefix: str = "avionics/", parameter_prefix: str = ""):
        self.loggers, self.prefix = list(loggers), prefix
        self.parameter_prefix = parameter_prefix
        self._tracking = Tracking()

    def update_metadata(self, metadata: dict) -> None:
        self._tracking.update_metadata(metadata)

    def write(self, step: int, values: dict) -> None:
        tracked = self._tracking.read(values)
        for logger in self.loggers:
            separator = PER_PARAMETER + "/" if isinstance(logger, MLFlowLogger) else "/"
            metrics = {self.prefix + name: v for name, v in tracked.scalars.items()}
            for name, by_parameter in tracked.parameters.items():
                head = f"{self.prefix}{name}{separator}{self.parameter_prefix}"
                metrics.update({head + parameter: v for parameter, v in by_parameter.items()})
            if metrics:
                logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger):
                for tag, (counts, edges) in tracked.histograms.items():
                    add_histogram(logger.experiment, self.prefix + tag, counts, edges, step)

    def close(self) -> None:
        """Nothing to do: Lightning finalises its loggers."""
