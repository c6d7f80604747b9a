"""Transfer: a finished step's values cross to the host once.

Everything the host needs of a step's values is read in one transfer per device (one on a
GPU: the values are on the parameters' device): the tensors of each
:class:`~avionics.quantities.deferred.Deferred` value, whether each value that is a floating
tensor is finite, and, where the values go to sinks as plain Python, every tensor in them
(flattened, read as float64, which holds every float of 64 bits or fewer and every integer up
to 2^53 exactly, and rebuilt as the nested lists of ``Tensor.tolist``). The deferred values are
then finished on the host, in order.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from avionics.quantities.deferred import Deferred


def read(values: dict[int, dict[str, Any]], convert: bool):
    """(``values`` with each deferred value finished, or dropped where it finishes as None;
    and, per step, the names of the values that are NaN or infinite), in one host transfer;
    with ``convert``, every value is plain Python (as
    :func:`avionics.records.encoding.to_python` makes it)."""
    reads = _Reads()
    # what the host reads: (step, name, the deferred value's numbers, its finiteness, the value)
    pending = []
    for step, named in values.items():
        for name, value in named.items():
            deferred = value if isinstance(value, Deferred) else None
            if deferred is not None:
                value = deferred.value
            numbers = reads.tree(deferred.tensors) if deferred else None
            finite = None  # (its read)
            if _is_float_tensor(value):
                finite = reads.add(finiteness(value))
            leaves = reads.tree(value) if convert else None
            pending.append((step, name, deferred, numbers, finite, value, leaves))
    host = reads.host()
    out: dict[int, dict[str, Any]] = defaultdict(dict)
    bad: dict[int, list[str]] = defaultdict(list)
    for step, name, deferred, numbers, finite, value, leaves in pending:
        if convert:
            value = _rebuilt(value, _numbers(host, leaves))
        if deferred is not None:
            value = deferred.finish(list(_numbers(host, numbers)), value)
            if value is None:
                continue
        ok = True
        if finite is not None:  # finite where every entry is
            ok = math.isfinite(next(_numbers(host, [finite])))
        ok = ok and _finite_number(value)
        if not ok:
            bad[step].append(name)
        out[step][name] = value
    return dict(out), dict(bad)


class _Reads:
    """The tensors the host reads, flattened into one transfer per device; each read is
    known by its (device, offset, numel) in :meth:`host`'s lists."""

    def __init__(self):
        self._parts: dict[torch.device, list[Tensor]] = defaultdict(list)
        self._size: dict[torch.device, int] = defaultdict(int)

    def add(self, tensor: Tensor) -> tuple:
        """Read the one number of ``tensor``."""
        return self.tree(tensor.reshape(()))[0]

    def tree(self, value: Any) -> list[tuple]:
        """Read every tensor in ``value`` (dicts, lists, tuples), in order."""
        segments = []
        for t in _tensors(value):
            device, numel = t.device, t.numel()
            segments.append((device, self._size[device], numel))
            self._parts[device].append(t.reshape(-1))
            self._size[device] += numel
        return segments

    def host(self) -> dict[torch.device, list[float]]:
        """Every number read, per device (one transfer each): one ``cat`` of the flattened
        tensors and an empty float64 one, which promotes the result to float64 (each value
        converted exactly as ``.to(torch.float64)`` would; a few hundred Python calls fewer
        than converting each tensor)."""
        with torch.no_grad():
            return {
                device: torch.cat(
                    [*parts, torch.empty(0, dtype=torch.float64, device=device)]
                ).tolist()
                for device, parts in self._parts.items()
            }


def _numbers(host: dict, segments: list[tuple]):
    """The numbers of ``segments`` of the host's lists, in order."""
    for device, offset, numel in segments:
        yield from host[device][offset : offset + numel]


def _tensors(value: Any):
    """The tensors in ``value``, depth first (the order :func:`_rebuilt` consumes them)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _rebuilt(value: Any, numbers) -> Any:
    """``value`` as plain Python, its tensors' numbers taken from ``numbers`` in order."""
    if isinstance(value, Tensor):
        kind = bool if value.dtype == torch.bool else float if value.is_floating_point() else int
        flat = [kind(next(numbers)) for _ in range(value.numel())]
        return _nested(flat, list(value.shape))
    if isinstance(value, dict):
        return {k: _rebuilt(v, numbers) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rebuilt(v, numbers) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays (on the host)
    return tolist() if callable(tolist) else value


def _nested(flat: list, shape: list[int]):
    """``flat`` in row-major order as nested lists of ``shape`` (a number for shape [])."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def finiteness(tensor: Tensor) -> Tensor:
    """A number that is finite where every entry of ``tensor`` is: a scalar itself (a step's
    many scalars cost no kernel), else sum_i 0 * t_i, which is 0 where every t_i is finite
    and NaN where one is NaN or infinite (0 * inf = NaN; it cannot overflow): two operations,
    where ``torch.isfinite(t).all()`` takes five."""
    if tensor.dim() == 0:
        return tensor
    return (tensor * 0).sum()


def _finite_number(value: Any) -> bool:
    """Whether ``value`` is not a NaN or infinite float (other values are not checked)."""
    return not isinstance(value, float) or math.isfinite(value)
