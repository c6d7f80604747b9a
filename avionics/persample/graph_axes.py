"""Where the batch axis of a tensor lies in the tensors it was computed from, read off the
autograd graph.

From a tensor whose batch axis a is known (the input of a module with a ``batch_first``
attribute), the walk goes back through the nodes whose forward moves axes without mixing
the batch with another axis, each mapping a to the axis of its inputs exactly:

* elementwise operations (broadcasting aligns the operands to the right: axis a of the
  output is axis a - (output dims - operand dims) of an operand that has the output's size
  there; an operand of size 1 there does not carry the batch);
* operations along other axes than a (softmax, flip, cumsum, layer norm over the trailing
  axes, slices, cat, split) keep a; select, unbind and reductions over other axes
  (mean, sum) shift it by the axes they remove or add;
* transpose and permute move it: x.transpose(i, j) swaps i and j, x.permute(dims) has
  input axis dims[a] at a;
* views and reshapes (view, reshape, flatten, squeeze, unsqueeze) keep it where an input
  axis b has the output's size and the same number of elements before it,
  prod(in[:b]) == prod(out[:a]) (the elements along a are then those along b).

Any other node (a matrix product, an index, a reduction over a) ends the walk there.
"""

from __future__ import annotations

import math

# elementwise: every operand aligned to the right
_ELEMENTWISE = {
    "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "MulBackward0",
    "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0", "TanhBackward0",
    "SigmoidBackward0", "ReluBackward0", "GeluBackward0", "SiluBackward0", "ExpBackward0",
    "LogBackward0", "SqrtBackward0", "RsqrtBackward0", "PowBackward0", "PowBackward1",
    "AbsBackward0", "CloneBackward0", "ToCopyBackward0", "ThresholdBackward0",
    "LeakyReluBackward0", "EluBackward0", "SoftplusBackward0", "HardtanhBackward0",
    "WhereBackward0", "MaskedFillBackward0", "ClampBackward1", "ClampMinBackward0",
    "ExpandBackward0", "SinBackward0", "CosBackward0", "ErfBackward0", "ReciprocalBackward0",
    "NativeDropoutBackward0", "AliasBackward0",
}  # fmt: skip
# along the saved dims (``_saved_dim`` or ``_saved_dims``), other axes kept
_ALONG = {
    "SoftmaxBackward0", "LogSoftmaxBackward0", "FlipBackward0", "CumsumBackward0",
    "SliceBackward0", "CatBackward0", "SplitBackward0", "SplitWithSizesBackward0",
    "RollBackward0",
}  # fmt: skip
_VIEWS = {
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "UnsqueezeBackward0",
    "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
}  # fmt: skip
# nodes walked at most from one start (a residual stream reaches every block's output)
BUDGET = 2048


def traced_axes(edge, axis: int, stops=frozenset()) -> dict[tuple[int, int], int | None]:
    """(id(node), output index) -> the batch axis of that tensor, for every tensor the walk
    from ``edge`` (the (node, output index) of a tensor with the batch on ``axis``) reaches;
    None where two paths disagree (a forward that mixes the batch with another axis). The walk
    goes no further back than a tensor whose key is in ``stops`` (a module call's output:
    what lies before it is that call's own walk, so the walks of all calls together visit
    each operation about once, not once per later call)."""
    found: dict[tuple[int, int], int | None] = {}
    stack = [(edge, axis)]
    while stack and len(found) < BUDGET:
        (node, nr), a = stack.pop()
        if node is None:
            continue
        key = (id(node), nr)
        if key in found:
            if found[key] != a:
                found[key] = None
            continue
        found[key] = a
        if key not in stops:
            stack += _input_axes(node, nr, a)
    return found


def _dim(d: int, ndim: int) -> int:
    """A saved dim as an axis in 0..ndim-1 (negative ones are saved as unsigned 64 bits)."""
    return (d - 2**64 if d >= 2**63 else d) % max(ndim, 1)


def _shape(edge) -> tuple | None:
    node, nr = edge
    meta = getattr(node, "_input_metadata", None)
    return tuple(meta[nr].shape) if meta is not None and nr < len(meta) else None


def _saved_dims(node, ndim: int) -> set[int]:
    dims = getattr(node, "_saved_dims", None)
    if dims is None:
        dims = getattr(node, "_saved_dim", ())
    dims = dims if isinstance(dims, tuple | list) else (dims,)
    return {_dim(d, ndim) for d in dims}


def _input_axes(node, nr: int, a: int) -> list[tuple]:
    """((input edge, its batch axis)) of ``node`` whose output ``nr`` has the batch on
    ``a`` (the module docstring's rules); [] where the node ends the walk."""
    out = _shape((node, nr))
    name = node.name()
    edges = [e for e in node.next_functions if e[0] is not None]
    if out is None or a >= len(out):
        return []
    if name in _ELEMENTWISE or name in _ALONG or name == "NativeLayerNormBackward0":
        if name in _ALONG and a in _saved_dims(node, len(out)):
            return []
        if name == "NativeLayerNormBackward0" and a >= len(out) - len(
            node._saved_normalized_shape
        ):
            return []
        found = []
        for e in edges:
            shape = _shape(e)
            b = None if shape is None else a - (len(out) - len(shape))
            if b is not None and b >= 0 and shape[b] == out[a]:
                found.append((e, b))
        return found
    if len(edges) != 1:
        return []
    (e,) = edges
    shape = _shape(e)
    if shape is None:
        return []
    b = _moved_axis(node, name, out, shape, a)
    return [] if b is None or b >= len(shape) or shape[b] != out[a] else [(e, b)]


def _moved_axis(node, name: str, out: tuple, shape: tuple, a: int) -> int | None:
    """The input axis of a one-input node that moves or removes axes, for output axis ``a``."""
    if name == "TransposeBackward0":
        i, j = _dim(node._saved_dim0, len(out)), _dim(node._saved_dim1, len(out))
        return j if a == i else i if a == j else a
    if name == "TBackward0":
        return len(out) - 1 - a
    if name == "PermuteBackward0":
        return _dim(node._saved_dims[a], len(out))
    if name in ("SelectBackward0", "UnbindBackward0"):
        d = _dim(node._saved_dim, len(shape))
        return a + (a >= d)
    if name in ("MeanBackward1", "SumBackward1"):
        dims = _saved_dims(node, len(shape))
        if node._saved_keepdim:
            return None if a in dims else a
        kept = [b for b in range(len(shape)) if b not in dims]
        return kept[a] if len(kept) == len(out) else None
    if name in _VIEWS:
        before = math.prod(out[:a])
        return next(
            (
                b
                for b in range(len(shape))
                if shape[b] == out[a] and math.prod(shape[:b]) == before
            ),
            None,
        )
    return None
