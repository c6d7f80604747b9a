"""nn.RNN, nn.LSTM, nn.GRU: one batched re-run of the recurrence, then bilinear closed forms.

Each layer and direction of a recurrent module computes, at every time step t,

    a_t = W_ih x_t + b_ih,        c_t = W_hh h_{t-1} + b_hh,

and its next state from (a_t, c_t) alone (PyTorch's gate equations, torch.nn.LSTM / GRU /
RNN docs; a GRU's candidate gate uses r_t * c_t). So for sample n

    grad W_ih = sum_t da_{n,t} x_{n,t}^T,       grad b_ih = sum_t da_{n,t},
    grad W_hh = sum_t dc_{n,t} h_{n,t-1}^T,     grad b_hh = sum_t dc_{n,t},

the bilinear forms of :mod:`avionics.persample.rules.bilinear` (T shared positions). The
gradients da, dc are one vector-Jacobian product of the recurrence rebuilt from torch ops on
the captured input, initial state and output gradients: a loop over time steps, batched over
the samples (no per-sample loop). For a PackedSequence each sample's steps beyond its length
leave its state unchanged, which is what the packed kernel computes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from avionics.persample.precision import computing
from avionics.persample.rules.base import Rule, output_gradient
from avionics.persample.rules.bilinear import Bilinear, FactoredWeights

# The recurrent modules whose own forward the rule re-runs (subclasses may change it).
RECURRENT = (nn.RNN, nn.LSTM, nn.GRU)


def reproducible(module: nn.RNNBase) -> bool:
    """Whether the re-run reproduces the module's forward: no LSTM projection, and no dropout
    between layers in train mode (its masks cannot be drawn again)."""
    dropout = module.training and module.dropout > 0 and module.num_layers > 1
    return module.proj_size == 0 and not dropout


class RecurrentRule(FactoredWeights, Rule):
    def __init__(self, module: nn.RNNBase, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        # factors[name]: (x [N, 1, T, I], delta [N, 1, T, O]) over the calls, T concatenated
        factors: dict[str, list[tuple[Tensor, Tensor]]] = {}
        with torch.enable_grad():
            for call in calls:
                for name, pair in _call_factors(module, call, n).items():
                    factors.setdefault(name, []).append(pair)
        self.factors = {
            name: (
                torch.cat([x for x, _ in pairs], 2),
                torch.cat([d for _, d in pairs], 2) * output_gradient_factor,
            )
            for name, pairs in factors.items()
        }

    def _weight_form(self, name: str) -> Bilinear:
        x, delta = self.factors[name]
        return Bilinear(
            lambda start, stop: x[start:stop], delta, self.module.get_parameter(name).shape
        )

    def _bias(self, name: str) -> Tensor:
        return self.factors["weight" + name[len("bias") :]][1].sum((1, 2))

    @staticmethod
    def is_weight(name: str) -> bool:
        return name.startswith("weight")


def _call_factors(module: nn.RNNBase, call, n: int) -> dict[str, tuple[Tensor, Tensor]]:
    """(x, delta) of every weight of ``module`` for one call, each [N, 1, T, features]."""
    x, packed = _time_major_input(module, call)
    steps, is_lstm = x.shape[0], module.mode == "LSTM"
    lengths = None if packed is None else _lengths(packed).to(x.device)
    # valid[t, n]: step t is within sample n's sequence (a packed sample stops at its length)
    valid = None if lengths is None else torch.arange(steps, device=x.device)[:, None] < lengths
    h0, c0 = _initial_state(module, call, x, n)
    directions = 2 if module.bidirectional else 1
    # An LSTM's and an RNN's step reads a_t and c_t only through a_t + c_t, so dc_t = da_t:
    # only a is tapped. A GRU's candidate gate reads r_t * c_t: its c_t are tapped too.
    fused = module.mode != "GRU"

    taps: list[Tensor] = []  # the tensors whose gradients are da and dc
    # weight -> (its input, its tap [T, N, F] or one tap per step [N, F] (a GRU's c_t),
    # whether its delta is the taps' reversed in time)
    pairs: dict[str, tuple[Tensor, Tensor | list[Tensor], bool]] = {}
    finals, final_cells, layer_input = [], [], x
    for layer in range(module.num_layers):
        outputs = []
        for direction in range(directions):
            suffix = f"_l{layer}" + ("_reverse" if direction else "")
            w_ih, w_hh, b_ih, b_hh = _weights(module, suffix)
            k = layer * directions + direction
            h, cell = h0[k], c0[k] if is_lstm else None
            a = _tap(F.linear(layer_input, w_ih, b_ih))  # [T, N, G H], all steps at once
            # a_t + c_t = (a_t + b_hh) + h_{t-1} W_hh^T: one addmm a step
            a_b, w_hh_t = (a if b_hh is None or not fused else a + b_hh), w_hh.t()
            out: list[Tensor | None] = [None] * steps
            previous, cs = [], []
            for t in range(steps - 1, -1, -1) if direction else range(steps):
                previous.append(h)
                if fused:
                    h_new, cell_new = _fused_cell(
                        module.mode, torch.addmm(a_b[t], h, w_hh_t), cell
                    )
                else:
                    c = _tap(F.linear(h, w_hh, b_hh))
                    cs.append(c)
                    h_new, cell_new = _gru_cell(a[t], c, h), None
                if valid is not None:
                    h_new = torch.where(valid[t, :, None], h_new, h)
                    if is_lstm:
                        cell_new = torch.where(valid[t, :, None], cell_new, cell)
                h, cell = h_new, cell_new
                out[t] = h
            outputs.append(torch.stack(out))
            finals.append(h)
            final_cells.append(cell)
            taps += [a, *cs]
            pairs[f"weight_ih{suffix}"] = (layer_input.detach(), a, False)
            # h_{t-1} in the order the steps were visited (reversed in time for direction 1)
            hh_taps, reversed_time = (cs, False) if not fused else (a, bool(direction))
            pairs[f"weight_hh{suffix}"] = (torch.stack(previous).detach(), hh_taps, reversed_time)
        layer_input = torch.cat(outputs, -1)

    results = [layer_input, torch.stack(finals)] + ([torch.stack(final_cells)] if is_lstm else [])
    gradients = _output_gradients(module, call, packed, steps, is_lstm)
    grads = torch.autograd.grad(results, taps, gradients, allow_unused=True)
    by_tap = {id(t): torch.zeros_like(t) if g is None else g for t, g in zip(taps, grads)}
    factors = {}
    for name, (inp, weight_taps, reversed_time) in pairs.items():
        # c_t are stacked in the order the steps were visited, like their inputs h_{t-1}
        if isinstance(weight_taps, list):
            delta = torch.stack([by_tap[id(t)] for t in weight_taps])
        else:
            delta = by_tap[id(weight_taps)]
        delta = delta.flip(0) if reversed_time else delta
        factors[name] = (_per_sample(inp), _per_sample(delta))
    return factors


def _per_sample(t: Tensor) -> Tensor:
    """[T, N, F] -> [N, 1 group, T, F]."""
    return t.movedim(1, 0).unsqueeze(1)


def _tap(t: Tensor) -> Tensor:
    """``t`` as a node of the re-run's graph (a fresh leaf where nothing before it needs one)."""
    return t if t.requires_grad else t.requires_grad_()


def _weights(module: nn.RNNBase, suffix: str):
    """W_ih, W_hh, b_ih, b_hh of one layer and direction (biases None without bias)."""
    names = [f"weight_{s}{suffix}" for s in ("ih", "hh")]
    names += [f"bias_{s}{suffix}" for s in ("ih", "hh")] if module.bias else []
    # (in float32 for a 16-bit module, as its captured tensors)
    tensors = [computing(module.get_parameter(name).detach()) for name in names]
    return (*tensors, None, None) if not module.bias else tuple(tensors)


def _time_major_input(module: nn.RNNBase, call) -> tuple[Tensor, PackedSequence | None]:
    """The call's input as [T, N, I] (padded from a PackedSequence, in the batch's order)."""
    inp = call.args[0]
    if isinstance(inp, PackedSequence):
        return pad_packed_sequence(inp)[0].detach(), inp
    if inp.dim() != 3:
        raise NotImplementedError(
            f"the input has shape {tuple(inp.shape)}; per-sample gradients need a batched "
            "input, [N, T, features] (batch_first=True) or [T, N, features]."
        )
    return (inp.transpose(0, 1) if module.batch_first else inp).detach(), None


def _lengths(packed: PackedSequence) -> Tensor:
    """Each sample's length (in the batch's order) from a PackedSequence's batch sizes."""
    sorted_lengths = packed.batch_sizes[None, :] > torch.arange(packed.batch_sizes[0])[:, None]
    lengths = sorted_lengths.sum(1)
    if packed.unsorted_indices is not None:
        lengths = lengths[packed.unsorted_indices.cpu()]
    return lengths


def _initial_state(module: nn.RNNBase, call, x: Tensor, n: int):
    """(h0, c0) as given to the call (zeros where not given), each [layers * directions, N, H],
    in the batch's order (also for a PackedSequence, whose kernel sorts them itself)."""
    hx = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
    directions = 2 if module.bidirectional else 1
    zeros = x.new_zeros(module.num_layers * directions, n, module.hidden_size)
    if hx is None:
        return zeros, zeros
    h0, c0 = hx if module.mode == "LSTM" else (hx, None)
    return h0.detach(), None if c0 is None else c0.detach()


def _output_gradients(module, call, packed, steps: int, is_lstm: bool) -> list[Tensor]:
    """The captured gradients of (output [T, N, D H], h_n[, c_n]), time-major and padded."""
    count = len(call.outputs)
    d_out = output_gradient(call, 0)
    if packed is not None:
        d_out = pad_packed_sequence(
            PackedSequence(
                d_out, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices
            ),
            total_length=steps,
        )[0]
    elif module.batch_first:
        d_out = d_out.transpose(0, 1)
    states = [count - 2, count - 1] if is_lstm else [count - 1]
    return [d_out] + [output_gradient(call, i) for i in states]


def _fused_cell(mode: str, gates: Tensor, cell: Tensor | None):
    """One step of PyTorch's LSTM or RNN (torch.nn.LSTM / RNN docs) from gates = a + c and the
    cell (LSTM): (h', cell'); an LSTM's gate nonlinearities in one sigmoid of all 4H gates
    (the cell gate's sigmoid unused) and one tanh."""
    if mode == "LSTM":
        i, f, _, o = torch.sigmoid(gates).chunk(4, -1)
        g = torch.tanh(gates.chunk(4, -1)[2])
        new_cell = torch.addcmul(f * cell, i, g)
        return o * torch.tanh(new_cell), new_cell
    return (torch.tanh if mode == "RNN_TANH" else torch.relu)(gates), None


def _gru_cell(a: Tensor, c: Tensor, h: Tensor) -> Tensor:
    """One step of PyTorch's GRU (torch.nn.GRU docs) from the state h, a = W_ih x + b_ih and
    c = W_hh h + b_hh: h' (the reset and update gates in one sigmoid)."""
    hidden = h.shape[-1]
    r, z = torch.sigmoid(a[..., : 2 * hidden] + c[..., : 2 * hidden]).chunk(2, -1)
    return torch.lerp(torch.tanh(a[..., 2 * hidden :] + r * c[..., 2 * hidden :]), h, z)
