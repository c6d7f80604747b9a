"""Peers: other tools' steps computing the per-sample squared gradient norms of all parameters.

Each is a training loop of :mod:`benchmarks.tools` (plain SGD on the mean loss) that also
computes sum_k ||g_n^(k)||^2 per sample (what NormTest needs), the way its library does it:

* ``BackPACK``: ``BatchL2Grad`` on a ``backpack.extend``-ed model and ``CrossEntropyLoss``;
* ``Opacus ghost clipping``: ``GradSampleModuleFastGradientClipping(use_ghost_clipping=True)``,
  its per-sample norms (``get_norm_sample``) from the hooks of one ordinary backward (Gram
  forms for Linear and Embedding layers, per-sample gradients for the others); the second,
  clipped backward of private training is not run, since the norms are all that is asked;
* ``torch.func vmap(grad)``: per-sample gradients by ``vmap(grad(...))`` over a
  ``functional_call`` (all N x D of them), their mean is the gradient the optimizer steps on.

:func:`refusal` says why a peer cannot run a model ('-' in the tables).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from benchmarks.tools import Plain


class BackPACK(Plain):
    def __init__(self, model, loss_fn, kind: str = "sgd"):
        from backpack import extend

        super().__init__(extend(model), loss_fn, kind)
        self.loss = extend(nn.CrossEntropyLoss())
        self.sq_norms = None

    def step(self, k, X, y) -> None:
        from backpack import backpack
        from backpack.extensions import BatchL2Grad

        self.opt.zero_grad()
        with backpack(BatchL2Grad()):
            self.loss(self.model(X), y).backward()
        self.sq_norms = sum(p.batch_l2 for p in self.model.parameters())
        self.opt.step()


class OpacusGhost(Plain):
    def __init__(self, model, loss_fn, kind: str = "sgd"):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = GradSampleModuleFastGradientClipping(
                model, batch_first=True, loss_reduction="mean", use_ghost_clipping=True
            )
        super().__init__(wrapped, loss_fn, kind)
        self.sq_norms = None

    def step(self, k, X, y) -> None:
        self.opt.zero_grad()
        self.loss_fn(self.model(X), y).mean().backward()
        self.sq_norms = self.model.get_norm_sample().square()
        self.opt.step()


class VmapGrad(Plain):
    def __init__(self, model, loss_fn, kind: str = "sgd"):
        super().__init__(model, loss_fn, kind)
        self.params = dict(model.named_parameters())

        def loss_of_one(params, x, y):
            return loss_fn(functional_call(model, params, (x[None],)), y[None]).squeeze(0)

        self.per_sample_grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0))
        self.sq_norms = None

    def step(self, k, X, y) -> None:
        self.opt.zero_grad()
        grads = self.per_sample_grads({k: p.detach() for k, p in self.params.items()}, X, y)
        self.sq_norms = sum(g.flatten(1).square().sum(1) for g in grads.values())
        for name, p in self.params.items():
            p.grad = grads[name].mean(0)
        self.opt.step()


PEERS = {"BackPACK": BackPACK, "Opacus ghost clipping": OpacusGhost, "vmap(grad)": VmapGrad}


def refusal(peer: str, model: nn.Module) -> str | None:
    """Why ``peer`` cannot run ``model`` (None if it can)."""
    tied = len(list(model.parameters())) < len(
        list(model.named_parameters(remove_duplicate=False))
    )
    if peer == "BackPACK" and (tied or any(isinstance(m, nn.LayerNorm) for m in model.modules())):
        return (
            "BackPACK has no BatchL2Grad rule for LayerNorm, takes [N, C] outputs only in its "
            "CrossEntropyLoss, and would give the tied weight's two uses' norms separately"
        )
    if peer == "Opacus ghost clipping" and tied:
        return "tied weights: 'Parameter tying is not supported with Ghost Clipping'"
    return None


def available(peer: str) -> str | None:
    """None if the peer's library imports, else why not."""
    module = {"BackPACK": "backpack", "Opacus ghost clipping": "opacus"}.get(peer)
    if module is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            __import__(module)
    except Exception as error:
        return f"not installed ({type(error).__name__}: {error})"
    return None


def check(peer: str, builder) -> float:
    """Largest relative difference between the peer's per-sample squared norms and a loop
    over samples (float64, one step), so that each peer is known to compute them."""
    model, X, y, loss_fn = builder()
    model = model.double()
    X = X.double() if X.is_floating_point() else X
    reference = []
    for n in range(len(X)):
        model.zero_grad()
        loss_fn(model(X[n : n + 1]), y[n : n + 1]).sum().backward()
        reference.append(sum(p.grad.square().sum() for p in model.parameters()))
    reference = torch.stack(reference)
    tool = PEERS[peer](model, loss_fn)
    tool.step(0, X, y)
    # BackPACK gives the norms of the mean loss's terms, (1/N) g_n
    scale = len(X) ** 2 if peer == "BackPACK" else 1
    return float(((tool.sq_norms * scale - reference).abs() / reference).max())
