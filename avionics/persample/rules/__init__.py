"""Per-layer rules of the per-sample engine: which rule handles which module."""

from __future__ import annotations

import functools

from torch import nn

from avionics.persample.rules.attention import AttentionRule, covers_attention
from avionics.persample.rules.base import Rule
from avionics.persample.rules.conv import ConvRule
from avionics.persample.rules.embedding import EmbeddingRule
from avionics.persample.rules.generic import GenericRule
from avionics.persample.rules.hf_conv1d import HFConv1DRule, is_hf_conv1d_class
from avionics.persample.rules.linear import LinearRule
from avionics.persample.rules.normalization import NormalizationRule
from avionics.persample.rules.recurrent import RECURRENT, RecurrentRule, reproducible

# A closed-form rule applies when the module runs that class's own forward.
CLOSED_FORM_RULES: list[tuple[type[nn.Module], type[Rule]]] = [
    (nn.Linear, LinearRule),
    (nn.Conv1d, ConvRule),
    (nn.Conv2d, ConvRule),
    (nn.Conv3d, ConvRule),
    (nn.Embedding, EmbeddingRule),
    (nn.LayerNorm, NormalizationRule),
    (nn.RMSNorm, NormalizationRule),
    (nn.GroupNorm, NormalizationRule),
    (nn.BatchNorm1d, NormalizationRule),
    (nn.BatchNorm2d, NormalizationRule),
    (nn.BatchNorm3d, NormalizationRule),
]


def rule_for(module: nn.Module, names: list[str]) -> type[Rule]:
    """The rule for the parameters ``names`` of ``module`` (its own or adopted ones)."""
    if type(module) in RECURRENT and reproducible(module):
        return RecurrentRule
    if covers_attention(module, names):
        return AttentionRule
    kind = type(module)
    return _by_type(kind, kind.forward, tuple(names))


@functools.cache
def _by_type(kind: type[nn.Module], forward, names: tuple[str, ...]) -> type[Rule]:
    """The closed-form rule of a module of class ``kind`` (whose forward is ``forward``) for
    ``names``, else the generic one: a function of the class, its forward and its bases, so
    looked up once per (class, forward, names)."""
    if all(name in ("weight", "bias") for name in names):
        for cls, rule in CLOSED_FORM_RULES:
            if issubclass(kind, cls) and kind.forward is cls.forward:
                return rule
        if is_hf_conv1d_class(kind):  # matched without importing transformers
            return HFConv1DRule
    return GenericRule


__all__ = ["Rule", "GenericRule", "rule_for"]
