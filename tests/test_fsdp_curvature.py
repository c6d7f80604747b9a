"""Why the cockpit refuses its curvature quantities under FSDP2 (avionics.step.sharded), and
what a sharded Hessian-vector product needs to be exact: two gloo processes, a float64 MLP
``fully_shard``-ed per layer, each process the mean loss of its half of the batch.

A double backward through the step's gradient graph reads the layers' unsharded parameters
the forward saved. With fully_shard's defaults FSDP frees them after the backward
(reshard_after_backward), and the product fails on their freed storage. Kept through the
backward (``set_reshard_after_backward(False)``, with reshard_after_forward True or False: the
backward's all-gather refills the storage the graph saved), each process's product is
H_r v of its own loss, and their average over the processes is the global batch's H v,
equal to one float64 process's dense double backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from spawned import on_ranks
from torch import nn

from avionics import Cockpit, quantities

MODES = {  # name: (reshard_after_forward, keep the unsharded parameters after the backward)
    "defaults": (True, False),
    "kept after the backward": (True, True),
    "never resharded": (False, True),
}


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (8,), generator=g
    )


def direction(model):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in model.parameters()]


def sharded_product(rank, world, reshard_after_forward, keep):
    """The processes' average of H_r v through FSDP's unsharded parameters (the gradients
    with their graph as they arrive there), or the error the double backward raises."""
    from torch.distributed.fsdp import fully_shard

    model, (X, y) = mlp(), batch()
    v = direction(model)
    for layer in (model[0], model[2]):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    model.set_reshard_after_backward(not keep)
    loss = nn.functional.cross_entropy(model(X[rank::world]), y[rank::world])
    by_shard = {
        id(fsdp_param.sharded_param): fsdp_param
        for module in model.modules()
        if hasattr(module, "_get_fsdp_state")
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
    }
    # (never resharded, the modules hold the unsharded parameters after the forward)
    leaves = [
        by_shard[id(p)].unsharded_param if id(p) in by_shard else p for p in model.parameters()
    ]
    grads = [None] * len(leaves)

    def keeper(k):
        def keep_gradient(g):
            grads[k] = g

        return keep_gradient

    handles = [leaf.register_hook(keeper(k)) for k, leaf in enumerate(leaves)]
    loss.backward(create_graph=True)
    for handle in handles:
        handle.remove()
    try:
        products = torch.autograd.grad(sum((g * u).sum() for g, u in zip(grads, v)), leaves)
    except RuntimeError as error:
        return str(error)
    products = [h.detach().clone() for h in products]
    for h in products:
        dist.all_reduce(h)
    return [h / world for h in products]


def on_a_rank(rank, world):
    from torch.distributed.fsdp import fully_shard

    products = {name: sharded_product(rank, world, *how) for name, how in MODES.items()}
    refused = None
    try:
        Cockpit(fully_shard(mlp()), [quantities.Loss(), quantities.HessTrace()])
    except TypeError as error:
        refused = str(error)
    return products, refused


@pytest.mark.slow
def test_a_hessian_vector_product_under_fully_shard_is_exact_only_with_kept_parameters(tmp_path):
    model, (X, y) = mlp(), batch()
    params, v = list(model.parameters()), direction(model)
    grads = torch.autograd.grad(
        nn.functional.cross_entropy(model(X), y), params, create_graph=True
    )
    expected = torch.autograd.grad(sum((g * u).sum() for g, u in zip(grads, v)), params)
    for products, refused in on_ranks(on_a_rank, 2, tmp_path):
        assert "storage of size 0" in products["defaults"]  # FSDP freed the parameters
        for name in ("kept after the backward", "never resharded"):
            for ours, theirs in zip(products[name], expected, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
        # the cockpit still refuses them by name, saying what to do instead
        assert "HessTrace differentiate the step's gradient again" in refused
        assert "set_reshard_after_backward(False)" in refused
        assert "DistributedDataParallel" in refused
