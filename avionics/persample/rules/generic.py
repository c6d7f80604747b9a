"""Any other module that owns parameters: torch.func on the module's own forward.

For sample n, with the module's captured inputs x_n and output gradients delta_n,

    g_n = output_gradient_factor * (d module(x_n; theta) / d theta)^T delta_n,

one vector-Jacobian product of the module alone (its children run inside it with their
parameters held fixed). ``torch.func.vmap`` batches the products over samples, with the
kernels vmap has batching rules for (math attention; nn.TransformerEncoder's nested-tensor
fast path off) and a fresh random draw per sample (dropout inside the module draws new
masks, from a fork of the random state: the user's next draws are those of an untracked
step). A module vmap cannot batch takes one product per sample instead: equally exact,
slower. Both paths report their cost through :attr:`GenericRule.on_slow_path`.

The re-runs read the module's buffers as the step left them and write none of them, and a
BatchNorm inside that normalises with the batch's statistics normalises by those of the
user's forward (:mod:`avionics.persample.rules.forward_state`). What a re-run finds of a
call (the outputs' batch axes, those statistics) is found once a step
(:attr:`ModuleCall.found <avionics.persample.calls.ModuleCall.found>`), also across the
curvature's columns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree

from avionics.persample.precision import LOW_PRECISION, computing
from avionics.persample.rules.base import Rule, output_gradient
from avionics.persample.rules.forward_state import BatchStatistics, rerun
from avionics.persample.rules.randomness import replayed, state_before

# Modules whose forward vmap could not batch, and vmap's error: the per-sample loop is used.
_UNBATCHABLE: dict[type, str] = {}


class GenericRule(Rule):
    # on_slow_path(module, names, reason, seconds, samples): called after each run of samples,
    # with why vmap could not batch the module where it took the per-sample loop (else None)
    on_slow_path: Callable[[nn.Module, list[str], str | None, float, int], None] | None = None

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        totals = None
        for call in self.calls:
            grads = self._call_gradients(call, start, stop)
            totals = grads if totals is None else [t + g for t, g in zip(totals, grads)]
        return totals

    def _call_gradients(self, call, start: int, stop: int) -> list[Tensor]:
        # (the re-runs draw from a fork of the random state: the user's next draws unchanged)
        with replayed(state_before(call.args)):
            return self._call_gradients_drawing(call, start, stop)

    def _call_gradients_drawing(self, call, start: int, stop: int) -> list[Tensor]:
        axis, n = call.batch_axis, self.n
        leaves, spec = pytree.tree_flatten((call.args, call.kwargs))
        batched = [isinstance(t, Tensor) and t.dim() > axis and t.shape[axis] == n for t in leaves]
        params = {
            name: computing(p.detach()) for name, p in zip(self.names, self.params, strict=True)
        }
        module = self.module
        fixed = _in_float32(module, params)
        found = call.found
        if found.batch_statistics is None:
            found.batch_statistics = _batch_statistics(module, (params, fixed), call)
        statistics = found.batch_statistics
        leaves = [
            t.detach().narrow(axis, start, stop - start) if b else _detach(t)
            for t, b in zip(leaves, batched, strict=True)
        ]

        def forward(theta, sample_leaves):
            restored = [
                t.unsqueeze(axis) if b else t for t, b in zip(sample_leaves, batched, strict=True)
            ]
            args, kwargs = pytree.tree_unflatten(restored, spec)
            out = rerun(module, (theta, fixed), args, kwargs, statistics)
            return [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]

        delta_axes = output_batch_axes(call, n)
        deltas = [
            output_gradient(call, i).narrow(a, start, stop - start) * self.output_gradient_factor
            for i, a in enumerate(delta_axes)
        ]

        def sample_gradient(sample_leaves, sample_deltas):
            _, pull = vjp(lambda theta: forward(theta, sample_leaves), params)
            cotangents = [d.unsqueeze(a) for d, a in zip(sample_deltas, delta_axes, strict=True)]
            (grads,) = pull(cotangents)
            return [grads[name] for name in self.names]

        in_dims = ([axis if b else None for b in batched], delta_axes)
        began = time.perf_counter()
        if type(module) not in _UNBATCHABLE:
            try:
                with _batchable_kernels():
                    over_samples = vmap(sample_gradient, in_dims=in_dims, randomness="different")
                    grads = over_samples(leaves, deltas)
                self._report(None, began, stop - start)
                return grads
            except (RuntimeError, NotImplementedError, ValueError) as error:
                _UNBATCHABLE[type(module)] = str(error).split("\n")[0]
        with _reference_rnn_kernel(module):
            rows = [
                sample_gradient(
                    [t.select(axis, i) if b else t for t, b in zip(leaves, batched, strict=True)],
                    [d.select(a, i) for d, a in zip(deltas, delta_axes, strict=True)],
                )
                for i in range(stop - start)
            ]
        self._report(_UNBATCHABLE[type(module)], began, stop - start)
        return [torch.stack(per_param) for per_param in zip(*rows, strict=True)]

    def _report(self, reason: str | None, began: float, samples: int) -> None:
        if self.on_slow_path is not None:
            seconds = time.perf_counter() - began
            self.on_slow_path(self.module, self.names, reason, seconds, samples)


@contextmanager
def _batchable_kernels():
    """The kernels vmap can batch: the math attention kernel (vmap has no batching rule for
    the fused ones), and nn.TransformerEncoder's nested-tensor fast path off (its check of a
    padding mask, ``torch._nested_tensor_from_mask_left_aligned``, has no batching rule).
    Both compute the same function as the kernels they replace."""
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)


@contextmanager
def _reference_rnn_kernel(module):
    """For a recurrent module: oneDNN off. Its float32 RNN kernel's backward needs a workspace
    that torch.func's vjp does not keep ("Expected a proper Tensor ... 'workspace'"). The
    flag is toggled alone: torch.backends.mkldnn.flags also resets TF32 and warns each time."""
    if not isinstance(module, nn.RNNBase):
        yield
        return
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _in_float32(module: nn.Module, tracked: dict[str, Tensor]) -> dict[str, Tensor]:
    """The module's other 16-bit parameters and buffers (not in ``tracked``) in float32, by
    name: a half-precision module re-runs in float32 on its float32 captured inputs."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return {
        name: t.detach().float()
        for name, t in named
        if name not in tracked and t.dtype in LOW_PRECISION
    }


def _batch_statistics(module: nn.Module, state: tuple, call) -> BatchStatistics:
    """The statistics of the batch-statistics BatchNorms inside ``module`` in ``call``'s
    forward, by one re-run on the whole batch (none where it has no such BatchNorm)."""
    statistics = BatchStatistics(module)
    if statistics.norms:
        args, kwargs = pytree.tree_map(_detach, (call.args, call.kwargs))
        with torch.no_grad(), statistics.recording():
            rerun(module, state, args, kwargs, statistics)
    return statistics


def _detach(leaf):
    return leaf.detach() if isinstance(leaf, Tensor) else leaf


def output_batch_axes(call, n: int) -> list[int]:
    """The batch axis of each output of ``call`` (``n`` samples on its input's batch axis),
    by one re-run of its module on the call's first sample alone (:func:`_output_batch_axes`),
    found once (:attr:`ModuleCall.found`). The re-run draws from a fork of the random state
    and normalises the batch-statistics BatchNorms inside by the whole batch's."""
    found = call.found
    if found.output_batch_axes is not None:
        return found.output_batch_axes
    module, axis = call.module, call.batch_axis
    params = {name: computing(p.detach()) for name, p in module.named_parameters()}
    state = (params, _in_float32(module, params))
    if found.batch_statistics is None:
        found.batch_statistics = _batch_statistics(module, state, call)

    def first(t):
        if isinstance(t, Tensor) and t.dim() > axis and t.shape[axis] == n:
            return t.detach().narrow(axis, 0, 1)
        return _detach(t)

    args, kwargs = pytree.tree_map(first, (call.args, call.kwargs))
    with torch.no_grad(), replayed(state_before(call.args)):
        out = rerun(module, state, args, kwargs, found.batch_statistics)
    one = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
    found.output_batch_axes = _output_batch_axes(call, one, n)
    return found.output_batch_axes


def _output_batch_axes(call, one: list[Tensor], n: int) -> list[int]:
    """The batch axis of each output of ``call``, from ``one``, the module's outputs re-run on
    one sample (its input's batch axis, as the engine decided it, of size 1): the one axis on
    which the output of the N samples has N entries and that of the sample 1, all others
    alike. Not guessed from the sizes: a time-major root maps ids [T, N] to logits [N, C], and
    with C == N (or T == N) a size alone does not tell the batch axis. With N == 1, any axis
    of size 1 (the call's batch axis where it is one)."""
    found = []
    for meta, t in zip(call.outputs, one, strict=True):
        full, sample = tuple(meta.shape), tuple(t.shape)
        axes = [
            a
            for a in range(len(full))
            if len(sample) == len(full)
            and full[a] == n
            and sample[a] == 1
            and full[:a] + full[a + 1 :] == sample[:a] + sample[a + 1 :]
        ]
        if len(axes) != 1 and not (n == 1 and axes):
            raise RuntimeError(
                f"An output of shape {full} (of one sample re-run alone: {sample}) does not "
                f"have the batch of {n} samples on exactly one axis (found: {axes}); per-sample "
                "gradients need the batch on one axis of every output, and each sample's "
                "output computed from that sample alone."
            )
        found.append(call.batch_axis if call.batch_axis in axes else axes[0])
    return found
