"""nn.RNN, nn.LSTM, nn.GRU: one batched re-run of the recurrence, then bilinear closed forms.

Each layer and direction of a recurrent module computes, at every time step t,

    a_t = W_ih x_t + b_ih,        c_t = W_hh h_{t-1} + b_hh,

and its next state from (a_t, c_t) alone (PyTorch's gate equations, torch.nn.LSTM / GRU /
RNN docs; a GRU's candidate gate uses r_t * c_t). So for sample n

    grad W_ih = sum_t da_{n,t} x_{n,t}^T,       grad b_ih = sum_t da_{n,t},
    grad W_hh = sum_t dc_{n,t} h_{n,t-1}^T,     grad b_hh = sum_t dc_{n,t},

the bilinear forms of :mod:`avionics.persample.rules.bilinear` (T shared positions). The
gradients da, dc are one vector-Jacobian product of the recurrence re-run on the captured
input, initial state and output gradients, batched over the samples (no per-sample loop)
(:class:`ReRun`): PyTorch's kernel fed a through identity input weights, then for an LSTM on
the CPU (fused kernel) autograd's backward, else the backward of its linearised steps
(:class:`_Linearised`). For a PackedSequence each sample's steps beyond its
length leave its state unchanged, which is what the packed kernel computes.
The GGN diagonal's columns go back through one re-run a group at a time
(:class:`RecurrentColumnSums`).
"""

from __future__ import annotations

import functools

import torch
from torch import _VF, Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from avionics.persample.precision import computing
from avionics.persample.rules.base import (
    GroupedColumnSums,
    Rule,
    concatenate,
    output_gradient,
)
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
        # factors[name]: (x [N, 1, T, I], delta [N, 1, T, O]) over the calls, T concatenated;
        # delta scaled through the output gradients (it is linear in them, and they are fewer)
        factors: dict[str, list[tuple[Tensor, Tensor]]] = {}
        for call in calls:
            rerun = ReRun(module, call, n)
            grads = [g * output_gradient_factor for g in output_gradients(module, call)]
            for name, (x, delta) in rerun.factors([grads]).items():
                factors.setdefault(name, []).append((_per_sample(x), _per_sample(delta[0])))
        self.factors = {
            name: (concatenate([x for x, _ in pairs], 2), concatenate([d for _, d in pairs], 2))
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

    @classmethod
    def column_sums(cls, module, calls, names, n, traces):
        """A group of columns through one re-run of each call (:class:`RecurrentColumnSums`)."""
        return RecurrentColumnSums(module, calls, names, n, traces)


class ReRun:
    """One call's recurrence re-run on its captured input and initial state, batched over the
    samples; the gradients of K columns at once by ``copies = K`` copies of the batch (sample
    n of copy j at n + j N). Each layer runs PyTorch's kernel (``torch._VF``) fed
    a = W_ih x + b_ih through identity input weights; the backward two ways, by
    :func:`by_kernel`:

    * autograd (the fused LSTM kernel on the CPU, whose backward is one node): the kernel's
      graph kept, so that the gradient at its input is da (one ``autograd.grad``);
    * else the kernel without a graph (its forward a C++ loop over the steps, not a Python
      one), each layer and direction's steps linearised (:class:`_Linearised`), whose backward
      is one batched product per step (autograd's backward of the loop took a dozen nodes per
      step).

    For the W_hh factors, h_{t-1} of every step is read off the layer's output (h0 where the
    step is a sample's first in its direction), and dc = da for an LSTM and an RNN (their
    gates read a_t + c_t); a GRU's candidate gate reads r_t * c_t, so there
    dc = [da_r, da_z, r_t * da_n] with r_t = sigmoid(a_r + c_r) of its linearisation.
    """

    def __init__(self, module: nn.RNNBase, call, n: int, copies: int = 1):
        self.module = module
        x, self.packed = _time_major_input(module, call)
        self.steps, self.copies = x.shape[0], copies
        lengths = None if self.packed is None else _lengths(self.packed)
        h0, c0 = _initial_state(module, call, x, n)
        if copies > 1:
            x, h0 = x.repeat(1, copies, 1), h0.repeat(1, copies, 1)
            c0 = None if c0 is None else c0.repeat(1, copies, 1)
            lengths = None if lengths is None else lengths.repeat(copies)
        self.lengths = lengths
        directions = 2 if module.bidirectional else 1
        # valid[t, n]: step t is within sample n's sequence
        valid = None
        if lengths is not None:
            valid = torch.arange(self.steps, device=x.device)[:, None] < lengths.to(x.device)
        self.valid = valid
        kernel = by_kernel(module, x)
        # the kernel's re-run: its graph, from the outputs back to a of every layer and
        # direction (the taps, [T, N, G H]); the linearised one's: each layer and direction's
        # steps linearised, and W_ih
        self.results: list[Tensor] = []
        self.taps: list[Tensor] = []
        self.linearised: list[_Linearised] = []
        self.input_weights: list[Tensor] = []
        # weight -> (its input [T, N, I], the index of its layer and direction, the layer's
        # GRU r_t or None)
        self.pairs: dict[str, tuple[Tensor, int, Tensor | None]] = {}
        finals, final_cells, layer_input, hidden = [], [], x, module.hidden_size
        with torch.enable_grad() if kernel else torch.no_grad():
            for layer in range(module.num_layers):
                ks = [layer * directions + d for d in range(directions)]
                weights = [_weights(module, _suffix(layer, d)) for d in range(directions)]
                a = [F.linear(layer_input, w_ih, b_ih) for w_ih, _, b_ih, _ in weights]
                a = [_tap(t) for t in a] if kernel else a
                rows = slice(ks[0], ks[-1] + 1)
                state = (h0[rows], None if c0 is None else c0[rows])
                out, h_n, c_n = self._kernel(a, [(w, b) for _, w, _, b in weights], state)
                finals.append(h_n)
                final_cells.append(c_n)
                for d, k in enumerate(ks):
                    suffix, (w_ih, w_hh, _, b_hh) = _suffix(layer, d), weights[d]
                    previous = _previous(out[..., d * hidden : (d + 1) * hidden], h0[k], d, valid)
                    previous, r = previous.detach(), None
                    if kernel:
                        self.taps.append(a[d])
                    else:
                        cell = None if c0 is None else c0[k]
                        steps = _Linearised(module.mode, a[d], previous, (w_hh, b_hh), cell,
                                            valid, d)  # fmt: skip
                        self.linearised.append(steps)
                        self.input_weights.append(w_ih)
                        r = steps.r
                    index = len(self.taps) + len(self.linearised) - 1
                    self.pairs[f"weight_ih{suffix}"] = (layer_input.detach(), index, None)
                    self.pairs[f"weight_hh{suffix}"] = (previous, index, r)
                layer_input = out
            if kernel:
                self.results = [layer_input, torch.cat(finals)]
                if module.mode == "LSTM":
                    self.results.append(torch.cat(final_cells))

    def _kernel(self, a: list[Tensor], recurrent: list[tuple[Tensor, Tensor | None]], state):
        """One layer (both directions) by PyTorch's kernel on input cat(a): (output
        [T, N, D H] padded, h_n [D, N, H], c_n or None), in the batch's order."""
        module, h0, c0 = self.module, *state
        width = a[0].shape[-1]
        directions = len(a)
        params = []
        for d, (w_hh, b_hh) in enumerate(recurrent):
            w_ih, zero = _identity_input(width, directions, d, a[0])
            params += [w_ih, w_hh, zero, zero if b_hh is None else b_hh]
        inp = a[0] if directions == 1 else torch.cat(a, -1)
        kernel = _KERNELS[module.mode]
        bidirectional = directions == 2
        if self.packed is None:
            hx = (h0, c0) if module.mode == "LSTM" else h0
            result = kernel(inp, hx, params, True, 1, 0.0, False, bidirectional, False)
            out, hidden = result[0], result[1:]
        else:
            packed = pack_padded_sequence(inp, self.lengths.cpu(), enforce_sorted=False)
            order, back = packed.sorted_indices, packed.unsorted_indices
            hx = (h0[:, order], c0[:, order]) if module.mode == "LSTM" else h0[:, order]
            result = kernel(
                packed.data, packed.batch_sizes, hx, params, True, 1, 0.0, False, bidirectional
            )
            out = pad_packed_sequence(
                PackedSequence(result[0], packed.batch_sizes, order, back),
                total_length=self.steps,
            )[0]
            hidden = [h[:, back] for h in result[1:]]
        c_n = hidden[1] if module.mode == "LSTM" else None
        return out, hidden[0], c_n

    def factors(self, columns: list[list[Tensor]]) -> dict[str, tuple[Tensor, Tensor]]:
        """(x [T, N, I], delta [K, T, N, O]) of every weight for K = len(``columns``) output
        gradients (each as :func:`output_gradients` gives them), copy j of the batch taking
        column j."""
        k, copies = len(columns), self.copies
        if k != copies:
            raise ValueError(f"a re-run of {copies} copies takes {copies} columns, not {k}")
        grads = [torch.cat(g, 1) for g in zip(*columns, strict=True)] if k > 1 else columns[0]
        if self.linearised:
            by_tap = self._backward(grads)
        else:
            # (the graph kept: the column sums take every group of K columns through one re-run)
            found = torch.autograd.grad(
                self.results, self.taps, grads, retain_graph=True, allow_unused=True
            )
            by_tap = [torch.zeros_like(t) if g is None else g for t, g in zip(self.taps, found)]
        n = by_tap[0].shape[1] // k
        factors = {}
        for name, (inp, tap, r) in self.pairs.items():
            delta = by_tap[tap]
            if r is not None:  # (a GRU's W_hh: dc_n = r_t * da_n)
                hidden = r.shape[-1]
                delta = torch.cat([delta[..., : 2 * hidden], r * delta[..., 2 * hidden :]], -1)
            factors[name] = (inp[:, :n], delta.unflatten(1, (k, n)).movedim(1, 0))
        return factors

    def _backward(self, grads: list[Tensor]) -> list[Tensor]:
        """da of every tap from the gradients of (output, h_n[, c_n]) by the linearised steps,
        the top layer first: a layer's output gradient is the one given (the top layer) or
        sum_d da_d W_ih,d of the layer above, each direction's final states take theirs."""
        directions, hidden = 2 if self.module.bidirectional else 1, self.module.hidden_size
        d_out, d_h = grads[0], grads[1]
        d_c = grads[2] if len(grads) > 2 else [None] * len(d_h)
        by_tap: list[Tensor] = [None] * len(self.linearised)
        for layer in range(self.module.num_layers - 1, -1, -1):
            d_input = None
            for d in range(directions):
                k = layer * directions + d
                block = d_out[..., d * hidden : (d + 1) * hidden]
                by_tap[k] = self.linearised[k].backward(block, d_h[k], d_c[k])
                if layer:
                    part = by_tap[k] @ self.input_weights[k]
                    d_input = part if d_input is None else d_input + part
            d_out = d_input
        return by_tap


def by_kernel(module: nn.RNNBase, x: Tensor) -> bool:
    """Whether the re-run's backward is autograd's through PyTorch's kernel (else its
    linearised backward): for an LSTM on the CPU, where the kernel is fused (forward and
    backward 1.0-1.5 ms on the LSTM LM, the linearised loop 1.6 ms, measured). A GRU's or an
    RNN's CPU kernel is autograd's loop of torch ops; on a GPU cuDNN wants its weights in one
    flat buffer, and was not measured."""
    return module.mode == "LSTM" and x.device.type == "cpu"


_KERNELS = {"LSTM": _VF.lstm, "GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}


def _suffix(layer: int, direction: int) -> str:
    return f"_l{layer}" + ("_reverse" if direction else "")


@functools.lru_cache(maxsize=64)
def _identity_block(width: int, directions: int, direction: int, dtype, device):
    weight = torch.zeros(width, directions * width, dtype=dtype, device=device)
    weight[:, direction * width : (direction + 1) * width] = torch.eye(width, dtype=dtype)
    return weight, torch.zeros(width, dtype=dtype, device=device)


def _identity_input(width: int, directions: int, direction: int, like: Tensor):
    """(W, 0): input weights [width, directions * width] that pass direction ``direction``'s
    block of the kernel's input through, and a zero bias, in ``like``'s dtype and device
    (kept: they depend on the shapes only, and the kernel only reads them)."""
    return _identity_block(width, directions, direction, like.dtype, like.device)


def _previous(out: Tensor, h0: Tensor, direction: int, valid: Tensor | None) -> Tensor:
    """h_{t-1} of every step t in the order of ``direction`` ([T, N, H]): the output of the
    step before (after, for direction 1), h0 at a sample's first step."""
    if direction == 0:
        return torch.cat([h0[None], out[:-1]])
    later = torch.cat([out[1:], h0[None]])
    if valid is None:
        return later
    # (a packed sample's reverse pass starts at its last step: h0 there)
    first = valid & ~torch.cat([valid[1:], torch.zeros_like(valid[:1])])
    return torch.where(first[..., None], h0, later)


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


def output_gradients(module: nn.RNNBase, call) -> list[Tensor]:
    """The call's captured gradients of (output [T, N, D H], h_n[, c_n]), time-major and
    padded (in float32 or better)."""
    count, packed = len(call.outputs), call.args[0]
    d_out = output_gradient(call, 0)
    if isinstance(packed, PackedSequence):
        steps = len(packed.batch_sizes)
        d_out = pad_packed_sequence(
            PackedSequence(
                d_out, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices
            ),
            total_length=steps,
        )[0]
    elif module.batch_first:
        d_out = d_out.transpose(0, 1)
    states = [count - 2, count - 1] if module.mode == "LSTM" else [count - 1]
    return [computing(g) for g in [d_out] + [output_gradient(call, i) for i in states]]


# the bytes of one chunk of per-sample, per-column gradients [c, K, O, I]
CHUNK_BYTES = 2**24


class RecurrentColumnSums(GroupedColumnSums):
    """sum over columns j of sum_n G^j_n^2 (or its sum, with ``traces``) for the parameters
    ``names`` of a recurrent module (:meth:`Rule.column_sums
    <avionics.persample.rules.base.Rule.column_sums>`): G^j_n(W_ih) = sum_t da^j_{n,t}
    x_{n,t}^T, G^j_n(W_hh) = sum_t dc^j_{n,t} h_{n,t-1}^T, the biases sum_t da^j_{n,t} and
    sum_t dc^j_{n,t}, over the calls' steps. A group of K columns goes back through one
    :class:`ReRun` of each call on K copies of the batch (one forward and one backward of
    PyTorch's kernel, not K), then each form is one product [c, K O, T] @ [c, T, I] for a
    chunk of c samples, squared and summed over n and j."""

    def __init__(self, module: nn.RNNBase, calls, names: list[str], n: int, traces: bool):
        super().__init__(calls, names, n, traces)  # (held: per column, per call, its gradients)
        self.module = module
        self.reruns: dict[int, list[ReRun]] = {}  # by the number of copies

    def add(self, grad_outputs: list[list[Tensor | None]]) -> None:
        """One column: ``grad_outputs[c]`` replaces ``calls[c].grad_outputs``."""
        self.hold(
            [
                output_gradients(self.module, call.with_grad_outputs(outs))
                for call, outs in zip(self.calls, grad_outputs, strict=True)
            ]
        )

    def _reruns(self, copies: int) -> list[ReRun]:
        if copies not in self.reruns:
            self.reruns[copies] = [ReRun(self.module, c, self.n, copies) for c in self.calls]
        return self.reruns[copies]

    def _reduce(self) -> None:
        """The pending columns' squared per-sample gradients, added to the totals."""
        k, columns = len(self.pending), list(zip(*self.pending, strict=True))
        self.pending = []
        per_call = [
            rerun.factors(list(call_columns))
            for rerun, call_columns in zip(self._reruns(k), columns, strict=True)
        ]
        for name in self.names:
            weight = "weight" + name[len("bias") :] if name.startswith("bias") else name
            x = torch.cat([f[weight][0] for f in per_call], 0)  # [T, N, I]
            delta = torch.cat([f[weight][1] for f in per_call], 1)  # [K, T, N, O]
            if name.startswith("bias"):
                self._add(name, delta.sum(1).square_().sum((0, 1)))
            else:
                self._add(name, _weight_squares(x, delta))


def _weight_squares(x: Tensor, delta: Tensor) -> Tensor:
    """sum_n sum_j G_{n,j}^2, G_{n,j} = sum_t delta_{j,t,n} x_{t,n}^T: a chunk of c samples
    at a time, one product [c, K O, T] @ [c, T, I] -> [c, K, O, I]."""
    k, t, n, o = delta.shape
    step = max(1, CHUNK_BYTES // (k * o * x.shape[-1] * delta.element_size()))
    total = None
    for start in range(0, n, step):
        d = delta[:, :, start : start + step].permute(2, 0, 3, 1).reshape(-1, k * o, t)
        g = torch.bmm(d, x[:, start : start + step].movedim(1, 0))
        s = g.square_().sum(0).unflatten(0, (k, o)).sum(0)
        total = s if total is None else total.add_(s)
    return total


class _Linearised:
    """One layer and direction's steps as the linear map of its backward. The gradient state
    s (dh, and for an LSTM dh and the cell's dc) goes back one step by one product with a
    per-sample matrix M_t, and da_t is read off the state s'_t after step t (s plus the
    output's gradient dout_t):

        s'_t = s_t + [dout_t, 0],    s_{t-1} = s'_t M_t,    da_t = s'_t R_t (a few products),

    M_t and R_t the local derivatives of the gate equations (torch.nn docs) formed for all
    steps at once from a_t and the states h_{t-1} the forward passed through, with
    c_t = W_hh h_{t-1} + b_hh and W_k the rows of W_hh of gate k:

    * RNN, h' = act(a + c): da = dh' E, E = 1 - h'^2 (tanh) or [h' > 0] (relu);
      M = diag(E) W_hh.
    * GRU, h' = (1 - z) n + z h, n = tanh(a_n + r c_n), r and z sigmoids of a + c:
      A = (1 - z)(1 - n^2), da = dh' [A c_n r (1 - r), (h - n) z (1 - z), A] = dh' E per block,
      dc = dh' D with D = [E_r, E_z, r A]; M = diag(z) + sum_k diag(D_k) W_k.
    * LSTM, c' = f c + i g, h' = o tanh(c') (the cells by a loop of one product per step
      from c0): dc_tot = dc + dh' P, P = o (1 - tanh^2 c'); da = [dc_tot K_i, dc_tot K_f,
      dc_tot K_g, dh' K_o], K = [g i (1 - i), c f (1 - f), i (1 - g^2), tanh(c') o (1 - o)];
      dc_{t-1} = dc_tot f and dh_{t-1} = da W_hh, so with Q = sum_{k in i,f,g} diag(K_k) W_k
      M = [[diag(P) Q + diag(K_o) W_o, diag(P f)], [Q, diag(f)]] (rows dh', dc; columns
      dh_{t-1}, dc_{t-1}).

    A step beyond a packed sample's length leaves its state as it was: there M = I and
    da = 0 (E, D, K, P = 0, z, f = 1). ``r``: a GRU's r_t [T, N, H] (else None)."""

    def __init__(self, mode: str, a: Tensor, previous: Tensor, recurrent, c0, valid, direction):
        self.mode, w_hh = mode, recurrent[0]
        steps, hidden = a.shape[0], previous.shape[-1]
        self.order = range(steps - 1, -1, -1) if direction else range(steps)
        # (0-dim tensors: an operation with a Python number costs several times more here)
        one, zero = a.new_ones(()), a.new_zeros(())
        keep = None if valid is None else valid[..., None]

        def masked(t: Tensor, outside: Tensor) -> Tensor:
            if keep is None:
                return t
            return torch.where(keep[..., None] if t.dim() == 4 else keep, t, outside)

        c = F.linear(previous, *recurrent)
        blocks = w_hh.view(-1, hidden, hidden)  # W_k, [gates, H (gate), H (state)]
        self.r = None
        if mode == "LSTM":
            i, f, g, o = (a + c).chunk(4, -1)
            i, f, o, g = torch.sigmoid(i), torch.sigmoid(f), torch.sigmoid(o), torch.tanh(g)
            f, ig = masked(f, one), masked(i * g, zero)  # (a held step: c' = c)
            cells, cell = [None] * steps, c0
            for t in self.order:
                cells[t], cell = cell, torch.addcmul(ig[t], f[t], cell)
            cell = torch.stack(cells)
            squashed = torch.tanh(torch.addcmul(ig, f, cell))
            k = torch.stack(
                [g * i * (one - i), cell * f * (one - f), i * (one - g * g),
                 squashed * o * (one - o)], -2,
            )  # fmt: skip
            self.k, self.p = masked(k, zero), masked(o * (one - squashed * squashed), zero)
            q = torch.einsum("tnkh,khs->tnhs", self.k[..., :3, :], blocks[:3])
            dh_dh = self.p[..., None] * q + self.k[..., 3, :, None] * blocks[3]
            if keep is not None:  # (a held step passes dh through)
                dh_dh = dh_dh + _held(keep, o)
            top = torch.cat([dh_dh, torch.diag_embed(self.p * f)], -1)
            self.m = torch.cat([top, torch.cat([q, torch.diag_embed(f)], -1)], -2)
            return
        if mode == "GRU":
            self.r, z = torch.sigmoid(a[..., : 2 * hidden] + c[..., : 2 * hidden]).chunk(2, -1)
            r, c_n = self.r, c[..., 2 * hidden :]
            n = torch.tanh(torch.addcmul(a[..., 2 * hidden :], r, c_n))
            gate_n = (one - z) * (one - n * n)
            e_r = gate_n * c_n * r * (one - r)
            e = masked(torch.stack([e_r, (previous - n) * z * (one - z), gate_n], -2), zero)
            d = torch.stack([e[..., 0, :], e[..., 1, :], r * e[..., 2, :]], -2)
            through = torch.diag_embed(masked(z, one))
        else:
            h = (torch.tanh if mode == "RNN_TANH" else torch.relu)(a + c)
            e = masked(
                (one - h * h if mode == "RNN_TANH" else (h > 0).to(h.dtype))[..., None, :], zero
            )
            d = e
            through = None if keep is None else _held(keep, h)
        m = torch.einsum("tnkh,khs->tnhs", d, blocks)
        self.e, self.m = e, m if through is None else m + through

    def backward(self, d_out: Tensor, d_h: Tensor, d_c: Tensor | None) -> Tensor:
        """da [T, N, G H] from the gradients of the outputs [T, N, H] and of the final state
        (and cell)."""
        lstm = self.mode == "LSTM"
        if lstm:
            d_out = torch.cat([d_out, torch.zeros_like(d_out)], -1)
            d_h = torch.cat([d_h, torch.zeros_like(d_h) if d_c is None else d_c], -1)
        after: list[Tensor] = [None] * len(self.order)  # s'_t
        state, m, d_out = d_h, self.m.unbind(0), d_out.unbind(0)
        for t in reversed(self.order):
            after[t] = state = state + d_out[t]
            state = torch.bmm(state[:, None], m[t])[:, 0]
        after = torch.stack(after)
        if not lstm:
            return (after[..., None, :] * self.e).flatten(-2)
        dh, dc = after.chunk(2, -1)
        total = torch.addcmul(dc, dh, self.p)
        return (torch.stack([total, total, total, dh], -2) * self.k).flatten(-2)


def _held(keep: Tensor, like: Tensor) -> Tensor:
    """diag(1 at the steps beyond a packed sample's length) [T, N, H, H]: its state held."""
    return torch.diag_embed((~keep).to(like.dtype).expand_as(like))
