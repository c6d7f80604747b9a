"""A hand-written floor for the business preset's curvature work on convolutional networks.

The least exact work the curvature quantities of ``configuration("business")`` (TICDiag,
HessTrace, both on the exact GGN diagonal for a softmax cross-entropy) add to a plain step, for
a model whose parameters all belong to nn.Conv2d, nn.BatchNorm2d and nn.Linear layers (the
BasicBlock ResNet of ``tests/real_models.py``), written by hand on its own copy of the model:

* the backward with ``create_graph=True`` (what the protocol asks of the user's backward);
* m2 = mean_n g_n^2 (TICDiag): each layer's per-sample gradients from the backward's output
  gradients (a convolution's by one product per sample on its unfolded input, its forward's
  multiply-adds), squared and summed;
* the GGN diagonal G_dd = (1/N) sum_n sum_j (J_n^T S_n e_j)_d^2 with S_n a rank-(C - 1) root
  of the softmax cross-entropy's Hessian diag(p_n) - p_n p_n^T: K = C - 1 columns, each
  backpropagated from the logits to the layer outputs by one plain backward (the cheapest way
  measured: vmap's batched backward is slower through convolutions, see
  :func:`avionics.curvature.step.ggn_diagonal._batches_well`); then per convolution one
  product [c, K O, T] @ [c, T, I] for all columns of a chunk of samples (K times its
  forward's multiply-adds: the exact work, no cheaper exact form), per BatchNorm the
  per-sample sums of delta_j x_hat and delta_j, per Linear the closed form
  (sum_j delta_j^2)^T x^2.

:class:`GGNFloor` runs such a step; :meth:`GGNFloor.diagonal` is the diagonal it formed (checked
against avionics' in ``tests/test_ggn_floor.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from benchmarks.tools import Plain

_LAYERS = (nn.Conv2d, nn.BatchNorm2d, nn.Linear)
# samples per chunk of a convolution's per-sample, per-column gradients
_CHUNK = 4


class GGNFloor(Plain):
    """A plain step plus the business preset's curvature work done by hand (module
    docstring). ``model``: layers with parameters only of the kinds in :data:`_LAYERS`, output
    [N, C] logits of a softmax cross-entropy."""

    def __init__(self, model: nn.Module, loss_fn, kind: str = "sgd"):
        layers = [m for m in model.modules() if next(m.parameters(False), None) is not None]
        other = sorted({type(m).__name__ for m in layers if not isinstance(m, _LAYERS)})
        if other:
            raise ValueError(
                f"The GGN floor has no kernel for {', '.join(other)}: it covers Conv2d, "
                "BatchNorm2d and Linear layers (use it on the ResNet)."
            )
        super().__init__(model, loss_fn, kind)
        self.layers = layers
        self.records: dict[nn.Module, list[Tensor]] = {}
        self.handles: list = []
        for m in layers:
            m.register_forward_hook(self._record)
        self.diagonal: list[Tensor] = []
        self.m2: list[Tensor] = []

    def _record(self, module, inputs, output) -> None:
        """[input, output, then the backward's output gradient]."""
        self.records[module] = [inputs[0].detach(), output]
        self.handles.append(output.register_hook(self.records[module].append))

    def step(self, k, X, y) -> None:
        self.opt.zero_grad(set_to_none=True)
        out = self.model(X)
        losses = self.loss_fn(out, y)
        losses.mean().backward(create_graph=True)
        for handle in self.handles:
            handle.remove()
        self.handles = []
        n = len(X)
        with torch.no_grad():
            deltas = {m: [r[2] * n] for m, r in self.records.items()}  # d l_n / d out_n
            self.m2 = self._squares(deltas, 1.0 / n)
            roots = _softmax_root(out.detach())  # [N, C, K]
        outputs = [self.records[m][1] for m in self.layers]
        columns = {m: [] for m in self.layers}
        for j in range(roots.shape[2]):
            found = torch.autograd.grad(
                out, outputs, roots[:, :, j], retain_graph=True, allow_unused=True
            )
            for m, g in zip(self.layers, found, strict=True):
                columns[m].append(g)
        with torch.no_grad():
            self.diagonal = self._squares(columns, 1.0 / n)
        self.opt.step()
        for p in self.model.parameters():
            p.grad = None  # (the create-graph backward's reference cycle)
        self.records = {}

    def _squares(self, deltas: dict, scale: float) -> list[Tensor]:
        """sum over the columns and samples of the squared per-sample gradients, times
        ``scale``, per parameter in ``model.parameters()`` order."""
        found = {}
        for m, ds in deltas.items():
            x = self.records[m][0]
            d = torch.stack(ds)  # [K, N, O, ...]
            if isinstance(m, nn.Conv2d):
                found[m.weight] = _conv_squares(m, x, d)
                if m.bias is not None:
                    found[m.bias] = d.sum((3, 4)).square().sum((0, 1))
            elif isinstance(m, nn.BatchNorm2d):
                x_hat = _batch_norm_x_hat(m, x)
                found[m.weight] = (d * x_hat).sum((3, 4)).square().sum((0, 1))
                found[m.bias] = d.sum((3, 4)).square().sum((0, 1))
            else:
                sq = d.square().sum(0)  # [N, O]
                found[m.weight] = sq.t() @ x.square()
                found[m.bias] = sq.sum(0)
        return [found[p].mul_(scale) for p in self.model.parameters()]


def _softmax_root(logits: Tensor) -> Tensor:
    """[N, C, C - 1]: S_n S_n^T = diag(p_n) - p_n p_n^T (its rank C - 1), by eigenvectors."""
    p = logits.softmax(-1)
    values, vectors = torch.linalg.eigh(torch.diag_embed(p) - p[:, :, None] * p[:, None, :])
    return vectors[:, :, 1:] * values[:, None, 1:].clamp(min=0).sqrt()


def _conv_squares(conv: nn.Conv2d, x: Tensor, d: Tensor) -> Tensor:
    """sum_j sum_n (delta_{n,j} X_n^T)^2 for d [K, N, O, H, W]: one product per chunk of
    samples, [c, K O, T] @ [c, T, I] on the unfolded input."""
    k, n, o = d.shape[:3]
    total = None
    for start in range(0, n, _CHUNK):
        stop = min(n, start + _CHUNK)
        cols = F.unfold(x[start:stop], conv.kernel_size, conv.dilation, conv.padding, conv.stride)
        dc = d[:, start:stop].flatten(3).movedim(0, 1).reshape(stop - start, k * o, -1)
        g = torch.bmm(dc, cols.transpose(1, 2))  # [c, K O, I]
        part = g.square_().sum(0).reshape(k, o, -1).sum(0)
        total = part if total is None else total.add_(part)
    return total.reshape(conv.weight.shape)


def _batch_norm_x_hat(bn: nn.BatchNorm2d, x: Tensor) -> Tensor:
    """x_hat as the layer normalised x (batch statistics in train mode)."""
    if bn.training:
        var, mean = torch.var_mean(x, (0, 2, 3), keepdim=True, correction=0)
    else:
        mean, var = bn.running_mean[:, None, None], bn.running_var[:, None, None]
    return (x - mean) * torch.rsqrt(var + bn.eps)
