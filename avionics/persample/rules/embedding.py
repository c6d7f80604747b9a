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
        vocab = module.num_embeddings
        sample = torch.arange(n, device=index.device).unsqueeze(1).expand_as(index)
        keys, inverse = _distinct((sample * vocab + index).flatten())
        # rows[u] = the gradient row of (sample, token) pair u, summed over its positions
        self.rows = delta.new_zeros(len(keys), delta.shape[-1]).index_add_(
            0, inverse, delta.flatten(0, 1)
        )
        self.row_sample, self.row_token = keys // vocab, keys % vocab

    def materialize(self, start: int, stop: int) -> list[Tensor]:
        weight = self.module.weight
        out = self.rows.new_zeros(stop - start, *weight.shape)
        # the rows of other samples add zeros to row 0 (no boolean mask: its size would be
        # read on the host)
        local = self.row_sample - start
        keep = (local >= 0) & (local < stop - start)
        rows = self.rows * keep.unsqueeze(1)
        out.index_put_((local * keep, self.row_token), rows, accumulate=True)
        return [out]

    def statistics(self, requests: list[Request], directions) -> list[dict]:
        (request,) = requests
        if request.visitors:
            return super().statistics(requests, directions)
        out: dict = {}
        n, rows = self.n, self.rows
        if request.sq_norms:
            out["sq_norms"] = rows.new_zeros(n).index_add_(
                0, self.row_sample, torch.linalg.vector_norm(rows, dim=1).square()
            )
        if directions[0]:
            out["projections"] = {
                name: rows.new_zeros(n).index_add_(
                    0, self.row_sample, (rows * v[self.row_token]).sum(1)
                )
                for name, v in directions[0].items()
            }
        if request.sum_sq:
            out["sum_sq"] = rows.new_zeros(self.module.weight.shape).index_add_(
                0, self.row_token, rows.pow(2)
            )
        return [out]

    def total(self) -> list[Tensor]:
        total = self.rows.new_zeros(self.module.weight.shape)
        return [total.index_add_(0, self.row_token, self.rows)]


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
