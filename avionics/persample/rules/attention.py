"""nn.MultiheadAttention: one batched re-run of the attention, then bilinear closed forms.

The module computes (torch.nn.functional.multi_head_attention_forward), per sample and
position t, with the in-projection W = [W_q; W_k; W_v] and its bias b,

    q_t = W_q x^q_t + b_q,  k_t = W_k x^k_t + b_k,  v_t = W_v x^v_t + b_v,
    o = attention(q, k, v; masks),     y_t = W_o o_t + b_o

(``out_proj`` holds W_o, b_o but its forward is never called). So for sample n

    grad W   = sum_t [dq_t (x^q_t)^T; dk_t (x^k_t)^T; dv_t (x^v_t)^T],
    grad b   = sum_t [dq_t; dk_t; dv_t],
    grad W_o = sum_t delta_t o_t^T,        grad b_o = sum_t delta_t

bilinear forms (:mod:`avionics.persample.rules.bilinear`; the in-projection as 3 groups). o,
dq, dk and dv come from re-running the attention on the captured inputs, batched over the
samples, and one vector-Jacobian product with do = W_o^T delta. The re-run calls the module's
own functional attention with identity projections (exact: x I = x), so masks, scaling and
kernels are the module's, and in train mode it draws the dropout masks again from the random
state the call began with (:mod:`avionics.persample.rules.randomness`). Calls the re-run
cannot reproduce (``add_bias_kv``, ``add_zero_attn``, separate q/k/v weights, queries and
keys of different lengths, attention weights that receive a gradient) take the generic rule.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from avionics.persample.precision import computing
from avionics.persample.rules.base import output_gradient
from avionics.persample.rules.bilinear import Bilinear, FactoredWeights
from avionics.persample.rules.generic import GenericRule
from avionics.persample.rules.randomness import draws_in_forward, replayed

_FORWARD = inspect.signature(nn.MultiheadAttention.forward)


class AttentionRule(FactoredWeights, GenericRule):
    def __init__(self, module: nn.MultiheadAttention, calls, names, n, output_gradient_factor):
        super().__init__(module, calls, names, n, output_gradient_factor)
        self.factors: dict[str, tuple[Tensor, Tensor]] | None = None
        if all(_reproducible(module, call, n) for call in calls):
            with torch.enable_grad():
                per_call = [_call_factors(module, call, n) for call in calls]
            self.factors = {
                name: (
                    torch.cat([f[name][0] for f in per_call], 2),
                    torch.cat([f[name][1] for f in per_call], 2) * output_gradient_factor,
                )
                for name in ("in_proj_weight", "out_proj.weight")
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


def covers_attention(module: nn.Module, names: list[str]) -> bool:
    """Whether ``module`` is an nn.MultiheadAttention running its own forward whose
    parameters the closed form covers (the in-projection of q, k and v together)."""
    return (
        isinstance(module, nn.MultiheadAttention)
        and type(module).forward is nn.MultiheadAttention.forward
        and module._qkv_same_embed_dim
        and module.bias_k is None
        and not module.add_zero_attn
        and set(names) <= {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    )


def _arguments(module: nn.MultiheadAttention, call) -> dict:
    bound = _FORWARD.bind(module, *call.args, **call.kwargs)
    bound.apply_defaults()
    return bound.arguments


def _reproducible(module: nn.MultiheadAttention, call, n: int) -> bool:
    """Whether the re-run gives this call's forward: batched inputs of one shape, dropout
    masks that can be drawn again (the call's random state was kept), and no gradient on the
    attention weights."""
    a = _arguments(module, call)
    inputs = (a["query"], a["key"], a["value"])
    shape = inputs[0].shape
    same = all(isinstance(t, Tensor) and t.dim() == 3 and t.shape == shape for t in inputs)
    weights_used = len(call.grad_outputs) > 1 and call.grad_outputs[1] is not None
    unknown_masks = draws_in_forward(module) and call.rng_state is None
    return same and call.carries_batch(n) and not weights_used and not unknown_masks


def _call_factors(module: nn.MultiheadAttention, call, n: int) -> dict[str, tuple[Tensor, Tensor]]:
    """(x, delta) of the in-projection (3 groups) and of W_o for one call, [N, G, T, features]."""
    a = _arguments(module, call)
    # time-major [T, N, E], as the functional attention takes them
    xs = [a[k].detach() for k in ("query", "key", "value")]
    if module.batch_first:
        xs = [x.transpose(0, 1) for x in xs]
    e = module.embed_dim
    # (a 16-bit module's parameters in float32, as its captured tensors)
    weight, bias = computing(module.in_proj_weight.detach()), module.in_proj_bias
    biases = [None] * 3 if bias is None else computing(bias.detach()).chunk(3)
    q, k, v = (F.linear(x, w, b).requires_grad_() for x, w, b in zip(xs, weight.chunk(3), biases))
    eye = torch.eye(e, dtype=q.dtype, device=q.device)
    with replayed(call.rng_state) if call.rng_state is not None else nullcontext():
        o, _ = F.multi_head_attention_forward(
            q, k, v, e, module.num_heads, None, None, None, None, False, module.dropout,
            eye, None, training=module.training, key_padding_mask=a["key_padding_mask"],
            need_weights=a["need_weights"], attn_mask=a["attn_mask"],
            use_separate_proj_weight=True, q_proj_weight=eye, k_proj_weight=eye,
            v_proj_weight=eye, average_attn_weights=a["average_attn_weights"],
            is_causal=a["is_causal"],
        )  # fmt: skip
    delta = output_gradient(call)  # d loss / d y, y = o W_o^T + b_o
    if module.batch_first:
        delta = delta.transpose(0, 1)
    grads = torch.autograd.grad(o, (q, k, v), delta @ computing(module.out_proj.weight.detach()))

    def per_sample(ts):  # [T, N, F] each -> [N, groups, T, F]
        return torch.stack([t.movedim(1, 0) for t in ts], 1)

    return {
        "in_proj_weight": (per_sample(xs), per_sample(grads)),
        "out_proj.weight": (per_sample([o.detach()]), per_sample([delta])),
    }
