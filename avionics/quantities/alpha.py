"""Alpha: normalized step length of a noise-aware quadratic fit (docs/definitions.md, section 7).

Along the update s = theta_{t+1} - theta_t, tau = ||s||, four observations of the loss f(x) =
L(theta_t + x s / tau) on [0, tau]: f_0, f_1 (mini-batch losses at t and t+1), df_0, df_1
(mean over samples of the projections (g_n . s) / tau at t and at t+1), each with the
unbiased variance of its per-sample terms as its noise. A weighted least-squares fit of
f(x) = w1 + w2 x + w3 x^2 (weights 1 / variance, a zero variance becomes 1e-10) gives
alpha = tau / x* - 1 with x* = -w2 / (2 w3), or -1 when w3 < 0. Stored under the start step t.

The projections at t need s, which for most optimizers exists only after ``optimizer.step()``:

* plain SGD (:mod:`avionics.quantities.plain_sgd`): s = -lr * g
  is known at t and (g_n . s) / tau = -(g_n . g) / ||g||, the "grad" projections the engine
  computes anyway (shared with the gradient tests), and ||g||^2 = mean_n g_n . g comes with
  them. Only s / tau is kept until t+1: a copy of the gradient, except for Linear weights
  whose mean gradient (1/N) sum_m delta_m x_m^T has factors smaller than the weight, which
  keep the factors and are projected on at t+1 from cross inner products (N^2 (I + O)
  instead of N I O; :mod:`avionics.persample.rules.factored`). That holds when the optimizer
  steps on the gradient the cockpit saw: a step pre-hook compares the gradients' norms when
  ``optimizer.step()`` starts, and where they changed since (gradient clipping, a gradient
  edited by hand), s is measured instead, as for every other optimizer (theta_t copied in
  that hook, before the step).
* every other optimizer: theta_t and the start step's ``StepData.captured`` (its captured
  layer inputs and output gradients, never N x D per-sample gradients) are kept until s can
  be measured, and the start step's g_n are projected onto it in one pass of the engine, with
  theta_t swapped back in; both steps' projections onto s are divided by tau. s is measured
  when ``optimizer.step()`` returns (a step post-hook of a ``torch.optim.Optimizer``), so
  that the start step's capture is released before the next forward. The parameters must not
  change between that moment and the next tracked step: the next step compares their norms,
  and if they changed (another ``optimizer.step()``, weight clipping...), the start step
  stores nothing, a warning says why, and from then on s is measured at the next tracked
  step, the capture kept until then (as for an optimizer without step hooks).

Scalars stay on the device until the fit, which reads them with the step's one host transfer
(the value is :class:`~avionics.quantities.deferred.Deferred`).

Alpha refers to the mean loss over the batch: for a sum-reduced loss, f is L / N (the mean of
the per-sample losses), consistent with the derivatives, which are means over samples; alpha
is invariant to that scaling.

Observations that are not finite (NaN or infinite gradients or losses at either step) give
nan; the start step after them starts afresh.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor

from avionics.distributed import World, sum_over_processes
from avionics.persample import Request
from avionics.persample.rules.factored import FactoredDirection
from avionics.quantities.base import (
    StepData,
    TwoStepQuantity,
    mean_gradient_norms,
    mean_gradient_sq_norm,
)
from avionics.quantities.deferred import Deferred
from avionics.quantities.plain_sgd import plain_sgd_learning_rate

# Replaces a zero variance in the weights 1 / variance of the fit.
MIN_VARIANCE = 1e-10
_DIRECTION = "Alpha"


class Alpha(TwoStepQuantity):
    """The normalized step length of the noise-aware quadratic fit of the mean loss over the
    batch along the update (see the module docstring): 0 means the step landed on the fitted
    minimum, 1 that it jumped to the mirror point, -1 no motion or no minimum; nan when the
    observations are not finite. Stored under the start step t.

    Example:
        A value needs the next tracked step: of three steps, steps 0 and 1 get one. A small
        learning rate stops far short of the fitted minimum (alpha near -1).

        >>> from avionics.demo import example_run
        >>> from avionics.quantities import Alpha
        >>> output = example_run([Alpha()], steps=3, lr=0.1)
        >>> [step for step in output if "Alpha" in output[step]]
        [0, 1]
        >>> round(output[0]["Alpha"], 1)
        -0.9
    """

    info_keys = ("individual_losses", "batch_size", "optimizer")

    def __init__(self, schedule=None):
        super().__init__(schedule)
        self._plain_sgd: bool | None = None  # of the optimizer seen at the last start
        # measure s when optimizer.step() returns (until the parameters once changed after it)
        self._at_optimizer_step = True

    def validate(self, step: int, info: dict) -> None:
        """info['optimizer'] is the optimizer that updates the parameters (Alpha knows the
        update from its settings or measures it when its step returns)."""
        optimizer = info["optimizer"]
        if not hasattr(optimizer, "step"):
            raise TypeError(
                f"Step {step}: Alpha reads info['optimizer'], which must be the optimizer that "
                f"updates the parameters (a torch.optim.Optimizer); got {optimizer!r}. Pass "
                "info={..., 'optimizer': opt} or remove Alpha."
            )

    def request(self, step: int) -> Request:
        directions = set()
        if self.pending is not None:
            directions.add(_DIRECTION)  # g_n . s / tau at the end step
        if self.schedule(step) and (self._plain_sgd is not False or not directions):
            # the start projections of plain SGD; for any other optimizer (known from the last
            # step) only a non-empty request, so that the step's forward is captured
            directions.add("grad")
        return Request(directions=frozenset(directions))

    def prepare(self, data: StepData) -> dict[str, list[Tensor]]:
        if self.pending is None:
            return {}
        start = self.pending[1]
        start.finish_update(data.params)
        return {_DIRECTION: start.unit}

    def sums(self, data: StepData) -> dict[str, Tensor]:
        """Sums of the per-sample observations over this process's samples: the losses of this
        step, and, ending a start, the projections (g_n . s) / tau at both ends."""
        sums = _moment_sums("f", _checked_losses(data))
        if self.pending is not None:
            start = self.pending[1]
            start.finish_update(data.params)  # (prepare did, unless it was restored since)
            end = _summed(data.statistics.projections[_DIRECTION]).double()
            if start.per_tau is not None:
                end = end * start.per_tau
            sums.update(_moment_sums("df0", start.projections.double()))
            sums.update(_moment_sums("df1", end))
        return sums

    def start(self, data: StepData) -> _Start:
        # (read when the optimizer's step runs: the end of the start before, at this step, is
        # decided on the host when this step is stored)
        start = _Start.at(data, lambda: self._at_optimizer_step)
        self._plain_sgd = start.captured is None
        return start

    def finish(self, kept: _Start, data: StepData) -> float | Deferred:
        value = kept.alpha(data)
        return value.then(self._ended) if isinstance(value, Deferred) else value

    def _ended(self, value: float | None) -> float | None:
        if value is None:  # the parameters changed after optimizer.step()
            self._at_optimizer_step = False
        return value

    def state_dict(self) -> dict:
        """The pending start (its observations and the measured update) and what Alpha learnt
        of the optimizer. A start whose update is not measured yet (before
        ``optimizer.step()`` returned, or without its hook) holds the step's captured layer
        calls, which cannot be saved: it is left out, with a warning."""
        state = {"plain_sgd": self._plain_sgd, "at_optimizer_step": self._at_optimizer_step}
        if self.pending is not None and self.pending[1].unit is None:
            warnings.warn(
                f"Alpha: the start at step {self.pending[0]} has not measured its update yet "
                "(save the state after optimizer.step()); it is left out of the state.",
                stacklevel=2,
            )
            return state
        return {**state, **super().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self._plain_sgd = state.pop("plain_sgd", None)
        self._at_optimizer_step = state.pop("at_optimizer_step", True)
        super().load_state_dict(state)

    def save_kept(self, kept: _Start) -> dict:
        return kept.saved()

    def load_kept(self, saved: dict) -> _Start:
        return _Start.restored(saved)


class _Start:
    """What a start step keeps until the next step: its zeroth-order observation and either
    the unit update (plain SGD, with the start projections) or theta_t and the start's engine.

    Scalars stay tensors on the parameters' device until the fit, which reads them all with
    one host transfer.
    """

    def __init__(self, step: int, n, f: Tensor, var_f: Tensor):
        # the observation of the mean loss over the (global) batch of N samples
        self.step, self.n, self.f, self.var_f = step, n, f, var_f
        self.unit: list[Tensor] | None = None  # s / tau, or s when per_tau is set
        self.per_tau: Tensor | None = None  # 1 / tau, for a direction s that is not unit
        self.tau: Tensor | None = None
        self.projections: Tensor | None = None  # (g_n . s) / tau at the start, [N]
        self.params: list[Tensor] | None = None  # theta_t, when s is measured
        self.captured = None  # the start step's CapturedStep, until s is measured
        self._hook = None  # on the optimizer's step, while it is awaited
        self._closure_hook = None  # plain SGD: the end of a step that ran the block (closure)
        self._stepped: list[Tensor] | None = None  # the parameters, updated by the step
        self._at_optimizer_step = None  # whether to measure s when the step returns (asked then)
        self._norms: Tensor | None = None  # their norms when the step returned
        # plain SGD: the gradient's norms, the capture and whether to measure at the step,
        # until optimizer.step() starts
        self._predicted: tuple | None = None
        # the processes over which the parameters are sharded (FSDP), or None
        self.shards: World | None = None

    @classmethod
    def at(cls, data: StepData, at_optimizer_step=lambda: True) -> _Start:
        """The start at ``data``'s step; ``at_optimizer_step()``: whether to measure the update
        when ``optimizer.step()`` returns (asked when it does)."""
        n, f, var_f = _moments(data.totals["Alpha"], "f", data.batch_size)
        start = cls(data.step, n, f, var_f)
        start.shards = data.parallel.world if data.parallel.sharded else None
        optimizer = data.optimizer
        # Under data parallelism the update is -lr times what the processes' gradients average
        # to (DDP's mean of their means, not the global batch's mean with unequal batches):
        # it is measured
        lr = plain_sgd_learning_rate(optimizer) if data.parallel.world.size == 1 else None
        if lr is not None and "grad" in data.statistics.projections:
            # s = -lr * p.grad, and p.grad = c * g with c > 0 (c = N for a sum-reduced loss):
            # s / tau = -p.grad / ||p.grad|| and (g_n . s) / tau = -(g_n . g) / ||g||, from the
            # projections onto g that the engine computed for this step (shared with the
            # gradient tests)
            projections = _summed(data.statistics.projections["grad"])
            g_norm = mean_gradient_sq_norm(data).sqrt()
            grad_norm = g_norm if data.mean_grad is data.grads else g_norm * data.batch_size
            start.tau = lr * grad_norm
            start.projections = projections / -_positive(g_norm.to(projections.dtype))
            start.unit = _unit_step(data, grad_norm, g_norm)
            register = getattr(optimizer, "register_step_pre_hook", None)
            if register is not None and data.captured is not None:
                # check when optimizer.step() starts that it steps on the gradient seen here;
                # or when it ends, if the block ran inside it (optimizer.step(closure))
                # (the mean gradient's norms, shared with GradNorm, where p.grad is g)
                same = data.mean_grad is data.grads
                norms = mean_gradient_norms(data).double() if same else _norms(data.grads)
                start._predicted = (norms, data.captured, at_optimizer_step)
                start._hook = register(start._before_step)
                start._closure_hook = optimizer.register_step_post_hook(start._after_closure)
        else:
            if data.captured is None:
                raise RuntimeError(f"Step {data.step}: Alpha needs the step's per-sample data.")
            start.params = data.params_copy()
            start.captured = data.captured
            register = getattr(optimizer, "register_step_post_hook", None)
            # sharded (FSDP): s is measured at the end step, where its gather carries the
            # mean gradient too (:meth:`avionics.step.sharded.Sharded.whole`)
            if at_optimizer_step() and register is not None and start.shards is None:
                start._stepped = data.params
                start._at_optimizer_step = at_optimizer_step
                start._hook = register(start._after_step)
        return start

    def _before_step(self, optimizer, args, kwargs) -> None:
        """Plain SGD: when ``optimizer.step()`` starts, check that the gradients are those the
        tracked step saw (the update is then -lr g, as predicted). Where they changed since
        (clipping, ``GradScaler``'s unscaling of another scale, a gradient edited by hand),
        the update is measured instead, as for any other optimizer: theta_t is copied now,
        before the step, and the capture kept until s is known."""
        self._hook.remove()
        self._hook = None
        self._closure_hook.remove()
        self._closure_hook = None
        (norms, captured, at_optimizer_step), self._predicted = self._predicted, None
        tracked = captured.engine.params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tracked]
        if not bool(_changed(_norms(grads), norms)):
            return
        self.unit = self.tau = self.per_tau = self.projections = None
        self.params = [p.detach().clone() for p in tracked]  # theta_t: the step has not run
        self.captured = captured
        if at_optimizer_step():
            self._stepped = [p.detach() for p in tracked]
            self._at_optimizer_step = at_optimizer_step
            self._hook = optimizer.register_step_post_hook(self._after_step)

    def _after_closure(self, optimizer, args, kwargs) -> None:
        """Plain SGD, when the tracked block ran inside ``optimizer.step(closure)`` (Lightning):
        the step that just ended used the gradients now in ``p.grad`` (SGD leaves them as they
        are), possibly changed after the block (Lightning clips inside the closure). Where
        they changed, the update was s = -lr * p.grad: theta_t = theta_{t+1} - s, and s is
        projected on as for a measured update."""
        self._hook.remove()
        self._closure_hook.remove()
        self._hook = self._closure_hook = None
        (norms, captured, _), self._predicted = self._predicted, None
        tracked = captured.engine.params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tracked]
        if not bool(_changed(_norms(grads), norms)):
            return
        lr = plain_sgd_learning_rate(optimizer)
        stepped = [p.detach() for p in tracked]
        self.unit = self.tau = self.per_tau = self.projections = None
        self.params = torch._foreach_add(stepped, grads, alpha=lr)  # theta_t
        self.captured = captured
        self.finish_update(stepped)
        self._norms = _norms(stepped)

    def _after_step(self, optimizer, args, kwargs) -> None:
        """Measure s and project as soon as ``optimizer.step()`` returns; remember the
        parameters' norms, to check at the next tracked step that they did not change since.
        Where the start before learnt, when its end step (this start) was stored, that the
        parameters change after the optimizer's step, s is measured at the next tracked step
        instead, as for an optimizer without step hooks."""
        if not self._at_optimizer_step():
            self._hook.remove()
            self._hook, self._stepped = None, None
            return
        self.finish_update(self._stepped)
        self._norms = _norms(self._stepped)
        self._stepped = None

    def finish_update(self, params: list[Tensor]) -> None:
        """Measure s = theta_{t+1} - theta_t (when not known in advance) and project.

        A zero update gives a zero unit direction and zero projections (reported by
        :meth:`alpha`), so that nothing here waits for the device.
        """
        for hook in (self._hook, self._closure_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._closure_hook = None
        if self.unit is not None:
            return
        # the direction is s itself (projections are divided by tau afterwards: one pass over
        # the parameters less)
        self.unit = torch._foreach_sub(params, self.params)
        squares = _norms(self.unit).square()
        if self.shards is not None:  # ||s||^2 = sum_r ||s_r||^2 over the shards (FSDP)
            (squares,) = sum_over_processes([squares], self.shards)
        self.tau = squares.sum().sqrt()
        self.per_tau = 1 / _positive(self.tau)
        stats = self.captured.statistics(
            Request(directions=frozenset({_DIRECTION})), {_DIRECTION: self.unit}, self.params
        )
        self.projections = _summed(stats.projections[_DIRECTION]) * self.per_tau
        self.params, self.captured = None, None  # release theta_t and the start's capture

    _SAVED = ("step", "n", "f", "var_f", "per_tau", "tau", "projections", "_norms")

    def saved(self) -> dict:
        """This start, once its update is measured, as tensors and plain values."""
        unit = [
            {"delta": u.delta, "x": u.x, "coef": u.coef, "shape": list(u.shape)}
            if isinstance(u, FactoredDirection)
            else u
            for u in self.unit
        ]
        return {**{key: getattr(self, key) for key in self._SAVED}, "unit": unit}

    @classmethod
    def restored(cls, saved: dict) -> _Start:
        """The inverse of :meth:`saved`."""
        start = cls(int(saved["step"]), None, None, None)  # observations set below
        for key in cls._SAVED:
            setattr(start, key, saved[key])
        start.unit = [
            FactoredDirection(u["delta"], u["x"], u["coef"], u["shape"]) if isinstance(u, dict)
            else u
            for u in saved["unit"]
        ]  # fmt: skip
        return start

    def alpha(self, data: StepData) -> float | Deferred:
        """Alpha of this start and the end step ``data``, finished on the host (None, with a
        warning, where the parameters changed between ``optimizer.step()`` and this step)."""
        totals = data.totals["Alpha"]
        n, f1, vf1 = _moments(totals, "f", data.batch_size)
        _, df0, vdf0 = _moments(totals, "df0", data.batch_size)
        _, df1, vdf1 = _moments(totals, "df1", data.batch_size)
        if min(n, self.n) < 2:
            warnings.warn(
                f"Alpha at step {self.step} needs batches of at least 2 samples for its "
                "variances; stored nan.",
                stacklevel=3,
            )
            return math.nan
        changed = torch.zeros((), dtype=torch.float64, device=self.tau.device)
        if self._norms is not None:
            changed = _changed(_norms(data.params), self._norms).double()  # a fingerprint
        # read with the step's one host transfer, for the whole fit
        observations = [changed, self.tau, self.f, f1, df0, df1, self.var_f, vf1, vdf0, vdf1]
        return Deferred(tuple(observations), lambda floats, _: self._fit(data.step, *floats))

    def _fit(self, end: int, changed, tau, f0, f1, df0, df1, vf0, vf1, vdf0, vdf1):
        """Alpha from the observations on the host (see :meth:`alpha`)."""
        if changed:
            warnings.warn(
                f"Alpha at step {self.step}: the parameters changed between optimizer.step() "
                f"and step {end} (another optimizer step, or a change such as weight "
                "clipping), so the update measured when optimizer.step() returned is not "
                f"theta_{{t+1}} - theta_t; stored nothing for step {self.step}. From now on "
                "Alpha measures the update at the next tracked step, keeping each start "
                "step's captured layer inputs and output gradients until then.",
                stacklevel=3,
            )
            return None
        if tau == 0:
            warnings.warn(
                f"Alpha at step {self.step}: the update theta_{{t+1}} - theta_t has length zero "
                "(no motion); stored -1.",
                stacklevel=3,
            )
            return -1.0
        return fit_alpha(tau, [f0, f1], [df0, df1], [vf0, vf1], [vdf0, vdf1])


def _unit_step(data: StepData, grad_norm: Tensor, g_norm: Tensor) -> list:
    """-p.grad / ||p.grad|| per parameter, for plain SGD. A Linear weight whose gradient is a
    mean of N outer products smaller than the weight keeps the factors instead of a copy:
    -g / ||g|| = -1 / (N ||g||) sum_m delta_m x_m^T (see
    :mod:`avionics.persample.rules.factored`), which the next step projects onto at a cost of
    N^2 (I + O) instead of N I O."""
    captured = data.captured
    factors = captured.mean_gradient_factors() if captured else [None] * len(data.grads)
    n = len(data.individual_losses)
    dense = [k for k, f in enumerate(factors) if f is None]
    unit: list = [None] * len(data.grads)
    if dense:
        grads = [data.grads[k] for k in dense]
        copies = torch._foreach_div(grads, -_positive(grad_norm.to(grads[0].dtype)))
        for k, u in zip(dense, copies, strict=True):
            unit[k] = u
    for k, f in enumerate(factors):
        if f is not None:
            delta, x = f
            coef = -1.0 / (n * _positive(g_norm.to(delta.dtype)))
            unit[k] = FactoredDirection(delta, x, coef, data.params[k].shape)
    return unit


def fit_alpha(tau: float, f, df, var_f, var_df) -> float:
    """Alpha from the weighted least-squares quadratic fit of docs/definitions.md, section 7;
    nan when an observation, a variance or tau is not finite (there is nothing to fit)."""
    if not all(map(math.isfinite, [tau, *f, *df, *var_f, *var_df])):
        return math.nan
    x = np.array([[1.0, 0.0, 0.0], [1.0, tau, tau**2], [0.0, 1.0, 0.0], [0.0, 1.0, 2.0 * tau]])
    y = np.array([*f, *df], dtype=np.float64)
    variances = np.array([*var_f, *var_df], dtype=np.float64)
    variances = np.where(variances == 0, MIN_VARIANCE, variances)
    root_weights = 1.0 / np.sqrt(variances)
    w, *_ = np.linalg.lstsq(x * root_weights[:, None], y * root_weights, rcond=None)
    w2, w3 = float(w[1]), float(w[2])
    if w3 < 0 or not math.isfinite(w3):
        return -1.0
    # tau / x* - 1 with x* = -w2 / (2 w3), written without dividing by w3
    if w2 == 0:  # minimum at the start (w3 > 0); a flat fit (w3 = 0) has none
        return math.inf if w3 > 0 else -1.0
    return -2.0 * w3 * tau / w2 - 1.0


def _checked_losses(data: StepData) -> Tensor:
    """The per-sample losses in float64 (the cockpit has checked that they were passed)."""
    return data.individual_losses.detach().double()


def _moment_sums(name: str, values: Tensor) -> dict[str, Tensor]:
    """The count, sum and sum of squares of ``values`` (float64), named ``name.*`` (the count
    filled on the device: a tensor made from a host number is a copy the host waits for)."""
    return {
        f"{name}.n": values.new_full((), values.numel(), dtype=torch.float64),
        f"{name}.sum": values.sum(),
        f"{name}.sq": values.pow(2).sum(),
    }


def _moments(totals: dict[str, Tensor], name: str, count: int) -> tuple[int, Tensor, Tensor]:
    """(N, mean, unbiased variance) from the :func:`_moment_sums` of all ``count`` samples
    (the global batch size, known on the host: no read of the summed count); the variance
    (sum x^2 - (sum x)^2 / N) / (N - 1), nan for N < 2."""
    n, total, squares = (totals[f"{name}.{key}"] for key in ("n", "sum", "sq"))
    mean = total / n
    if count < 2:
        return count, mean, torch.full_like(mean, math.nan)
    return count, mean, (squares - total * mean).clamp_min(0) / (n - 1)


def _summed(per_parameter: list[Tensor]) -> Tensor:
    """sum over parameters of per-parameter [N] tensors, in one operation."""
    if len(per_parameter) == 1:
        return per_parameter[0]
    if len({t.dtype for t in per_parameter}) > 1:
        return sum(per_parameter)
    return torch.stack(per_parameter).sum(0)


def _changed(norms: Tensor, kept: Tensor) -> Tensor:
    """Whether any norm differs from the kept one; nan equals nan (parameters that were nan
    and still are did not change)."""
    return ((norms != kept) & ~(norms.isnan() & kept.isnan())).any()


def _norms(tensors: list[Tensor]) -> Tensor:
    """[||t_k||] in float64, on the tensors' device (no host transfer)."""
    return torch.stack(torch._foreach_norm(tensors)).double()  # (widening exactly, at once)


def _positive(value: Tensor) -> Tensor:
    """``value``, or the smallest positive number where it is zero (for divisions of zero)."""
    return value.clamp_min(torch.finfo(value.dtype).tiny)
