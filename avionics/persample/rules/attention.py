"""nn.MultiheadAttention: the projections' gradients taken inside the user's backward, then
bilinear closed forms.

The module computes (torch.nn.functional.multi_head_attention_forward), per sample and
position t, with the in-projection W = [W_q; W_k; W_v] and its bias b,

    q_t = W_q x^q_t + b_q,  k_t = W_k x^k_t + b_k,  v_t = W_v x^v_t + b_v,
    o = attention(q, k, v; masks),     y_t = W_o o_t + b_o

(``out_proj`` holds W_o, b_o but its forward is never called). So for sample n

    grad W   = sum_t [dq_t (x^q_t)^T; dk_t (x^k_t)^T; dv_t (x^v_t)^T],
    grad b   = sum_t [dq_t; dk_t; dv_t],
    grad W_o = sum_t delta_t o_t^T,        grad b_o = sum_t delta_t

bilinear forms (:mod:`avionics.persample.rules.bilinear`). When the module's output is made
(:func:`inside`), the capture finds in the call's autograd graph the products that consume
W (one for self-attention, where the packed [dq, dk, dv] = d(x W^T + b) makes a single
group of 3E rows; two or three when key or value differ) and the one that consumes W_o,
whose saved input is o; the user's backward then stores the gradients w.r.t. those
products' outputs, which are dq, dk and dv with every mask, dropout draw and kernel as the
forward had them. Where these are missing (the gradients of another backpropagated column,
e.g. a GGN column, replace the captured ones) the rule re-runs the attention on the
captured inputs, batched over the samples, with one vector-Jacobian product with
do = W_o^T delta: the module's own functional attention with identity projections (exact:
x I = x), in train mode drawing the dropout masks again from the random state the call
began with (:mod:`avionics.persample.rules.randomness`). Calls neither path covers
(``add_bias_kv``, ``add_zero_attn``, separate q/k/v weights; for the re-run also queries
and keys of different lengths and attention weights that receive a gradient) take the
generic rule.
"""

from __future__ import annotations

import inspect
from collections import deque
from contextlib import nullcontext

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.hooks import RemovableHandle

from avionics.persample.precision import computing
from avionics.persample.rules.base import concatenate, output_gradient
from avionics.persample.rules.bilinear import Bilinear, FactoredWeights
from avionics.persample.rules.generic import GenericRule
from avionics.persample.rules.randomness import draws_in_forward, replayed

_FORWARD = inspect.signature(nn.MultiheadAttention.forward)
_WEIGHTS = ("in_proj_weight", "out_proj.weight")

# The autograd nodes of a 2-d x W^T (+ b) and the attribute that saves their input x.
_PRODUCTS = {"AddmmBackward0": "_saved_mat1", "MmBackward0": "_saved_self"}
# The nodes between a product and the weight it consumes: W^T, a split into q/k/v rows, casts.
_PASSING = ("TBackward", "TransposeBackward", "ViewBackward", "ToCopyBackward", "SplitBackward")
_PASSING += ("SplitWithSizesBackward", "UnsafeSplitBackward", "AliasBackward")
# The in-projection's pieces' widths in units of E, by their number: [q; k; v] packed, q and
# [k; v], or q, k and v.
_WIDTHS = {1: (3,), 2: (1, 2), 3: (1, 1, 1)}
# The most graph nodes searched for the projections inside one call (else the re-run).
_MAX_NODES = 400


class AttentionRule(FactoredWeights, GenericRule):
    def __init__(self, module: nn.MultiheadAttention, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        self.factors: dict[str, tuple[Tensor | None, Tensor]] | None = None
        if all(_taken_inside(module, call, n) for call in calls):
            per_call = [_inside_factors(module, call) for call in calls]
        elif all(_reproducible(module, call, n) for call in calls):
            with torch.enable_grad():
                per_call = [_call_factors(module, call, n) for call in calls]
        else:
            return
        if len({f["in_proj_weight"][1].shape[1] for f in per_call}) > 1:
            per_call = [
                {**f, "in_proj_weight": _three_groups(*f["in_proj_weight"])} for f in per_call
            ]
        self.factors = {
            name: (
                None
                if per_call[0][name][0] is None
                else concatenate([f[name][0] for f in per_call], 2),
                concatenate([f[name][1] for f in per_call], 2) * output_gradient_factor,
            )
            for name in _WEIGHTS
        }

    def _weight_form(self, name: str) -> Bilinear:
        x, delta = self.factors[name]
        shape = self.module.get_parameter(name).shape
        return Bilinear(lambda start, stop: x[start:stop], delta, shape)

    def _bias(self, name: str) -> Tensor:
        weight = "in_proj_weight" if name == "in_proj_bias" else "out_proj.weight"
        return self.factors[weight][1].sum(2).flatten(1)

    @staticmethod
    def is_weight(name: str) -> bool:
        return name.endswith("weight")

    # AttentionColumnSums, set in attention_columns.py (it builds on this module's re-run)
    column_sums_class: type

    @classmethod
    def column_sums(cls, module, calls, names, n, traces):
        """Where every call can be re-run (:func:`_reproducible`), all columns of a group
        through one re-run and one batched vector-Jacobian product
        (:class:`~avionics.persample.rules.attention_columns.AttentionColumnSums`); else the
        rule on each column."""
        if not (
            covers_attention(module, names) and all(_reproducible(module, c, n) for c in calls)
        ):
            return super().column_sums(module, calls, names, n, traces)
        return cls.column_sums_class(module, calls, names, n, traces)


def _covered(module: nn.Module) -> bool:
    """Whether ``module`` is an nn.MultiheadAttention running its own forward with the packed
    in-projection of q, k and v and no added key/value rows."""
    return (
        isinstance(module, nn.MultiheadAttention)
        and type(module).forward is nn.MultiheadAttention.forward
        and module._qkv_same_embed_dim
        and module.bias_k is None
        and not module.add_zero_attn
    )


def covers_attention(module: nn.Module, names: list[str]) -> bool:
    """Whether ``module`` is an nn.MultiheadAttention running its own forward whose
    parameters the closed form covers (the in-projection of q, k and v together)."""
    return _covered(module) and set(names) <= {
        "in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"
    }  # fmt: skip


class Inside:
    """The projections found inside one call's autograd graph (:func:`inside`).

    ``nodes[i]`` is the product x W_i^T (+ b_i) of the rows ``pieces[i] * E ..`` of the
    in-projection W (piece 0 of width 3E for self-attention; else q, and k and v apart or
    as one of width 2E); ``grads[i]`` receives the gradient w.r.t. its output, [T*N, width]
    in (t, n) order, during the backward; ``o``: the out-projection's input, [T*N, E];
    ``inputs``: the call's query, key and value (as the call's arguments hold them)."""

    def __init__(self, nodes: list, pieces: list[int], o: Tensor | None, inputs: tuple):
        self.nodes, self.pieces, self.o, self.inputs = nodes, pieces, o, inputs
        self.grads: list[Tensor | None] = [None] * len(nodes)

    def hook(self) -> list[RemovableHandle]:
        """Pre-hooks on the products that store their output gradients in ``grads``."""
        grads = self.grads  # (the hooks hold the list, not this object: no cycle via nodes)

        def storer(i: int):
            def prehook(grad_outputs):
                if grad_outputs[0] is not None:
                    grads[i] = grad_outputs[0].detach()

            return prehook

        return [node.register_prehook(storer(i)) for i, node in enumerate(self.nodes)]


def inside(module: nn.Module, args: tuple, kwargs: dict, output) -> Inside | None:
    """For a call of a covered nn.MultiheadAttention, the products of its projections in the
    graph of its output (searched breadth-first from the output, not past the in-projection:
    beyond lie the inputs' graphs); None for other modules, or where they are not all found
    (another torch version's graph, a fused kernel) and the rule re-runs the attention."""
    if not _covered(module) or not isinstance(output, tuple) or output[0].grad_fn is None:
        return None
    q, k, v = _query_key_value(args, kwargs)
    expected = 1 if q is k and k is v else 2 if k is v else 3
    w, wo = module.in_proj_weight, module.out_proj.weight
    found: dict[int, object] = {}
    o = None
    start = output[0].grad_fn
    queue, seen = deque([start]), {start}
    while queue and len(seen) < _MAX_NODES:
        node = queue.popleft()
        saved = _PRODUCTS.get(node.name())
        piece = _piece(node, w) if saved else None
        if piece is not None:
            found[piece] = node
            if len(found) == expected and (o is not None or not wo.requires_grad):
                break
            continue  # (its input edge leads out of the call)
        if saved and o is None and _piece(node, wo) == 0:
            o = getattr(node, saved, None)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    if sorted(found) != list(range(expected)) or (o is None and wo.requires_grad):
        return None
    pieces = sorted(found)
    o = None if o is None else o.detach()
    return Inside([found[p] for p in pieces], pieces, o, (q, k, v))


def _piece(product, weight: Tensor) -> int | None:
    """Which piece of ``weight`` the ``product`` node consumes (the output index of a split
    on the way; 0 for the whole weight), or None where it consumes none of it."""
    for nxt, nr in product.next_functions:
        node, piece = nxt, 0
        for _ in range(4):
            if node is None:
                break
            if getattr(node, "variable", None) is weight:  # its AccumulateGrad
                return piece
            name = node.name()
            if not name.startswith(_PASSING):
                break
            if name.startswith(("Split", "UnsafeSplit")):
                piece = nr
            nexts = [e for e in node.next_functions if e[0] is not None]
            if len(nexts) != 1:
                break
            node, nr = nexts[0]
    return None


def _query_key_value(args: tuple, kwargs: dict) -> tuple:
    """The query, key and value of a call (positional, as layers pass them, or by name)."""
    if len(args) >= 3:
        return args[:3]
    named = dict(zip(("query", "key", "value"), args)) | kwargs
    return named["query"], named["key"], named["value"]


def _arguments(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> dict:
    bound = _FORWARD.bind(module, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _time_major(module: nn.MultiheadAttention, call) -> tuple[dict, list[Tensor]]:
    """The call's arguments, and its query, key and value as [T, N, E]."""
    a = _arguments(module, call.args, call.kwargs)
    xs = [a[k].detach() for k in ("query", "key", "value")]
    if module.batch_first:
        xs = [x.transpose(0, 1) for x in xs]
    return a, xs


def _taken_inside(module: nn.MultiheadAttention, call, n: int) -> bool:
    """Whether the user's backward stored every projection's gradient for this call, shaped
    as its inputs say (batched [T, N, E] query, key and value of this batch)."""
    found = getattr(call, "inside", None)
    if found is None or any(g is None for g in found.grads) or not call.carries_batch(n):
        return False
    inputs = found.inputs
    if not all(isinstance(t, Tensor) and t.dim() == 3 for t in inputs):
        return False
    axis = 0 if module.batch_first else 1
    e = module.embed_dim
    widths = _WIDTHS[len(found.pieces)]  # (in units of E)
    for piece, g in zip(found.pieces, found.grads, strict=True):
        x = inputs[piece]
        if g.numel() != x.shape[0] * x.shape[1] * widths[piece] * e or x.shape[axis] != n:
            return False
    return found.o is None or found.o.numel() == inputs[0].numel()


def _inside_factors(
    module: nn.MultiheadAttention, call
) -> dict[str, tuple[Tensor | None, Tensor]]:
    """(x, delta) of the in-projection and of W_o for one call, [N, groups, T, features],
    from the gradients the backward stored: one group of 3E rows for self-attention, else
    three (q, k, v; zero positions pad the shorter of queries and keys: they add nothing)."""
    found = call.inside
    xs = [computing(x.detach()) for x in found.inputs]
    if module.batch_first:
        xs = [x.transpose(0, 1) for x in xs]
    t, n, e = xs[0].shape
    grads = [computing(g) for g in found.grads]
    if len(grads) == 1:
        in_proj = (_per_sample([xs[0]]), _per_sample([grads[0].reshape(t, n, 3 * e)]))
    else:
        blocks = []
        for piece, g in zip(found.pieces, grads, strict=True):
            blocks += g.reshape(xs[piece].shape[0], n, -1).split(e, -1)
        length = max(x.shape[0] for x in xs)
        pad = [F.pad(b, (0, 0, 0, 0, 0, length - b.shape[0])) for b in (*xs, *blocks)]
        in_proj = (_per_sample(pad[:3]), _per_sample(pad[3:]))
    delta = _time_major_gradient(module, call)
    o = None if found.o is None else _per_sample([computing(found.o).reshape(t, n, e)])
    return {"in_proj_weight": in_proj, "out_proj.weight": (o, _per_sample([delta]))}


def _three_groups(x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """Self-attention's one group of 3E rows as the q, k, v groups of the other calls."""
    if delta.shape[1] == 3:
        return x, delta
    groups = delta.unflatten(-1, (3, -1)).squeeze(1).movedim(2, 1)  # [N, 3, T, E]
    return x.expand(-1, 3, -1, -1), groups


def _time_major_gradient(module: nn.MultiheadAttention, call) -> Tensor:
    """d loss / d y of the call, y = o W_o^T + b_o, as [T, N, E]."""
    delta = output_gradient(call)
    return delta.transpose(0, 1) if module.batch_first else delta


def _per_sample(ts: list[Tensor]) -> Tensor:
    """[T, N, F] each -> [N, groups, T, F] (one group: a view)."""
    if len(ts) == 1:
        return ts[0].movedim(1, 0).unsqueeze(1)
    return torch.stack([t.movedim(1, 0) for t in ts], 1)


def _reproducible(module: nn.MultiheadAttention, call, n: int) -> bool:
    """Whether the re-run gives this call's forward: batched inputs of one shape, dropout
    masks that can be drawn again (the call's random state was kept), and no gradient on the
    attention weights."""
    a = _arguments(module, call.args, call.kwargs)
    inputs = (a["query"], a["key"], a["value"])
    shape = inputs[0].shape
    same = all(isinstance(t, Tensor) and t.dim() == 3 and t.shape == shape for t in inputs)
    weights_used = len(call.grad_outputs) > 1 and call.grad_outputs[1] is not None
    unknown_masks = draws_in_forward(module) and call.rng_state is None
    return same and call.carries_batch(n) and not weights_used and not unknown_masks


def _call_factors(module: nn.MultiheadAttention, call, n: int) -> dict[str, tuple[Tensor, Tensor]]:
    """(x, delta) of the in-projection (3 groups) and of W_o for one call, [N, G, T, features],
    by re-running the attention."""
    a, xs = _time_major(module, call)
    qkv, o = _rerun(module, a, xs, call.rng_state)
    delta = _time_major_gradient(module, call)
    grads = torch.autograd.grad(o, qkv, delta @ computing(module.out_proj.weight.detach()))
    return {
        "in_proj_weight": (_per_sample(xs), _per_sample(grads)),
        "out_proj.weight": (_per_sample([o.detach()]), _per_sample([delta])),
    }


def _rerun(module: nn.MultiheadAttention, a: dict, xs: list[Tensor], rng_state):
    """((q, k, v), o): the call's attention re-run on its [T, N, E] inputs ``xs`` with
    identity projections (exact: x I = x), q, k and v the tensors it is differentiated at; in
    train mode with the dropout masks drawn again from ``rng_state``."""
    e = module.embed_dim
    # (a 16-bit module's parameters in float32, as its captured tensors)
    weight, bias = computing(module.in_proj_weight.detach()), module.in_proj_bias
    biases = [None] * 3 if bias is None else computing(bias.detach()).chunk(3)
    qkv = [F.linear(x, w, b).requires_grad_() for x, w, b in zip(xs, weight.chunk(3), biases)]
    eye = torch.eye(e, dtype=qkv[0].dtype, device=qkv[0].device)
    with replayed(rng_state) if rng_state is not None else nullcontext():
        o, _ = F.multi_head_attention_forward(
            *qkv, e, module.num_heads, None, None, None, None, False, module.dropout,
            eye, None, training=module.training, key_padding_mask=a["key_padding_mask"],
            need_weights=a["need_weights"], attn_mask=a["attn_mask"],
            use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
            v_proj_weight=eye, average_attn_weights=a["average_attn_weights"],
            is_causal=a["is_causal"],
        )  # fmt: skip
    return qkv, o
