"""Tensor parallelism (DTensor parameters not sharded by fully_shard) is refused by name at
construction (issue 28, item 10): its gradients are not those of the processes' batches (a
replicated parameter's GradNorm came out sqrt(2) too large on 2 processes)."""

from __future__ import annotations

import re

import models
import pytest
from spawned import on_ranks

from avionics import Cockpit, quantities


def refusal_on_rank(rank, world, plan):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model, _, _, _ = models.mlp(n=2)
    mesh = init_device_mesh("cpu", (world,))
    if plan == "replicated":
        distribute_module(model, mesh)  # every parameter Replicate()
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel()})  # Shard(0), no fully_shard
    hooks = len(torch.nn.modules.module._global_forward_hooks)
    try:
        Cockpit(model, [quantities.GradNorm(), quantities.Distance(), quantities.UpdateSize()])
    except TypeError as error:
        assert len(torch.nn.modules.module._global_forward_hooks) == hooks
        return str(error)
    return None


@pytest.mark.parametrize(
    "plan, names",
    [
        ("replicated", r"'0\.weight' is a DTensor with placements \(Replicate\(\),\)"),
        (
            "colwise",
            r"'0\.weight' is a DTensor .* no module of the model is sharded by fully_shard",
        ),
    ],
)
def test_tensor_parallel_parameters_are_refused_by_name(tmp_path, plan, names):
    for refused in on_ranks(refusal_on_rank, 2, tmp_path, plan):
        assert refused is not None, "a tensor-parallel model was taken for FSDP"
        assert re.search(names, refused), refused
        assert "tensor parallelism" in refused and "fully_shard alone or" in refused
