"""The state of a Kronecker-factored operator (KFAC, EKFAC): its factors, and what they are of.

A state is a dict of plain Python values and tensors (``torch.save`` stores it):

* ``version``: the layout's version, 1;
* ``operator``: the class name, ``"KFACOperator"`` or ``"EKFACOperator"``;
* ``parameters``: the parameter names, in the operator's order;
* ``blocks``: the parameter names of every block, in block order;
* ``num_data``: the number of samples the factors are of;
* ``configuration``: fisher_type, mc_samples, seed, separate_weight_and_bias, kfac_approx,
  convention;
* ``factors``: per block a dict of tensors: ``B`` [d_out, d_out], ``A`` [d_A, d_A] (and for
  EKFAC its eigenbases ``Q_B``, ``Q_A`` and corrected eigenvalues ``S`` [d_out, d_A]).

Loading checks all of it against the operator before anything is replaced, and names what
does not match.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

STATE_VERSION = 1
FACTOR_SHAPES = {"B": ("out", "out"), "A": ("in", "in"), "Q_B": ("out", "out"),
                 "Q_A": ("in", "in"), "S": ("out", "in")}  # fmt: skip


def operator_state(operator) -> dict:
    """The state of ``operator`` (see the module docstring); the tensors are copies, one of
    each factor, so that a factor the blocks share (the B of a weight and its bias) stays
    shared, also through ``torch.save``."""
    copies: dict[int, Tensor] = {}

    def copy(tensor: Tensor) -> Tensor:
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.detach().clone()
        return copies[id(tensor)]

    return {
        **operator_state_header(operator),
        "factors": [
            {key: copy(tensor) for key, tensor in entry.items()}
            for entry in operator._factor_state()
        ],  # fmt: skip
    }


def check_state(operator, state, *, finite: bool = True) -> list[dict[str, Tensor]]:
    """The factors of ``state``, on the operator's dtype and device, after checking that
    every entry matches ``operator`` (and, if ``finite``, is finite: see :func:`check_finite`);
    else a ValueError naming the first mismatch."""
    owner = f"{type(operator).__name__}.load_state_dict"
    blocks = operator._blocks
    expected = operator_state_header(operator)
    if not isinstance(state, dict):
        raise ValueError(f"{owner} needs the dict that state_dict() returns, got "
                         f"{type(state).__name__}.")  # fmt: skip
    configuration = state.get("configuration")
    if isinstance(configuration, dict) and "convention" not in configuration:
        # saved before the convention was an option: it is avionics'
        state = {**state, "configuration": {**configuration, "convention": "avionics"}}
    missing = [key for key in (*expected, "factors") if key not in state]
    if missing:
        raise ValueError(f"{owner}: the state has no {missing} (is it from state_dict()?).")
    for key, value in expected.items():
        if state[key] != value:
            raise ValueError(
                f"{owner}: the state's {key} is {state[key]!r}, but this operator's is "
                f"{value!r}; load a state saved from an operator with the same {key}."
            )
    factors = state["factors"]
    if not isinstance(factors, list) or len(factors) != len(blocks):
        raise ValueError(f"{owner}: the state's factors must be a list of one dict per block "
                         f"({len(blocks)}).")  # fmt: skip
    checked = [_check_block_factors(operator, block, entry, owner)
               for block, entry in zip(blocks, factors)]  # fmt: skip
    if finite:
        check_finite(operator, checked, owner)
    return checked


def check_finite(operator, factors: list[dict[str, Tensor]], owner: str) -> None:
    """A ValueError naming the first factor (by block) with a NaN or inf entry, if any.

    One check of all factors, each distinct tensor once, one host read: a NaN or inf entry
    spreads into its tensor's sum and into the sum of the sums (finite sums that overflow
    only send it to the search by block, which then finds nothing)."""
    distinct = {id(tensor): tensor for entry in factors for tensor in entry.values()}
    total = torch.stack([tensor.sum() for tensor in distinct.values()]).sum().item()
    if math.isfinite(total):
        return
    for block, entry in zip(operator._blocks, factors):
        for key, tensor in entry.items():
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{owner}: factor {key} of block {block.describe()} is not "
                                 "finite.")  # fmt: skip


def operator_state_header(operator) -> dict:
    """Everything in the state except the factors."""
    return {
        "version": STATE_VERSION,
        "operator": type(operator).__name__,
        "parameters": list(operator._param_names),
        "blocks": [list(block.names) for block in operator._blocks],
        "num_data": operator.num_data,
        "configuration": operator._configuration(),
    }


def _check_block_factors(operator, block, entry, owner: str) -> dict[str, Tensor]:
    keys = operator.STATE_FACTORS
    if not isinstance(entry, dict) or set(entry) != set(keys):
        found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{owner}: the factors of block {block.describe()} must be a dict "
                         f"with {list(keys)}, got {found}.")  # fmt: skip
    weight = block.layer.weight
    sizes = {"out": weight.shape[0], "in": 1}
    if block.has_weight:
        sizes["in"] = weight.numel() // weight.shape[0] + block.has_bias
    checked = {}
    for key in keys:
        tensor, shape = entry[key], tuple(sizes[axis] for axis in FACTOR_SHAPES[key])
        if not isinstance(tensor, Tensor) or tuple(tensor.shape) != shape:
            got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"{owner}: factor {key} of block {block.describe()} must be a "
                             f"tensor of shape {shape}, got {got}.")  # fmt: skip
        same = tensor.dtype == operator.dtype and tensor.device == operator.device
        checked[key] = tensor if same and not tensor.requires_grad else tensor.detach().to(
            dtype=operator.dtype, device=operator.device)  # fmt: skip
    return checked
