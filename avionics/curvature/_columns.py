"""How the columns of a product are multiplied: together (vmap), in blocks, or one by one.

A product with several columns multiplies them in vmapped blocks whose saved activations,
``[columns, ...]`` each, stay within :data:`COLUMN_BLOCK_BYTES` (32 MiB, glibc's largest
threshold for serving an allocation from fresh pages): past it every batched intermediate
comes from fresh pages, which the kernel faults in and zeroes on every product, and the
columns cost more together than one after the other. Measured (GGN, 16 columns, 1 thread,
CPU time, 2026-12-03): the small GPT saves 44 MiB per column, vmap 3.18 s (1.13 s of it in the
kernel), a loop over the columns 2.17 s; 3c3d saves 98 MiB, 5.30 s against 3.20 s; the MLP
saves 1.1 MiB, 40 ms against 65 ms. The rule depends on the shapes alone, so a product's
value and cost do not depend on the machine's load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.func import vmap

#: The most bytes of column linearisations (:func:`linearisation_bytes` times the columns)
#: one vmapped block of a product holds; a column beyond it goes alone (see above).
COLUMN_BLOCK_BYTES = 32 * 2**20


def linearisation_bytes(forward: Callable[[], Tensor], params: Sequence[Tensor]) -> int:
    """The bytes of the tensors ``forward()`` saves for its backward pass, leaving out the
    ones that share memory with ``params`` (the same for every column of a product).

    Counted by ``saved_tensors_hooks`` on one pass with autograd recording; it depends on
    the shapes only, not on the machine or its load.
    """
    shared = {p.untyped_storage().data_ptr() for p in params}
    total = 0

    def count(tensor: Tensor) -> Tensor:
        nonlocal total
        if tensor.untyped_storage().data_ptr() not in shared:
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(count, _unpacked):
        forward()
    return total


def _unpacked(tensor: Tensor) -> Tensor:
    return tensor


def map_columns(
    product: Callable[[list[Tensor]], list[Tensor]], M: list[Tensor], chunk_size: int | None
) -> list[Tensor]:
    """Apply a vector map to every column of ``M`` (last axis), ``chunk_size`` columns at a
    time (all at once for None), and give the results with the columns last (views).

    ``product`` maps a list of tensors (one vector) to a list of tensors. The columns of a
    chunk are mapped in parallel with ``torch.func.vmap``.
    They are copied to a leading axis first: vmap over the last axis (``in_dims=-1``) is
    slower on the batching rules' side (the GPT's 16-column GGN: 3.64 s against 3.26 s
    with the copy, CPU time, 2026-12-02).
    """
    if chunk_size is not None and M[0].shape[-1] <= chunk_size:
        chunk_size = None  # one chunk: skip vmap's concatenation of chunk outputs
    columns = [m.movedim(-1, 0).contiguous() for m in M]
    return vmap(product, out_dims=-1, chunk_size=chunk_size)(columns)
