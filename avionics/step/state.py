"""The cockpit's resumable state (:meth:`avionics.Cockpit.state_dict`) and its check before
:meth:`~avionics.Cockpit.load_state_dict` changes anything: the version, the tracked
parameters (names and shapes: another model's state is refused), the quantities, and each
per-parameter list of tensors in a quantity's state (a tensor of the wrong shape is refused).
"""

from __future__ import annotations

from torch import Tensor

STATE_VERSION = 2
# version 1 (before the tracked parameters were saved) is read without their check
READABLE_VERSIONS = (1, STATE_VERSION)


def state_of(quantities: list, names: list[str], params: list) -> dict:
    """What :meth:`avionics.Cockpit.state_dict` returns."""
    return {
        "version": STATE_VERSION,
        "parameters": {name: list(_local_shape(p)) for name, p in zip(names, params)},
        "quantities": {q.name: q.state_dict() for q in quantities},
    }


def check_state(state, quantities: list, names: list[str], params: list) -> None:
    """Raise ValueError, naming what does not match, unless ``state`` is a state of a cockpit
    with these quantities on a model with these tracked parameters."""
    remedy = "load the state that Cockpit.state_dict() gave for this model and these quantities"
    if not isinstance(state, dict) or state.get("version") not in READABLE_VERSIONS:
        version = state.get("version") if isinstance(state, dict) else None
        raise ValueError(
            "Cockpit.load_state_dict takes what Cockpit.state_dict returned (version "
            f"{STATE_VERSION}); got {type(state).__name__}"
            + (f" of version {version!r}" if version is not None else "")
            + f": {remedy}."
        )
    saved, ours = state.get("quantities"), {q.name for q in quantities}
    if not isinstance(saved, dict) or not all(isinstance(s, dict) for s in saved.values()):
        raise ValueError(
            f"The saved cockpit state has no dict of quantity states under 'quantities' (got "
            f"{type(saved).__name__}): the state is corrupt; {remedy}."
        )
    if set(saved) != ours:
        raise ValueError(
            f"The saved cockpit had the quantities {sorted(saved)}, this one has "
            f"{sorted(ours)}: build the cockpit with the same quantities to resume."
        )
    shapes = {name: list(_local_shape(p)) for name, p in zip(names, params)}
    if state["version"] >= 2 and state.get("parameters") != shapes:
        raise ValueError(
            "The saved cockpit tracked other parameters: "
            f"{_difference(state.get('parameters'), shapes)}; {remedy} (the same model and "
            "params=)."
        )
    for name, quantity_state in saved.items():
        _check_tensors(name, quantity_state, list(shapes.items()), remedy)


def _check_tensors(quantity: str, tree, shapes: list, remedy: str, path: str = "") -> None:
    """Each list of one tensor per tracked parameter in ``tree`` has the parameters' shapes
    (a list counts as one when its length is theirs and some tensor in it has its
    parameter's shape)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            _check_tensors(quantity, value, shapes, remedy, f"{path}[{key!r}]")
        return
    if not isinstance(tree, (list, tuple)):
        return
    per_parameter = len(tree) == len(shapes) and all(isinstance(t, Tensor) for t in tree)
    if per_parameter and any(list(t.shape) == s for t, (_, s) in zip(tree, shapes)):
        for t, (name, shape) in zip(tree, shapes):
            if list(t.shape) != shape:
                raise ValueError(
                    f"The saved state of {quantity}{path} holds a tensor of shape "
                    f"{list(t.shape)} for the parameter {name} of shape {shape}: the state "
                    f"is corrupt or of another model; {remedy}."
                )
        return
    for k, value in enumerate(tree):
        _check_tensors(quantity, value, shapes, remedy, f"{path}[{k}]")


def _difference(saved, ours: dict) -> str:
    """What differs between the saved parameters' shapes and ours, in words."""
    if not isinstance(saved, dict):
        return f"the state names none (got {type(saved).__name__})"
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    parts = [f"not saved: {', '.join(missing)}"] if missing else []
    parts += [f"not in this model: {', '.join(extra)}"] if extra else []
    parts += [
        f"{name} was of shape {saved[name]}, is of shape {shape}"
        for name, shape in ours.items()
        if name in saved and saved[name] != shape
    ]
    return "; ".join(parts)


def _local_shape(p):
    return p.to_local().shape if hasattr(p, "to_local") else p.shape
