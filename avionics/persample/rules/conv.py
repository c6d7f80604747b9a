"""nn.Conv1d/2d/3d (groups, stride, padding, dilation, padding modes).

Unfolding the input turns a convolution into a grouped linear map over the output locations
t: y_{g,t} = W_g x^unf_{g,t} + b, so its per-sample gradients have the closed forms of
:mod:`bilinear`. The unfolding is ``F.unfold`` (im2col) for 2d convolutions; other dimensions use a
convolution with a one-hot kernel per kernel position (groups = input channels), which gives
the same columns for any number of spatial dimensions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from avionics.persample.rules.base import (
    ColumnSums,
    batch_first,
    chunk_size,
    concatenate,
    output_gradient,
)
from avionics.persample.rules.bilinear import (
    UNFOLDED_GRADIENTS,
    BilinearRule,
)
from avionics.persample.rules.kernels import LayerKernels

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_WEIGHT_GRADIENT = {
    1: torch.nn.grad.conv1d_weight,
    2: torch.nn.grad.conv2d_weight,
    3: torch.nn.grad.conv3d_weight,
}
# The layer's own kernels (see ConvRule.kernels).
GROUPED = "grouped convolution"
SAMPLES_AS_GROUPS = "the weight gradient of the samples as groups"
CONVOLUTION = "the layer's convolution"
# Fewest input channels per group of a 2d convolution from which its G_n are not formed by the
# grouped convolution, and fewest output positions from which they are formed by the weight
# gradient of the samples as groups (BENCHMARKS.md, "Measurements behind the engine's
# choices").
_WIDE_CHANNELS = 8
_MANY_POSITIONS = 64
# Bytes of pending column gradients a convolution may hold before they are reduced, and of
# one chunk of per-sample, per-column convolution gradients (kept small: it stays in cache).
CONV_PENDING_BYTES = 64 * 2**20
CONV_CHUNK_BYTES = 2 * 2**20


def _padded(module: nn.modules.conv._ConvNd, x: Tensor) -> tuple[Tensor, tuple | int]:
    """(x, padding): x padded here where the layer's padding is not plain zeros on both
    sides (padding modes, "same", "valid"), with padding 0 left to the kernel; else x and the
    layer's padding."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return x, module.padding
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return F.pad(x, module._reversed_padding_repeated_twice, mode=mode), 0


def _shape(t: Tensor) -> str:
    """'[N, 3, 32, 32]'."""
    return "[" + ", ".join(["N", *map(str, t.shape[1:])]) + "]"


def unfold(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """[N, C, *spatial] -> [N, C * prod(kernel), L] with the layout of the weight's columns."""
    dims = len(module.kernel_size)
    x, padding = _padded(module, x)
    if dims == 2:
        return F.unfold(x, module.kernel_size, module.dilation, padding, module.stride)
    channels, k = x.shape[1], math.prod(module.kernel_size)
    eye = torch.eye(k, dtype=x.dtype, device=x.device).reshape(k, 1, *module.kernel_size)
    kernel = eye.repeat(channels, 1, *([1] * dims))
    cols = _CONV[dims](x, kernel, None, module.stride, padding, module.dilation, channels)
    return cols.reshape(x.shape[0], channels * k, -1)


class ConvRule(BilinearRule):
    def __init__(self, module: nn.modules.conv._ConvNd, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        groups = module.groups
        self.raw_inputs, self.raw_deltas, ds = [], [], []
        for call in calls:
            self.raw_inputs.append(
                batch_first(call.args[0], call.batch_axis, n, "Convolution input")
            )
            d = batch_first(output_gradient(call), call.batch_axis, n, "Convolution output")
            self.raw_deltas.append(d)
            ds.append(d.reshape(n, groups, d.shape[1] // groups, -1).transpose(2, 3))
        # [N, G, T, O/G], a view of the output gradients where the layer is called once: the
        # factor goes on the input, scaled before it is unfolded (inputs), only by the plans
        # that unfold it; the layer's own kernels scale their results; the bias reads
        # delta_scale
        self.delta, self.delta_scale = concatenate(ds, 2), output_gradient_factor

    def kernels(self) -> LayerKernels:
        """The layer's own kernels: G_n by one grouped convolution, by the weight gradient of
        the samples as groups, and G_n . V by the layer's own convolution; :mod:`kernels` takes
        the ones this rule names.

        The rule (BENCHMARKS.md, "Measurements behind the engine's choices", from
        ``benchmarks/conv_plans.py``): G_n by the grouped convolution for 2d layers with
        fewer than _WIDE_CHANNELS input channels per group (1.6-4.5x faster than unfolding
        there), by the weight gradient of the samples as groups where the kernel has more than
        one offset and the output at least _MANY_POSITIONS positions (1.3-3.2x faster than
        unfolding and 1.4-2.0x faster than the windows of the flat input it replaced; with
        fewer positions or a 1 x 1 kernel unfolding is cheap, 1.1-1.3x faster than it), else
        by unfolding; G_n . V by the layer's own convolution."""
        m = self.module
        gradients = {
            GROUPED: self._grouped_gradients,
            SAMPLES_AS_GROUPS: self._sample_group_gradients,
        }
        positions = min(math.prod(d.shape[2:]) for d in self.raw_deltas)
        if m.weight.dim() == 4 and m.in_channels // m.groups < _WIDE_CHANNELS:
            prior = GROUPED
        elif positions >= _MANY_POSITIONS and math.prod(m.kernel_size) > 1:
            prior = SAMPLES_AS_GROUPS
        else:
            prior = UNFOLDED_GRADIENTS
        return LayerKernels(
            gradients=gradients,
            projections={CONVOLUTION: self._convolved_projection},
            prior_gradients=prior,
            prior_projections=CONVOLUTION,
            key=self._key(),
            describe=self._describe,
        )

    def _key(self) -> tuple:
        """What the kernels' costs depend on: the layer's configuration, each call's
        per-sample input and output shapes, dtype and device."""
        m = self.module
        shapes = tuple(
            (tuple(x.shape[1:]), tuple(d.shape[1:]))
            for x, d in zip(self.raw_inputs, self.raw_deltas, strict=True)
        )
        config = (m.weight.shape, m.stride, m.padding, m.dilation, m.groups, m.padding_mode)
        return (type(m).__name__, config, shapes, self.delta.dtype, self.delta.device)

    def _describe(self) -> str:
        """'conv Conv2d(3, 64, kernel_size=(5, 5), stride=(1, 1)) [N, 3, 32, 32] -> [N, 64,
        28, 28]' (each call's shapes)."""
        shapes = ", ".join(
            f"{_shape(x)} -> {_shape(d)}"
            for x, d in zip(self.raw_inputs, self.raw_deltas, strict=True)
        )
        return f"conv {self.module} {shapes}"

    def _convolved_projection(self, v: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        """G_n . V = sum_t delta_{n,t} . (V x^unf_{n,t}) = <delta_n, conv(x_n; V)> of samples
        start..stop-1 (all by default): the layer's own convolution with V as its weight
        (padding, stride, groups as the layer has them), without unfolding the input; cost
        N T I O, that of the layer's forward. A chunk of samples at a time, so that the
        convolution's output stays within the chunk budget (the whole batch at once was 4x
        slower on the 3c3d CNN's first layer at N = 128)."""
        stop = self.raw_deltas[0].shape[0] if stop is None else stop
        numel = sum(d[0].numel() for d in self.raw_deltas)
        step = chunk_size(stop - start, numel, self.delta.element_size())
        parts = []
        for a in range(start, stop, step):
            b = min(stop, a + step)
            part = None
            for x, d in zip(self.raw_inputs, self.raw_deltas, strict=True):
                mapped = self.module._conv_forward(x[a:b], v, None)
                p = torch.linalg.vecdot(mapped.flatten(1), d[a:b].flatten(1))
                part = p if part is None else part + p
            parts.append(part)
        return torch.cat(parts) * self.output_gradient_factor

    def _sample_group_gradients(self, start: int, stop: int) -> Tensor:
        """G_n of samples start..stop-1 shaped like the weight, by
        :func:`sample_group_gradients` summed over the calls."""
        total = None
        for x, d in zip(self.raw_inputs, self.raw_deltas, strict=True):
            g = sample_group_gradients(self.module, x[start:stop], d[start:stop])
            total = g if total is None else total.add_(g)
        return total.mul_(self.output_gradient_factor)

    def _grouped_gradients(self, start: int, stop: int) -> Tensor:
        """G_n of samples start..stop-1 shaped like the weight, by one grouped convolution per
        call (the trick of Opacus and BackPACK), without unfolding.

        Per sample n, output channel o of group g, input channel c of that group and kernel
        offset k (per spatial axis; s: stride, d: dilation, x padded),

            G_n[o, c, k] = sum_t delta_n[o, t] x_n[c, s t + d k],

        a convolution of x_n[c] with delta_n[o] as its kernel, stride d and dilation s (the
        layer's swapped). So with the in-channels of a group as the batch, [C/G, n G, *S], and
        delta as n O kernels of one channel, groups = n G pairs each (sample, group) input
        channel with its O/G output channels. The result has floor((S_p - s (T - 1) - 1) / d)
        + 1 >= k positions per axis (S_p: padded size, T: output size; more than k where the
        layer's stride leaves input unread at the end): the first k are G_n."""
        m = self.module
        samples, groups, kernel = stop - start, m.groups, tuple(m.kernel_size)
        total = None
        for x, d in zip(self.raw_inputs, self.raw_deltas, strict=True):
            x, padding = _padded(m, x[start:stop])
            inputs = x.reshape(samples * groups, -1, *x.shape[2:]).transpose(0, 1)
            kernels = d[start:stop].reshape(samples * d.shape[1], 1, *d.shape[2:])
            g = _CONV[len(kernel)](
                inputs, kernels, None, m.dilation, padding, m.stride, samples * groups
            )  # [C/G, n O, *positions >= kernel]
            g = g[(..., *(slice(0, k) for k in kernel))]
            g = g.reshape(g.shape[0], samples, d.shape[1], *kernel).movedim(0, 2)
            total = g if total is None else total + g
        return total.mul(self.output_gradient_factor).contiguous()

    def total(self) -> list[Tensor]:
        """sum_n g_n per parameter, for the engine's check against autograd: the weight's by
        the convolution's own weight-gradient kernel on each call's captured input and output
        gradient (sum_n G_n = sum_{n,t} delta_{n,t} x^unf_{n,t}^T, without unfolding: the
        check runs at a process's first step, which unfolding made 20% slower)."""
        m = self.module
        weight_gradient = _WEIGHT_GRADIENT[len(m.kernel_size)]
        out = []
        for name in self.names:
            if name != "weight":
                out.append(self._bias().sum(0))
                continue
            total = None
            for x, d in zip(self.raw_inputs, self.raw_deltas, strict=True):
                x, padding = _padded(m, x)
                g = weight_gradient(
                    x, m.weight.shape, d.to(x.dtype), m.stride, padding, m.dilation, m.groups
                )
                total = g if total is None else total + g
            out.append(total * self.output_gradient_factor)
        return out

    def inputs(self, start: int, stop: int) -> Tensor:
        """The unfolded inputs of samples start..stop-1 times the output-gradient factor c,
        [stop - start, G, T, (C/G) K]: built per chunk, since the unfolded input is
        prod(kernel) times the size of the input; c x scaled before unfolding (unfolding and
        padding are linear), so G_n = sum_t delta_t (c x_t)^T."""
        groups, xs = self.module.groups, []
        for x in self.raw_inputs:
            cols = unfold(self.module, x[start:stop] * self.output_gradient_factor)  # [c, C*K, L]
            xs.append(cols.reshape(stop - start, groups, -1, cols.shape[-1]).transpose(2, 3))
        return concatenate(xs, 2)

    @classmethod
    def column_sums(cls, module, calls, names, n, traces):
        """Called once on an input [N, C, *spatial]: no closed form (the output locations are
        shared axes), but the per-sample, per-column gradients of many columns at once
        (:class:`ConvColumnSums`). Else the default. With ``traces``, the sums are formed and
        summed."""
        if len(calls) != 1 or not _single_input(calls[0], module, n):
            return super().column_sums(module, calls, names, n, traces)
        return ConvColumnSums(module, calls[0], names, n, traces)


def sample_group_gradients(module: nn.modules.conv._ConvNd, x: Tensor, d: Tensor) -> Tensor:
    """sum_t d_{n,t} x^unf_{n,t}^T [n, *weight shape] of a convolution for its input x
    [n, C, *S] and output gradient d [n, O, *T], by the convolution's own weight-gradient
    kernel (``torch.nn.grad.conv*d_weight``, as autograd computes the layer's) for one call of
    the layer with the samples as groups.

    With x as [1, n C, *S] and d as [1, n O, *T], the convolution with n G groups (the
    layer's stride, padding, dilation) maps group (n, g) of x's channels, sample n's group g,
    to group (n, g) of d's, sample n's output channels of group g; so its weight gradient
    [n O, C/G, *k] holds sum_t d_{n,g,t} x^unf_{n,g,t}^T for each (n, g) in turn: the G_n
    stacked, by one call of the kernel autograd runs for the layer (no unfolding)."""
    x, padding = _padded(module, x)
    samples, shape = x.shape[0], module.weight.shape
    d = d.to(x.dtype)
    g = _WEIGHT_GRADIENT[len(module.kernel_size)](
        x.reshape(1, -1, *x.shape[2:]), (samples * shape[0], *shape[1:]),
        d.reshape(1, -1, *d.shape[2:]), module.stride, padding, module.dilation,
        samples * module.groups,
    )  # fmt: skip
    return g.view(samples, *shape)


def _single_input(call, module, n: int) -> bool:
    x = call.args[0] if len(call.args) == 1 and not call.kwargs else None
    return (
        isinstance(x, Tensor)
        and len(call.nodes) == 1
        and call.node_outputs == [0]
        and x.dim() == len(module.kernel_size) + 2
        and x.shape[call.batch_axis] == n
        and x._version == call.input_versions[0]
    )


class ConvColumnSums(ColumnSums):
    """sum_j sum_n g_{n,j}^2 of a convolution's weight and bias (module called once), g_{n,j}
    the gradient of sample n for column j: G_{n,j,g} = delta_{n,j,g} X_{n,g}^T with the
    unfolded input X_{n,g} [locations, (in channels / groups) x kernel].

    The columns' output gradients are kept (up to :data:`CONV_PENDING_BYTES`) and reduced
    together, a few samples at a time so that everything stays in cache: per sample and group
    one product [k columns x out channels / groups, locations] @ [locations, in / groups x
    kernel], squared in place and summed. The input is unfolded once per k columns (not once per
    column), each product is k times larger than one column's, and no [N, k, ...] copy of the
    columns is made.
    """

    def __init__(self, module, call, names: list[str], n: int, traces: bool):
        self.module, self.call, self.n = module, call, n
        self.names, self.traces = list(names), traces
        self.groups = module.groups
        self.pending: list[Tensor] = []
        self.weight_sum: Tensor | None = None
        self.bias_sum: Tensor | None = None

    def add(self, grad_outputs: list[list[Tensor | None]]) -> None:
        d = grad_outputs[0][0]
        if d is None:
            return
        d = d.movedim(self.call.batch_axis, 0)
        d = d.reshape(self.n, self.groups, d.shape[1] // self.groups, -1)  # [N, G, O/G, T]
        if "bias" in self.names:
            b = d.sum(-1).reshape(self.n, -1)
            self.bias_sum = b * b if self.bias_sum is None else self.bias_sum.addcmul_(b, b)
            # (summed over samples in result(): sum_n of [N, O] rows, cheap)
        if "weight" in self.names:
            self.pending.append(d)
            if len(self.pending) * d.numel() * d.element_size() >= CONV_PENDING_BYTES:
                self._reduce()

    def _reduce(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        n, groups, k = self.n, self.groups, len(pending)
        x = self.call.args[0].movedim(self.call.batch_axis, 0)
        o, t = pending[0].shape[2], pending[0].shape[3]
        i = (x.shape[1] // groups) * math.prod(self.module.kernel_size)
        per_sample = groups * (k * o * (t + i) + t * i) * pending[0].element_size()
        step = max(1, min(n, CONV_CHUNK_BYTES // max(1, per_sample)))
        total = self.weight_sum
        for start in range(0, n, step):
            stop = min(n, start + step)
            # the chunk's columns side by side, [c, G, k O/G, T], and its unfolded input
            d = torch.cat([p[start:stop] for p in pending], 2) if k > 1 else pending[0][start:stop]
            cols = unfold(self.module, x[start:stop])  # [c, C K, T]
            cols = cols.reshape(stop - start, groups, i, t)
            g = torch.matmul(d, cols.transpose(-1, -2))  # [c, G, k O/G, I/G]
            g = g.mul_(g).reshape(stop - start, groups, k, o, i)
            part = g.sum((0, 2))  # [G, O/G, I/G]
            total = part if total is None else total.add_(part)
        self.weight_sum = total

    def result(self, scale: float) -> list[Tensor | None]:
        self._reduce()
        out: list[Tensor | None] = []
        for name in self.names:
            p = self.module.get_parameter(name)
            s = self.weight_sum if name == "weight" else self.bias_sum
            if s is None:
                out.append(None)
                continue
            s = s.sum(0) if name == "bias" else s
            s = s.reshape(p.shape).mul_(scale)
            out.append(s.sum() if self.traces else s)
        return out
