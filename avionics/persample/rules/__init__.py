"""Per-layer rules of the per-sample engine: which rule handles which module."""

from __future__ import annotations

from torch import nn

from avionics.persample.rules.attention import AttentionRule, covers_attention
from avionics.persample.rules.base import Rule
from avionics.persample.rules.conv import ConvRule
from avionics.persample.rules.embedding import EmbeddingRule
from avionics.persample.rules.generic import GenericRule
from avionics.persample.rules.hf_conv1d import HFConv1DRule, is_hf_conv1d
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
    if all(name in ("weight", "bias") for name in names):
        for cls, rule in CLOSED_FORM_RULES:
            if isinstance(module, cls) and type(module).forward is cls.forward:
                return rule
        if is_hf_conv1d(module):  # matched without importing transformers
            return HFConv1DRule
    return GenericRule


__all__ = ["Rule", "GenericRule", "rule_for"]
