"""nn.Embedding: y_t = W[i_t].

Per sample n the gradient is sparse: row r of G_n is sum_{t: i_{n,t} = r} delta_{n,t}, and
zero for the padding index. Summing delta over equal (n, r) pairs once gives every non-zero
row of every G_n, so all statistics cost O(N T D) and nothing of size N x V x D is built
unless materialisation is asked for. A table looked up without a batch axis (positions
``arange(T)`` shared by all samples) and added to the batch uses the per-sample gradient of
that addition (:mod:`avionics.persample.rules.broadcast`): row t of G_n is its sample n, t.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from avionics.persample.request import Request
from avionics.persample.rules.base import Rule, batch_first, output_gradient


class EmbeddingRule(Rule):
    def __init__(self, module: nn.Embedding, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        if module.scale_grad_by_freq:
            raise NotImplementedError(
                "nn.Embedding with scale_grad_by_freq=True scales each gradient row by its "
                "frequency in the whole batch, which couples the samples: per-sample "
                "gradients are not defined. Use scale_grad_by_freq=False."
            )
        idx, ds = [], []
        for call in calls:
            i, d = call.args[0], output_gradient(call)
            if not call.carries_batch(n) and call.broadcast_grad_outputs:
                # a table shared by all samples (arange(T)): sample n's rows get the
                # gradient its consumer received for sample n (rules/broadcast.py)
                d = call.broadcast_grad_outputs[0]
                i = i.expand(d.shape[:-1])
            i = batch_first(i, call.batch_axis, n, "Embedding input")
            d = batch_first(d, call.batch_axis, n, "Embedding output")
            idx.append(i.reshape(n, -1))
            ds.append(d.reshape(n, -1, d.shape[-1]))
        index, delta = torch.cat(idx, 1), torch.cat(ds, 1) * output_gradient_factor
        if module.padding_idx is not None:
            delta = delta.masked_fill((index == module.padding_idx).unsqueeze(-1), 0)
        self.index, self.delta = index, delta  # [N, T] token ids, [N, T, D] their gradients
        self._rows: tuple[Tensor, Tensor, Tensor] | None = None

    def _distinct_rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """(rows, row_sample, row_token): rows[u] is the gradient row of the u-th distinct
        (sample, token) pair, summed over its positions (built on first use: materialising
        needs none of it)."""
        if self._rows is None:
            index, delta, vocab = self.index, self.delta, self.module.num_embeddings
            sample = torch.arange(self.n, device=index.device).unsqueeze(1).expand_as(index)
            keys, inverse = _distinct((sample * vocab + index).flatten())
            rows = delta.new_zeros(len(keys), delta.shape[-1]).index_add_(
                0, inverse, delta.flatten(0, 1)
            )
            self._rows = rows, keys // vocab, keys % vocab
        return self._rows

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        """G_n of samples start..stop-1: row i_{n,t} of G_n receives delta_{n,t}, by one
        index_add over the chunk's positions (no distinct rows needed)."""
        (vocab, width), samples = self.module.weight.shape, stop - start
        index, delta = self.index[start:stop], self.delta[start:stop]
        offsets = vocab * torch.arange(samples, device=index.device).unsqueeze(1)
        out = delta.new_zeros(samples * vocab, width)
        out.index_add_(0, (index + offsets).flatten(), delta.reshape(-1, width))
        return [out.view(samples, vocab, width)]

    def statistics(self, requests: list[Request], directions) -> list[dict]:
        (request,) = requests
        if request.visitors or not (request or directions[0]):
            # (nothing asked: a contribution of a tied weight, materialised by the step)
            return super().statistics(requests, directions)
        out: dict = {}
        n, (rows, row_sample, row_token) = self.n, self._distinct_rows()
        if request.sq_norms:
            out["sq_norms"] = rows.new_zeros(n).index_add_(
                0, row_sample, torch.linalg.vector_norm(rows, dim=1).square()
            )
        if directions[0]:
            out["projections"] = {
                name: rows.new_zeros(n).index_add_(0, row_sample, (rows * v[row_token]).sum(1))
                for name, v in directions[0].items()
            }
        if request.sum_sq:
            out["sum_sq"] = rows.new_zeros(self.module.weight.shape).index_add_(
                0, row_token, rows.pow(2)
            )
        return [out]

    def total(self) -> list[Tensor]:
        # sum_n G_n: every position's gradient added to its token's row
        total = self.delta.new_zeros(self.module.weight.shape)
        return [total.index_add_(0, self.index.flatten(), self.delta.flatten(0, 1))]


def _distinct(keys: Tensor) -> tuple[Tensor, Tensor]:
    """(slots, inverse): ``keys[i]`` belongs to slot ``inverse[i]``, equal keys to one slot,
    and ``slots[s]`` is the key of slot s. Like ``torch.unique(keys, return_inverse=True)``
    but with as many slots as keys (those past the distinct ones hold key 0 and receive
    nothing): the output size does not depend on the values, so no host synchronisation reads
    it."""
    ordered, order = keys.sort()
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    slot = first.cumsum(0) - 1  # the slot of each sorted key
    inverse = torch.empty_like(slot).scatter_(0, order, slot)
    slots = torch.zeros_like(keys).scatter_(0, slot, ordered)
    return slots, inverse
