"""Floors: the least exact work the gradient tests and the economy preset add to a step.

A floor is a hand-written training step with no framework around it. Plain module hooks capture
each parameterised layer call's input x (a forward hook) and the gradient d of the mean loss
with respect to its output (a tensor hook on the output); after the backward, each parameter's
per-sample statistics come from the cheapest exact kernel for its layer, chosen by FLOPs.

Notation: b_n is sample n's contribution to ``p.grad`` = G (the gradient of the mean loss), so
sum_n b_n = G, the per-sample gradient is g_n = N b_n and the mean gradient g = G. Hence
||g_n||^2 = N^2 ||b_n||^2 and g_n . g = N b_n . G. With T positions shared by a sample (a
sequence; T = 1 without shared axes):

* Linear weight, b_n = sum_t d_t x_t^T. T = 1: ||b_n||^2 = ||d_n||^2 ||x_n||^2 (N (I + O)),
  and b_n . G' = sum_m (d_n . d'_m)(x_n . x'_m) for a direction G' = sum_m d'_m x'_m^T whose
  factors are kept (the Gram form, N N' (I + O)) or d_n^T G' x_n (N O I), the cheaper. T > 1:
  ||b_n||^2 = sum_{t,s} (d_t . d_s)(x_t . x_s) (N T^2 (I + O)) or b_n materialised (N T O I),
  the cheaper; projections sum_t d_t^T G' x_t (N T O I) unless b_n is materialised anyway
  (always, when norms are needed too).
* Conv2d weight (groups 1): b_n = sum_l d_l u_l^T over the L output positions, u the unfolded
  input (K = C kh kw rows). Materialised (N O K L) by one grouped convolution (the input as
  [C, N, H, W], d as N O kernels, groups=N; stride and dilation swap), by unfold + bmm, or
  by the layer's weight-gradient kernel on one convolution with the samples as groups (x as
  [1, N C, H, W], d as [1, N O, H', W'], groups=N: the engine's kernel,
  :func:`avionics.persample.rules.conv.sample_group_gradients`), the fastest in a
  measurement at the layer's first call (best of 3, CPU time); or, where cheaper, norms by
  the Gram form sum_{l,l'} (d_l . d_l')(u_l . u_l') (N L^2 (K + O)) and projections b_n . v =
  sum_l d_l^T v u_l by one ordinary convolution of x with v as its weight (N O K L, no
  per-sample buffer; also for projections alone).
* Embedding, b_n = sum_t e_t onehot(i_t)^T: ||b_n||^2 from b_n materialised by index_add
  (N V W; the GPT's tables are small: its position table has T rows, its token table is
  tied), b_n . G' = sum_t e_t . G'_{i_t} (N T W).
* LayerNorm: b_n = sum_t d_t * xhat_t (weight) and sum_t d_t (bias), [N, W], materialised.
* Biases: b_n = sum_t d_t, materialised.
* nn.MultiheadAttention (self-attention): the floor runs its own forward (the packed
  in-projection by ``F.linear``, ``F.scaled_dot_product_attention``, ``out_proj`` as a
  module), so the in-projection W [3E, E] is a Linear over the T positions (above).
* Root parameters added to a child's input h (the encoder's position table, the ViT's class
  token and position table, :data:`ROOT_USES`): b_n read from the gradient of h, materialised
  (N T W).
* A parameter with several uses (the GPT's embedding tied to its head, a layer called twice):
  the summed b_n of all uses is materialised in chunks of samples (at most ``CHUNK`` values
  at once), its norms and projections read from it.

Economy's floor is the three tests' floor and what its other instruments minimally need under
plain SGD: GradNorm, one ``_foreach_norm`` of the gradients; UpdateSize = lr ||g^(k)||;
Distance, one ``_foreach_sub`` from theta_0 and one ``_foreach_norm``; Loss, the loss read;
Alpha, the mean and unbiased variance of the losses and of the projections onto the update
direction s / tau = -g / ||g|| at both of its steps: at step t those are the g_n . g already
computed, at t + 1 the projections onto the previous step's mean gradient (its factors kept for
Linear layers without shared axes, a copy of it for every other parameter); the 3 x 3 weighted
least-squares fit itself is a few microseconds of scalars and is left out; GradHist1d, the
counts of all N * D per-sample gradient elements g_n = N b_n into its bins (100 on [-2, 2]):
every b_n a kernel above materialises is counted where it is made, a Linear weight without
shared axes is counted from its factors (d_n, x_n) without forming d_n x_n^T, and a parameter
whose norms and projections need no b_n (Gram forms) materialises it in chunks for the count
alone. The counting is the cheapest exact one measured on this machine, the numba kernels of
:class:`avionics.quantities.binning.Tally1d`, one tally a step (its private counters zeroed and
collected once, not per layer; 2M float32 values, one thread: 4.3 ms, against
15 ms for ``clamp_`` + ``long`` + ``bincount`` in float64 and 13 ms for ``histc``, which
drops values out of range instead of clamping them). All values are read with one host
transfer per step.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from avionics.persample.request import OuterProducts
from avionics.persample.rules.conv import sample_group_gradients
from avionics.quantities.binning import Tally1d
from benchmarks.floor_capture import ROOT_USES, Call, Capture, Conv1D
from benchmarks.tools import Plain

# the most per-sample gradient values a multi-use parameter materialises at once
CHUNK = 2**22
# GradHist1d's defaults: its bins over [lo, hi]
HISTOGRAM_BINS, HISTOGRAM_RANGE = 100, (-2.0, 2.0)


@dataclass
class Direction:
    """A direction v to project the b_n of one parameter on: dense, or, for a Linear weight
    without shared axes, the factors (x', d') of v = sum_m d'_m x'_m^T (either may be None)."""

    dense: Tensor | None
    factors: tuple[Tensor, Tensor] | None = None


def _shared(x: Tensor, d: Tensor, width_x: int, width_d: int) -> tuple[Tensor, Tensor]:
    """x [N, T, I], d [N, T, O]: the positions a sample shares folded into one axis T."""
    n = x.shape[0]
    return x.reshape(n, -1, width_x), d.reshape(n, -1, width_d)


class _Use:
    """One use of a parameter (``role`` 'weight' or 'bias' of a layer call): b_n's norms,
    projections and materialisation by the layer's cheapest exact kernel. Subclasses give
    ``materialize(lo, hi)``, b_n for samples lo..hi-1, shape [hi - lo, *parameter shape] (a
    Conv2d weight's may come flattened after the output channel)."""

    def __init__(self, call: Call, role: str):
        self.call, self.role, self.module = call, role, call.module

    def statistics(self, norms: bool, directions: list[Direction], visit=None):
        """(||b_n||^2 [N] or None, [b_n . v [N] for v in directions]): by default from b_n
        materialised. ``visit``: None, or called with b_n (materialised for it where the
        statistics need none)."""
        b = self.materialize(0, self.call.x.shape[0]).flatten(1)
        if visit is not None:
            visit(b)
        sq = b.square().sum(1) if norms else None
        return sq, [b @ v.dense.flatten() for v in directions]


class _LinearUse(_Use):
    """Linear: b_n = sum_t d_t x_t^T (weight), sum_t d_t (bias)."""

    def __init__(self, call, role):
        super().__init__(call, role)
        self.o, self.i = self._widths()
        self.x, self.d = _shared(call.x, call.d, self.i, self.o)
        self.n, self.t = self.x.shape[:2]

    def _widths(self) -> tuple[int, int]:
        return self.module.out_features, self.module.in_features

    def materialize(self, lo, hi):
        d = self.d[lo:hi]
        if self.role == "bias":
            return d.sum(1)
        return torch.bmm(d.transpose(1, 2), self.x[lo:hi])

    def statistics(self, norms, directions, visit=None):
        t, o, i = self.t, self.o, self.i
        if self.role == "bias":
            return super().statistics(norms, directions, visit)
        if t == 1:
            x, d = self.x[:, 0], self.d[:, 0]
            if visit is not None:  # (the products d_n x_n^T counted from the factors)
                visit(OuterProducts(d, x))
            sq = d.square().sum(1) * x.square().sum(1) if norms else None
            return sq, [self._project_outer(x, d, v) for v in directions]
        # per sample: materialising costs T O I, the Gram form T^2 (I + O); projections are
        # O I once b_n is materialised, T O I (sum_t d_t^T v x_t) without
        if not norms and visit is None:
            return None, [((self.d @ v.dense) * self.x).sum((1, 2)) for v in directions]
        if directions or visit is not None or o * i <= t * (i + o):
            return super().statistics(norms, directions, visit)
        xx = torch.bmm(self.x, self.x.transpose(1, 2))
        dd = torch.bmm(self.d, self.d.transpose(1, 2))
        return (xx * dd).sum((1, 2)), []

    @staticmethod
    def _project_outer(x, d, v: Direction):
        """b_n . v for b_n = d_n x_n^T: Gram form or d_n^T v x_n, the cheaper by FLOPs."""
        if v.factors is not None:
            x_ref, d_ref = v.factors
            gram = len(x_ref) * (x.shape[1] + d.shape[1])
            if v.dense is None or gram < x.shape[1] * d.shape[1]:
                return ((d @ d_ref.T) * (x @ x_ref.T)).sum(1)
        return ((d @ v.dense) * x).sum(1)


class _Conv1DUse(_LinearUse):
    """Hugging Face Conv1D, y = x W + b with W [I, O]: the Linear kernels of weight W^T, the
    directions transposed to match (b_n materialised in that [O, I] layout: GPT-2 shares no
    Conv1D weight, so no sum over uses needs its own layout)."""

    def _widths(self):
        i, o = self.module.weight.shape
        return o, i

    def statistics(self, norms, directions, visit=None):
        if self.role == "weight":
            directions = [
                Direction(None if v.dense is None else v.dense.T, v.factors) for v in directions
            ]
        return super().statistics(norms, directions, visit)


class _ConvUse(_Use):
    """Conv2d with groups 1, zero padding given as numbers."""

    # per module: the faster way to materialise its per-sample weight gradients, and the
    # kernel its weight's statistics last came from
    methods: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
    chosen: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

    def materialize(self, lo, hi):
        d = self.call.d[lo:hi]
        if self.role == "bias":
            return d.sum((2, 3))
        x = self.call.x[lo:hi]
        method = self.methods.get(self.module) or self._measure(x, d)
        return CONV_KERNELS[method](x, d, self.module)

    def _measure(self, x, d) -> str:
        """The fastest of the kernels that apply to the layer, each timed (after a warm-up)
        the best of 3 times on the step's own tensors."""
        times = {}
        for name, kernel in CONV_KERNELS.items():
            kernel(x, d, self.module)  # warm
            runs = []
            for _ in range(3):
                t0 = time.process_time()
                kernel(x, d, self.module)
                runs.append(time.process_time() - t0)
            times[name] = min(runs)
        self.methods[self.module] = min(times, key=times.get)
        return self.methods[self.module]

    def statistics(self, norms, directions, visit=None):
        m, d = self.module, self.call.d
        o, l_out = d.shape[1], d.shape[2] * d.shape[3]
        k = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
        # per sample: materialising costs O K L, the Gram form L^2 (K + O); a projection
        # sum_l d_l^T v u_l is one ordinary convolution of x by v (O K L too, no buffer); a
        # histogram needs b_n materialised anyway
        if self.role == "bias" or visit is not None or (norms and l_out * (k + o) >= o * k):
            out = super().statistics(norms, directions, visit)
            if self.role == "weight":
                self.chosen[m] = self.methods[m]
            return out
        kernels = ["Gram"] * norms + ["projection by convolution"] * bool(directions)
        self.chosen[m] = " + ".join(kernels)
        projections = [
            (F.conv2d(self.call.x, v.dense, None, m.stride, m.padding, m.dilation) * d).sum(
                (1, 2, 3)
            )
            for v in directions
        ]
        if not norms:
            return None, projections
        u = F.unfold(self.call.x, m.kernel_size, m.dilation, m.padding, m.stride)
        d = d.flatten(2)
        gram = torch.bmm(u.transpose(1, 2), u) * torch.bmm(d.transpose(1, 2), d)
        return gram.sum((1, 2)), projections


def _grouped(x: Tensor, d: Tensor, conv: nn.Conv2d) -> Tensor:
    """Per-sample weight gradients [N, O, C, kh, kw] by one grouped convolution: sample n's
    input channels correlated with its O output gradients (groups = N), stride and dilation
    swapped; the output cropped to the kernel size."""
    n, c, o = x.shape[0], x.shape[1], d.shape[1]
    kh, kw = conv.kernel_size
    out = F.conv2d(
        x.transpose(0, 1),
        d.reshape(n * o, 1, *d.shape[2:]),
        stride=conv.dilation,
        padding=conv.padding,
        dilation=conv.stride,
        groups=n,
    )[:, :, :kh, :kw]
    return out.reshape(c, n, o, kh, kw).permute(1, 2, 0, 3, 4)


def _unfolded(x: Tensor, d: Tensor, conv: nn.Conv2d) -> Tensor:
    """Per-sample weight gradients [N, O, C * kh * kw] by unfold + bmm."""
    u = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    return torch.bmm(d.flatten(2), u.transpose(1, 2))


# the kernels materialising a Conv2d weight's b_n [N, O, C, kh, kw] (or [N, O, C kh kw])
CONV_KERNELS = {
    "grouped conv": _grouped,
    "unfold+bmm": _unfolded,
    "samples as groups": lambda x, d, conv: sample_group_gradients(conv, x, d),
}


class _EmbeddingUse(_Use):
    """Embedding: b_n = sum_t e_t onehot(i_t)^T, as [V, W] rows."""

    def __init__(self, call, role):
        super().__init__(call, role)
        n, w = call.x.shape[0], self.module.embedding_dim
        self.i, self.e = call.x.reshape(n, -1), call.d.reshape(n, -1, w)

    def materialize(self, lo, hi):
        i, e = self.i[lo:hi], self.e[lo:hi]
        (n, _, w), v = e.shape, self.module.num_embeddings
        rows = (i + v * torch.arange(n, device=i.device)[:, None]).flatten()
        return e.new_zeros(n * v, w).index_add_(0, rows, e.reshape(-1, w)).view(n, v, w)

    def statistics(self, norms, directions, visit=None):
        projections = [(self.e * v.dense[self.i]).sum((1, 2)) for v in directions]
        if not norms and visit is None:
            return None, projections
        return super().statistics(norms, [], visit)[0], projections


class _LayerNormUse(_Use):
    """LayerNorm: b_n = sum_t d_t * xhat_t (weight), sum_t d_t (bias), xhat the input
    normalised."""

    def materialize(self, lo, hi):
        m, d = self.module, self.call.d[lo:hi]
        n = d.shape[0]
        if self.role == "weight":
            xhat = F.layer_norm(self.call.x[lo:hi], m.normalized_shape, eps=m.eps)
            d = d * xhat
        return d.reshape(n, -1, *m.normalized_shape).sum(1)


class _BatchNormUse(_Use):
    """BatchNorm2d: b_n = sum_l d_l * xhat_l (weight), sum_l d_l (bias) over the positions l,
    xhat = (x - mean) / sqrt(var + eps) by the batch's statistics in training (the running ones
    in evaluation), as the layer normalised it: the weight's b_n = (sum_l d_l (x_l - mean)) /
    sqrt(var + eps), one dot product per sample and channel, xhat not formed (the batch's
    mean, then the biased variance of the centred x: 3-7x faster than torch.var_mean over
    axes (0, 2, 3) and than the layer's own kernel, which writes xhat)."""

    def __init__(self, call, role):
        super().__init__(call, role)
        m, x = self.module, call.x.flatten(2)  # [N, C, L]
        if role != "weight":
            return
        if m.training:
            self.centred = x - x.mean((0, 2), keepdim=True)
            var = torch.linalg.vecdot(self.centred, self.centred).sum(0) / (
                x.shape[0] * x.shape[2]
            )
        else:
            self.centred, var = x - m.running_mean[:, None], m.running_var
        self.scale = (var + m.eps).rsqrt()

    def materialize(self, lo, hi):
        d = self.call.d[lo:hi].flatten(2)
        if self.role == "weight":
            return torch.linalg.vecdot(d, self.centred[lo:hi]) * self.scale
        return d.sum(2)


class _InProjectionUse(_LinearUse):
    """``nn.MultiheadAttention``'s packed in-projection qkv = x W^T + b, W [3E, E]: the
    Linear kernels (b_n = sum_t d_t x_t^T over the T positions of a sample)."""

    def _widths(self):
        return tuple(self.module.in_proj_weight.shape)


class _RecurrentUse(_LinearUse):
    """A layer of nn.RNN / LSTM / GRU (:mod:`benchmarks.recurrent_floor`): W_ih (or W_hh) a
    Linear over the T steps of a sample, x the layer's input (h_{t-1}), d its gate gradients."""

    def _widths(self):
        return tuple(self.call.params["weight"].shape)


class _RootUse(_Use):
    """A root parameter (``role``: its name) added to the input h of a child module (see
    :data:`ROOT_USES`): b_n read from the gradient of h, d_n, by the model's own map."""

    def materialize(self, lo, hi):
        name, model = self.role, self.module
        return ROOT_USES[type(model).__name__][1][name](self.call.d[lo:hi], getattr(model, name))


USES = {nn.Linear: _LinearUse, nn.Conv2d: _ConvUse, nn.Embedding: _EmbeddingUse,
        nn.LayerNorm: _LayerNormUse, nn.BatchNorm2d: _BatchNormUse,
        nn.MultiheadAttention: _InProjectionUse, nn.RNNBase: _RecurrentUse}  # fmt: skip
if Conv1D is not None:
    USES[Conv1D] = _Conv1DUse


def _position_tables_per_sample(calls: list[Call]) -> list[Call]:
    """``calls`` with each position table looked up by indices [1, T] that serve every sample
    (GPT-2's and BERT's position embeddings) given per-sample data: its output's gradient is
    summed over the batch, so its b_n read the gradient of the sum it is added to, which the
    token table's output [N, T, W] has too; its indices are expanded to the N samples."""
    tables = [c for c in calls if isinstance(c.module, nn.Embedding)]
    out = []
    for call in calls:
        if isinstance(call.module, nn.Embedding) and call.d.shape[0] == 1:
            shape = call.d.shape[1:]
            token = next((c for c in tables if c.d.shape[0] > 1 and c.d.shape[1:] == shape), None)
            if token is not None:
                call = Call(call.module, call.x.expand(token.d.shape[:-1]), token.d, call.params)
        out.append(call)
    return out


def _uses(calls: list[Call]) -> dict[nn.Parameter, list[_Use]]:
    """Every trainable parameter's uses in the captured calls, in call order."""
    uses: dict[nn.Parameter, list[_Use]] = {}
    for call in _position_tables_per_sample(calls):
        for role, p in call.roles().items():
            if p.requires_grad:
                # (a call of none of USES' layers is a ROOT_USES model's root call)
                kind = next((k for k in USES if isinstance(call.module, k)), None)
                uses.setdefault(p, []).append(
                    (_RootUse if kind is None else USES[kind])(call, role)
                )
    return uses


def parameter_statistics(
    p: nn.Parameter, uses: list[_Use], norms: bool, directions: list[Direction], visit=None
):
    """(||b_n||^2 or None, [b_n . v]) of parameter ``p``: from its single use's kernel, or
    from the sum over its uses materialised in chunks of samples; ``visit`` (None, or called
    with b_n, see :meth:`_Use.statistics`) sees every sample's summed b_n once."""
    if len(uses) == 1:
        return uses[0].statistics(norms, directions, visit)
    n = uses[0].call.x.shape[0]
    step = max(1, CHUNK // p.numel())
    sq, projections = [], [[] for _ in directions]
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        b = sum(use.materialize(lo, hi).flatten(1) for use in uses)
        if visit is not None:
            visit(b)
        sq.append(b.square().sum(1))
        for out, v in zip(projections, directions):
            out.append(b @ v.dense.flatten())
    return (torch.cat(sq) if norms else None), [torch.cat(p) for p in projections]


def gradient_tests(sq_sum: Tensor | None, proj: Tensor | None, g_sq: Tensor, n: int):
    """NormTest, InnerTest, OrthoTest (docs/definitions.md, section 4; the ones the inputs
    allow) from sum_n ||g_n||^2, the [N] projections g_n . g and ||g||^2, in float64."""
    out = {}
    scale = (n - 1) * n * g_sq
    if sq_sum is not None:
        out["NormTest"] = ((sq_sum - n * g_sq) / scale).clamp(min=0).sqrt()
    if proj is not None:
        out["InnerTest"] = ((proj - g_sq).square().sum() / (scale * g_sq)).sqrt()
    if sq_sum is not None and proj is not None:
        out["OrthoTest"] = ((sq_sum - proj.square().sum() / g_sq) / scale).clamp(min=0).sqrt()
    return out


# floor -> (needs the norms, needs the projections onto g, is economy)
KINDS = {
    "NormTest": (True, False, False),
    "InnerTest": (False, True, False),
    "OrthoTest": (True, True, False),
    "three tests": (True, True, False),
    "economy": (True, True, True),
}


class Floor(Plain):
    """A plain SGD step plus the floor ``kind`` (a key of ``KINDS``); ``values[k]`` holds
    step k's values (floats): the gradient tests, and for economy GradNorm, Distance,
    UpdateSize (of the previous step) and Alpha's observations."""

    def __init__(
        self, model, loss_fn, kind: str = "sgd", floor: str = "three tests", batch_axis: int = 0
    ):
        if kind != "sgd":
            raise ValueError(f"Floor needs plain SGD (kind='sgd'), got kind={kind!r}.")
        if floor not in KINDS:
            raise ValueError(f"Unknown floor={floor!r}; choose one of {', '.join(KINDS)}.")
        super().__init__(model, loss_fn, kind)
        self.norms, self.project, self.economy = KINDS[floor]
        self.capture = Capture(model, batch_axis)  # (batch_axis: that of X, see Capture)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.values: dict[int, dict] = {}
        self._previous: dict[nn.Parameter, Direction] = {}
        self._previous_norm: Tensor | None = None
        self._theta0: list[Tensor] | None = None

    def kernels(self) -> dict[str, str]:
        """{convolution's name: the kernel its weight's statistics came from last}."""
        chosen = _ConvUse.chosen
        return {name: chosen[m] for name, m in self.model.named_modules() if m in chosen}

    def step(self, k, X, y) -> None:
        self.opt.zero_grad()
        self.capture.calls = []
        losses = self.loss_fn(self.model(X), y)
        loss = losses.mean()
        loss.backward()
        values = self._statistics(X.shape[self.capture.batch_axis], loss, losses.detach())
        self.capture.calls = []
        self.opt.step()
        self.values[k] = values

    def _statistics(self, n: int, loss: Tensor, losses: Tensor) -> dict:
        uses = _uses(self.capture.calls)
        grads = [p.grad for p in self.params]
        norms = torch._foreach_norm(grads)
        g_sq = torch.stack(norms).double().square().sum()
        sq_sum = torch.zeros((), dtype=torch.float64) if self.norms else None
        proj = torch.zeros(n, dtype=torch.float64) if self.project else None
        previous = torch.zeros(n, dtype=torch.float64)
        tally = Tally1d(HISTOGRAM_BINS, *(limit / n for limit in HISTOGRAM_RANGE))
        visit = tally.add if self.economy else None
        kept = {}
        for p in self.params:
            directions = [_mean_direction(p, uses[p])] if self.project else []
            if self.economy and p in self._previous:
                directions.append(self._previous[p])
            sq, projections = parameter_statistics(p, uses[p], self.norms, directions, visit)
            if sq is not None:
                sq_sum += sq.double().sum() * n * n
            if self.project:
                proj += projections[0].double() * n
            if self.economy:
                if p in self._previous:
                    previous += projections[1].double() * n
                kept[p] = _kept_direction(p, uses[p])
        scalars = gradient_tests(sq_sum, proj, g_sq, n)
        if self.economy:
            scalars.update(self._economy(n, loss, losses, norms, g_sq, proj, previous))
            scalars["GradHist1d"] = tally.counts()
            self._previous = kept
        names = list(scalars)
        flat = torch.cat([scalars[q].double().reshape(-1) for q in names]).tolist()
        values, at = {}, 0
        for q in names:
            size = scalars[q].numel()
            values[q] = flat[at] if scalars[q].dim() == 0 else flat[at : at + size]
            at += size
        return values

    def _economy(self, n, loss, losses, norms, g_sq, proj, previous) -> dict:
        """GradNorm, UpdateSize, Distance, Loss, Alpha's observations."""
        if self._theta0 is None:
            self._theta0 = [p.detach().clone() for p in self.params]
        grad_norm = torch.stack(norms)
        moved = torch._foreach_sub([p.detach() for p in self.params], self._theta0)
        distance = torch.stack(torch._foreach_norm(moved))
        lr = self.opt.param_groups[0]["lr"]
        g_norm = g_sq.sqrt()
        # (g_n . s) / tau with s = -lr g: -(g_n . g) / ||g||; at t+1 onto the previous s
        slope = -proj / g_norm
        out = {"Loss": loss.detach(), "GradNorm": grad_norm, "UpdateSize": lr * grad_norm,
               "Distance": distance, "losses_var": losses.var(), "df0": slope.mean(),
               "df0_var": slope.var()}  # fmt: skip
        if self._previous:
            end = -previous / self._previous_norm
            out.update(df1=end.mean(), df1_var=end.var())
        self._previous_norm = g_norm
        return out


def _mean_direction(p: nn.Parameter, uses: list[_Use]) -> Direction:
    """G = p.grad, with its factors where p is the weight of one Linear call without shared
    axes (G = sum_m d_m x_m^T)."""
    return Direction(p.grad, _factors(uses))


def _kept_direction(p: nn.Parameter, uses: list[_Use]) -> Direction:
    """What is kept of this step's mean gradient for the next step's projections: its factors
    where they exist, else a copy of it."""
    factors = _factors(uses)
    return Direction(None if factors else p.grad.detach().clone(), factors)


def _factors(uses: list[_Use]) -> tuple[Tensor, Tensor] | None:
    if len(uses) == 1 and isinstance(uses[0], _LinearUse) and uses[0].role == "weight":
        if uses[0].t == 1:
            return uses[0].x[:, 0], uses[0].d[:, 0]
    return None
