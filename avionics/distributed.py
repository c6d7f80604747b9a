"""Data parallelism over torch.distributed: what makes a cockpit's values the global batch's.

Under data parallelism (``DistributedDataParallel``, or any loop in which each process
backpropagates its own shard of the batch and the gradients are averaged), process r holds
N_r samples. The global batch has N = sum_r N_r samples, and every quantity is defined on it
(docs/definitions.md, section 2), which only sums over samples connect to the processes' shares:

    sum over the batch of f(sample n) = sum_r (sum over process r's samples of f(sample n)).

So each process computes its sums, and one ``all_reduce`` adds them. The functions here pack
any number of such sums into one buffer (one collective per step, whatever the number of
quantities and layers) and give each process the others' small values (batch sizes, maxima) by
the same collective: each process writes its value into its own slot of a zero vector, and
the sum over processes fills every slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class World:
    """The processes the batch is split over: this one's ``rank`` among ``size``."""

    rank: int
    size: int

    def slots(self, value: Tensor) -> Tensor:
        """[size, *value.shape] zeros with ``value`` in this process's row: summed over the
        processes, it holds every process's value."""
        out = value.new_zeros((self.size, *value.shape))
        out[self.rank] = value
        return out


SINGLE = World(rank=0, size=1)


def current_world() -> World:
    """The default process group's world, or :data:`SINGLE` when torch.distributed is not
    initialised (or has one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return World(rank=dist.get_rank(), size=dist.get_world_size())
    return SINGLE


def unwrap(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """(the network, its DistributedDataParallel wrapper or None)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module, model
    return model, None


def sum_over_processes(tensors: list[Tensor], world: World) -> list[Tensor]:
    """Each tensor summed over the processes, by one ``all_reduce`` of one packed buffer.

    The buffer is float64 (integer counts below 2^53 stay exact), on the device the process
    group communicates on (:func:`collective_device`: a CUDA device under NCCL, which takes
    no CPU tensor, else the first tensor's device); each result has its tensor's shape, dtype
    and device. With one process: the tensors themselves.
    """
    if world.size == 1 or not tensors:
        return tensors
    device = collective_device(dist.get_backend(), tensors[0].device)
    buffer = torch.cat([t.detach().reshape(-1).to(device, torch.float64) for t in tensors])
    dist.all_reduce(buffer)
    out, start = [], 0
    for t in tensors:
        part = buffer[start : start + t.numel()].reshape(t.shape)
        out.append(part.to(t.device, t.dtype))
        start += t.numel()
    return out


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where a collective's buffer must live for ``backend``: NCCL communicates CUDA tensors
    only (the process's current CUDA device unless ``device`` is one), every other backend
    (gloo: CPU and CUDA tensors) takes the tensors' ``device``."""
    if "nccl" in str(backend).lower() and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def all_processes(value: Tensor, world: World) -> Tensor:
    """[size, *value.shape]: every process's ``value`` (one all_reduce of the slots)."""
    if world.size == 1:
        return value[None]
    (gathered,) = sum_over_processes([world.slots(value)], world)
    return gathered


# The bytes of each process's message that travel when a process failed (UTF-8, cut there).
MESSAGE_BYTES = 512


def messages_of_processes(message: str, world: World, device: torch.device) -> list[str]:
    """Every process's ``message`` (its first :data:`MESSAGE_BYTES` bytes of UTF-8), by one
    ``all_reduce`` of a [size, MESSAGE_BYTES] uint8 tensor of slots (a tensor collective, valid
    under NCCL; made only where a process failed, off the tracked steps' path)."""
    encoded = message.encode()[:MESSAGE_BYTES]
    row = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    row[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    slots = world.slots(row.to(collective_device(dist.get_backend(), device)))
    dist.all_reduce(slots)
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in slots.cpu().tolist()]
