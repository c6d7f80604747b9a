"""Brute-force float64 references of the quantities of docs/definitions.md."""

from __future__ import annotations

import torch
from models import per_sample_gradients


def flat(per_param: list[torch.Tensor]) -> torch.Tensor:
    """[N, D] from a list of per-parameter [N, *shape] tensors."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in per_param], 1)


def gradient_quantities(model, X, y, loss_fn) -> dict[str, float]:
    """Every single-step per-sample quantity by its definition, from a loop over samples."""
    G = flat(per_sample_gradients(model, X, y, loss_fn))  # g_n, [N, D]
    n = G.shape[0]
    g = G.mean(0)
    g_sq = g @ g
    proj = G @ g
    out = {
        "NormTest": ((G - g).pow(2).sum() / ((n - 1) * n * g_sq)).sqrt(),
        "InnerTest": ((proj - g_sq).pow(2).sum() / ((n - 1) * n * g_sq**2)).sqrt(),
        "OrthoTest": ((G - (proj / g_sq)[:, None] * g).pow(2).sum() / ((n - 1) * n * g_sq)).sqrt(),
    }
    m2 = G.pow(2).mean(0)
    out["MeanGSNR"] = (g**2 / (m2 - g**2 + 1e-5)).mean()
    var_unbiased = G.var(0, correction=1)
    out["EarlyStopping"] = 1 - n * (g**2 / (var_unbiased + 1e-5)).mean()
    out["_variance_sum"] = (m2 - g**2).sum()
    return {k: float(v) for k, v in out.items()}
