"""What the floors (:mod:`benchmarks.floors`) record of a step: each parameterised layer
call's input x and the gradient d of the mean loss with respect to its output, by plain module
hooks (:class:`Capture`); the models whose root parameters enter a child's input
(:data:`ROOT_USES`), and the layers the floors have kernels for (:data:`COVERED`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from benchmarks.recurrent_floor import recurrent_forward

try:  # Hugging Face GPT-2's Conv1D (y = x W + b, W [I, O]): a Linear of weight W^T
    from transformers.pytorch_utils import Conv1D
except ImportError:  # (transformers is optional)
    Conv1D = None
LAYERS = (nn.Linear, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.BatchNorm2d) + (
    (Conv1D,) if Conv1D is not None else ()
)

# the modules whose parameters the floor has kernels for
COVERED = LAYERS + (nn.MultiheadAttention, nn.RNNBase)


# the layers whose input may hold the samples on the model's batch axis (time-major [T, N, .])
_SAMPLES_ON_MODEL_AXIS = (nn.Linear, nn.Embedding, nn.LayerNorm)


@dataclass
class Call:
    """One call of a parameterised layer: its input and the gradient of the mean loss with
    respect to its output (set by the output's tensor hook during the backward); ``params``:
    role ('weight', 'bias') -> parameter, the module's own weight and bias by default (an
    attention's in-projection names its packed ones)."""

    module: nn.Module
    x: Tensor
    d: Tensor | None = None
    params: dict[str, nn.Parameter] | None = None

    def roles(self) -> dict[str, nn.Parameter]:
        if self.params is not None:
            return self.params
        roles = {r: getattr(self.module, r, None) for r in ("weight", "bias")}
        return {r: p for r, p in roles.items() if isinstance(p, nn.Parameter)}


class Capture:
    """Forward hooks on every layer of ``LAYERS`` in ``model`` recording its calls; each
    ``nn.MultiheadAttention`` runs the floor's own self-attention (:func:`_self_attention`),
    whose in-projection and out-projection are recorded as Linear calls; the root parameters
    of :data:`ROOT_USES` models are recorded from the gradient of the child's input they are
    added to (:class:`_RootUse`).

    ``batch_axis``: the axis of the model's input that holds the samples (1: a time-major
    model's token ids [T, N]). An Embedding's ids, or a Linear's or LayerNorm's input (its
    last axis its features), with the N samples on that axis (ids [T, N], [T, N, I]) are
    recorded, with their output's gradient, with that axis moved to the front, so that every
    kernel reads sample n at index n of axis 0; one whose batch axis is another (a head's
    [N, W] after the time axis is reduced) is recorded as it is."""

    def __init__(self, model: nn.Module, batch_axis: int = 0):
        roots = ROOT_USES.get(type(model).__name__, (None, {}))
        covered = {
            id(p) for m in model.modules() if isinstance(m, COVERED) for p in m.parameters()
        }
        covered |= {id(getattr(model, name)) for name in roots[1]}
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in covered:
                raise ValueError(
                    f"The floor has no kernel for parameter {name!r} (shape {tuple(p.shape)}): "
                    f"only {', '.join(t.__name__ for t in COVERED)} layers; freeze it or add one."
                )
        for name, m in model.named_modules():
            if isinstance(m, nn.Conv2d) and (
                m.groups != 1 or isinstance(m.padding, str) or m.padding_mode != "zeros"
            ):
                raise ValueError(
                    f"The floor's Conv2d kernels need groups=1 and zero padding given as "
                    f"numbers; {name!r} has groups={m.groups}, padding={m.padding!r}, "
                    f"padding_mode={m.padding_mode!r}."
                )
        self.calls: list[Call] = []
        self.batch_axis, self.n = batch_axis, None  # (n: the last forward's samples)
        if batch_axis != 0:
            model.register_forward_pre_hook(
                lambda m, inputs: setattr(self, "n", inputs[0].shape[batch_axis])
            )
        for module in model.modules():
            if isinstance(module, LAYERS):
                module.register_forward_hook(self._record)
            elif isinstance(module, nn.MultiheadAttention):
                module.forward = _self_attention(self, module)
            elif isinstance(module, nn.RNNBase):
                module.forward = recurrent_forward(self, module)
        if roots[0] is not None:
            child, uses = roots
            params = {name: getattr(model, name) for name in uses}
            model.get_submodule(child).register_forward_pre_hook(
                lambda m, inputs: self.record(model, inputs[0], inputs[0], params)
            )

    def _record(self, module, inputs, output) -> None:
        self.record(module, inputs[0], output)

    def record(self, module, x: Tensor, output: Tensor, params=None) -> None:
        """A call of ``module`` with input x; d is set to the gradient of ``output`` (both
        with the samples moved to axis 0, :meth:`_sample_axis`)."""
        axis = self._sample_axis(module, x)
        call = self.call(module, x.movedim(axis, 0), params)
        output.register_hook(lambda d: setattr(call, "d", d.detach().movedim(axis, 0)))

    def _sample_axis(self, module, x: Tensor) -> int:
        """The axis of ``x`` that holds the samples: the model's batch axis for an
        Embedding's ids, or a Linear's or LayerNorm's input below its feature axis, with the N
        samples there; else 0."""
        axis = self.batch_axis
        if axis == 0 or not isinstance(module, _SAMPLES_ON_MODEL_AXIS):
            return 0
        features = 0 if isinstance(module, nn.Embedding) else 1
        return axis if axis < x.dim() - features and x.shape[axis] == self.n else 0

    def call(self, module, x: Tensor, params=None) -> Call:
        """A new call of ``module`` with input x, its d set by the caller."""
        call = Call(module, x.detach(), params=params)
        self.calls.append(call)
        return call


def _self_attention(capture: Capture, attention: nn.MultiheadAttention):
    """``attention``'s forward for self-attention (query is key is value, batch first, packed
    in-projection, no bias_k or zero attention), as ``F.multi_head_attention_forward`` computes
    it: the in-projection qkv = x W^T + b recorded as a call (its weight and bias
    in_proj_weight, in_proj_bias), ``F.scaled_dot_product_attention`` with the padding mask
    and dropout, and ``out_proj`` called as a module (so recorded as a Linear)."""
    if (
        not (attention.batch_first and attention._qkv_same_embed_dim and attention.bias_k is None)
        or attention.add_zero_attn
    ):
        raise ValueError(
            "The floor's attention kernel needs batch_first, a packed in-projection, no bias_k "
            "and add_zero_attn=False."
        )

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):  # fmt: skip
        if not (query is key is value) or need_weights:
            raise ValueError("The floor's attention takes self-attention with need_weights=False.")
        (n, t, e), h = query.shape, attention.num_heads
        qkv = F.linear(query, attention.in_proj_weight, attention.in_proj_bias)
        roles = {"weight": attention.in_proj_weight, "bias": attention.in_proj_bias}
        capture.record(attention, query, qkv, {r: p for r, p in roles.items() if p is not None})
        q, k, v = qkv.view(n, t, 3, h, e // h).permute(2, 0, 3, 1, 4)
        mask = None
        for m in (attn_mask, key_padding_mask):
            if m is not None and m.dtype == torch.bool:  # True: left out
                m = torch.zeros(m.shape, dtype=q.dtype).masked_fill_(m, -torch.inf)
            if m is not None and m is key_padding_mask:
                m = m[:, None, None, :]
            mask = m if mask is None or m is None else mask + m
        dropout = attention.dropout if attention.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal and mask is None)
        return attention.out_proj(out.transpose(1, 2).reshape(n, t, e)), None

    return forward


def _rows_of(d: Tensor, table: Tensor) -> Tensor:
    """b_n of a position table [C, W] whose first T rows are added to h [N, T, W]."""
    return F.pad(d, (0, 0, 0, table.shape[0] - d.shape[1]))


# model class -> (the child whose input h the root parameters enter, {name: b_n from the
# gradient d of h [N, T, W]}), written out from each model's forward (tests/real_models.py):
# the encoder's h = embed(tokens) + pos[:T], the ViT's h = cat(cls_token, patches) + pos_embed
ROOT_USES = {
    "EncoderClassifier": ("encoder", {"pos": _rows_of}),
    "ViT": (
        "encoder",
        {"cls_token": lambda d, p: d[:, None, :1], "pos_embed": lambda d, p: d[:, None]},
    ),
}
