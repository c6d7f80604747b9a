"""The capture's tensors of a call's arguments and outputs: its fast path for a flat tuple,
list or dict gives what the pytree flattening gives, in the same order."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils import _pytree as pytree

from avionics.persample.capture import _tensors

a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
Pair = namedtuple("Pair", "first second")


@pytest.mark.parametrize(
    "tree",
    [
        a,
        (a, b),
        (a, None, b),
        [None, b, 3, "name", True, a],
        {"hidden": b, "mask": None, "use_cache": False, "first": a},
        ((a, b), c),  # nested: the pytree path
        {"past": (a, None), "x": c},
        Pair(b, a),
        OrderedDict(second=b, first=a),
        (),
        {},
    ],
)
def test_tensors_in_flattening_order(tree):
    expected = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    found = _tensors(tree)
    assert len(found) == len(expected)
    assert all(x is y for x, y in zip(found, expected, strict=True))
