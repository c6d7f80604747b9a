"""The floor's kernel for nn.RNN, nn.LSTM, nn.GRU: the gate gradients of the step's own backward.

Each layer of a recurrent module computes, at every time step t of sample n,

    a_t = W_ih x_t + b_ih,        c_t = W_hh h_{t-1} + b_hh,

and its next state from (a_t, c_t) alone (torch.nn.LSTM / GRU / RNN docs). Its per-sample
gradient contributions (b_n of :mod:`benchmarks.floors`) are the bilinear forms

    b_n(W_ih) = sum_t da_t x_t^T,        b_n(b_ih) = sum_t da_t,
    b_n(W_hh) = sum_t dc_t h_{t-1}^T,    b_n(b_hh) = sum_t dc_t,

with da_t, dc_t the gradients of the mean loss at a_t, c_t: dc = da for an LSTM and an RNN
(their gates read a_t + c_t), and for a GRU, whose candidate gate reads r_t * c_t,
dc = [da_r, da_z, r_t * da_n] with r_t = sigmoid(a_r + c_r). So each weight is a Linear over
the T steps of a sample (the ``_LinearUse`` kernels: ||b_n||^2 by the Gram form
sum_{t,s} (d_t . d_s)(x_t . x_s) or by b_n materialised, the cheaper; projections
sum_t d_t^T v x_t).

The floor needs no re-run of the recurrence: it replaces the module's forward by the same
recurrence, layer by layer, with a = W_ih x + b_ih formed by one ``F.linear`` over all steps
and fed to PyTorch's kernel (``torch._VF``, the fused one of the module) through identity input
weights, so the step's own backward leaves da at a (a tensor hook) and h_{t-1} is read off the
layer's output. A PackedSequence runs through the packed kernel (a sample's steps beyond its
length are not computed), its factors padded to [N, T, .] in the batch's order, zero beyond
each sample's length. Unidirectional layers without projections or inter-layer dropout in
training only.
"""

from __future__ import annotations

import torch
from torch import _VF, Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

KERNELS = {"LSTM": _VF.lstm, "GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}


def recurrent_forward(capture, module: nn.RNNBase):
    """``module``'s forward as the floor runs it (see the module docstring): each layer's
    two calls, (x, da) of W_ih, b_ih and (h_{t-1}, dc) of W_hh, b_hh, recorded in
    ``capture.calls``."""
    if module.bidirectional or module.proj_size or (module.dropout and module.num_layers > 1):
        raise ValueError(
            "The floor's recurrent kernel takes unidirectional layers without proj_size or "
            f"dropout; {type(module).__name__} has bidirectional={module.bidirectional}, "
            f"proj_size={module.proj_size}, dropout={module.dropout}."
        )
    kernel, lstm = KERNELS[module.mode], module.mode == "LSTM"

    def forward(inp, hx=None):
        packed = inp if isinstance(inp, PackedSequence) else None
        x = inp.data if packed is not None else inp
        if packed is None and x.dim() != 3:
            raise ValueError(
                f"The floor's recurrent kernel takes a batch, [N, T, I] or [T, N, I] (or a "
                f"PackedSequence); got an input of shape {tuple(x.shape)}."
            )
        n = int(packed.batch_sizes[0]) if packed else x.shape[0 if module.batch_first else 1]
        h0, c0 = _initial_state(module, hx, x, n, packed)
        finals, cells = [], []
        for layer in range(module.num_layers):
            names = [f"{w}_{s}_l{layer}" for w in ("weight", "bias") for s in ("ih", "hh")]
            w_ih, w_hh, b_ih, b_hh = (getattr(module, name, None) for name in names)
            a = F.linear(x, w_ih, b_ih)
            gates = a.shape[-1]
            eye, zeros = torch.eye(gates, dtype=a.dtype, device=a.device), a.new_zeros(gates)
            params = [eye, w_hh, zeros, zeros if b_hh is None else b_hh]
            state = (
                (h0[layer : layer + 1], c0[layer : layer + 1]) if lstm else h0[layer : layer + 1]
            )
            if packed is None:
                out = kernel(a, state, params, True, 1, 0.0, False, False, module.batch_first)
            else:
                out = kernel(a, packed.batch_sizes, state, params, True, 1, 0.0, False, False)
            previous = _previous(out[0], h0[layer], packed, module.batch_first)
            ih = capture.call(
                module, _per_sample(x, packed, module.batch_first), _roles(w_ih, b_ih)
            )
            hh = capture.call(module, previous, _roles(w_hh, b_hh))
            gru = (a.detach(), w_hh, b_hh) if module.mode == "GRU" else None
            a.register_hook(_gate_gradients(ih, hh, packed, module.batch_first, gru))
            finals.append(out[1])
            cells.append(out[2] if lstm else None)
            x = out[0]
        h_n = _unsorted(torch.cat(finals), packed)
        output = x if packed is None else PackedSequence(x, *packed[1:])
        return output, ((h_n, _unsorted(torch.cat(cells), packed)) if lstm else h_n)

    return forward


def _roles(weight: nn.Parameter, bias: nn.Parameter | None) -> dict[str, nn.Parameter]:
    return {"weight": weight} | ({} if bias is None else {"bias": bias})


def _initial_state(module, hx, x: Tensor, n: int, packed: PackedSequence | None):
    """(h0, c0) [L, N, H] as the kernel takes them (sorted by length for a PackedSequence)."""
    if hx is None:
        zeros = x.new_zeros(module.num_layers, n, module.hidden_size)
        return zeros, zeros
    h0, c0 = hx if module.mode == "LSTM" else (hx, hx)
    if packed is not None and packed.sorted_indices is not None:
        h0, c0 = h0[:, packed.sorted_indices], c0[:, packed.sorted_indices]
    return h0, c0


def _unsorted(h: Tensor, packed: PackedSequence | None) -> Tensor:
    """A final state [L, N, H] back in the batch's order."""
    if packed is None or packed.unsorted_indices is None:
        return h
    return h[:, packed.unsorted_indices]


def _per_sample(t: Tensor, packed: PackedSequence | None, batch_first: bool) -> Tensor:
    """A layer's per-step tensor (packed data, [N, T, F] or [T, N, F]) as [N, T, F] in the
    batch's order, zeros beyond a packed sample's length."""
    t = t.detach()
    if packed is not None:
        return pad_packed_sequence(PackedSequence(t, *packed[1:]), batch_first=True)[0]
    return t if batch_first else t.transpose(0, 1)


def _previous(out: Tensor, h0: Tensor, packed, batch_first: bool) -> Tensor:
    """h_{t-1} of every step, [N, T, H] in the batch's order: h0 at t = 0, else the output of
    step t - 1 (h0 is in the kernel's order, sorted for a PackedSequence)."""
    out = _per_sample(out, packed, batch_first)
    if packed is not None and packed.unsorted_indices is not None:
        h0 = h0[packed.unsorted_indices]
    return torch.cat([h0.detach()[:, None], out[:, :-1]], 1)


def _gate_gradients(ih, hh, packed, batch_first: bool, gru):
    """The hook on a: da [N, T, G] to the W_ih call, dc to the W_hh call (dc = da, or for a
    GRU (``gru``: (a, W_hh, b_hh)) [da_r, da_z, r_t * da_n], r_t = sigmoid(a_r + W_hr
    h_{t-1} + b_hr))."""

    def hook(da: Tensor) -> None:
        ih.d = _per_sample(da, packed, batch_first)
        if gru is None:
            hh.d = ih.d
            return
        a, w_hh, b_hh = gru
        hidden = w_hh.shape[1]
        c_r = F.linear(hh.x, w_hh[:hidden].detach(), None if b_hh is None else b_hh[:hidden])
        r = torch.sigmoid(_per_sample(a, packed, batch_first)[..., :hidden] + c_r.detach())
        hh.d = torch.cat([ih.d[..., : 2 * hidden], r * ih.d[..., 2 * hidden :]], -1)

    return hook
