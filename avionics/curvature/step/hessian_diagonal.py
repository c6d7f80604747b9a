"""The exact Hessian diagonal of the mean loss, ``"diag_h"``: by probes, or equal to the GGN's.

* Shortcut: L = mean_n l(f(x_n; theta)) has Hessian H = G + sum_n sum_i (dl_n/df_i)
  d2 f_i / dtheta2 (G the generalized Gauss-Newton). Where the network is piecewise linear in
  each single weight (Sequential stacks of Linear/Conv/ReLU/pooling/Flatten/Dropout/Identity),
  d2 f_i / dtheta_d2 = 0 almost everywhere, so diag(H) = diag(G): the GGN path
  (:mod:`avionics.curvature.step.ggn_diagonal`) is used. :func:`not_piecewise_linear` names
  the modules that prevent it.
* Otherwise H_dd = e_d^T H e_d, one Hessian-vector product H e_d = d (g . e_d) / d theta per
  parameter entry, through the gradient graph that ``create_graph=True`` kept, batched with
  ``is_grads_batched`` (:func:`hessian_diagonal_by_probes`): D products, affordable for small
  networks only (the instruments refuse above :data:`MAX_PROBES` entries).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from avionics.curvature.step._autograd import batched_grad
from avionics.persample.precision import computing_dtype

MAX_PROBES = 50_000

# Modules through which the output is piecewise linear in each single weight.
PIECEWISE_LINEAR = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ReLU,
    nn.LeakyReLU,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Flatten,
    nn.Identity,
    nn.Dropout,
    nn.ZeroPad2d,
)


def not_piecewise_linear(model: nn.Module) -> list[str]:
    """Names of the modules that keep ``model`` from being piecewise linear in each weight."""
    bad = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            continue
        if isinstance(m, PIECEWISE_LINEAR) and type(m).forward in {
            c.forward for c in PIECEWISE_LINEAR
        }:
            continue
        bad.append(f"'{name or 'the model'}' ({type(m).__name__})")
    return bad


def hessian_diagonal_by_probes(
    graph_grads: list[Tensor], params: list[Tensor], scale: float, chunk: int | None = None
) -> list[Tensor]:
    """diag of the Hessian of scale * (the loss whose graph-carrying gradients are given), by
    one-hot Hessian-vector products batched in chunks."""
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    ref = params[0]
    chunk = chunk or max(1, min(total, 2**23 // max(total, 1), 1024))
    # (a 16-bit model's diagonal kept in float32)
    diag = torch.empty(total, dtype=computing_dtype(ref.dtype), device=ref.device)
    for start in range(0, total, chunk):
        stop = min(total, start + chunk)
        k = stop - start
        E = torch.zeros(k, total, dtype=ref.dtype, device=ref.device)
        # E[i, start + i] = 1, in place on the device (no tensor made from host data)
        E.diagonal(offset=start).fill_(1)
        parts = [
            e.reshape(k, *p.shape) for e, p in zip(E.split(sizes, dim=1), params, strict=True)
        ]
        hv = batched_grad(graph_grads, params, parts)
        flat = torch.cat(
            [
                (h if h is not None else torch.zeros_like(e)).reshape(k, -1)
                for h, e in zip(hv, parts, strict=True)
            ],
            dim=1,
        )
        diag[start:stop] = flat.diagonal(offset=start)
    diag = diag.detach() * scale
    return [d.reshape(p.shape) for d, p in zip(diag.split(sizes), params, strict=True)]
