"""Design limits of the package: no module over 700 lines, no function over 20 branches, and
a plain tracked step (one batch, one process) that runs no accumulation or data-parallel code.

Past either limit a module or function holds more than one concern (the project's standard:
split it by concern). Branches are counted as ruff's ``PLR0912`` (pylint's too-many-branches)
counts them, from the function's own body (a nested function or class is a function of its
own, counted apart):

* ``if``: 1, plus 1 for each ``elif`` and for an ``else``;
* ``for`` and ``while``: 1, plus 1 for an ``else``;
* ``try``: 1 for each ``except`` handler, 1 for an ``else``, 1 for a ``finally``;
* ``match``: 1 for each ``case``;
* ``with``, comprehensions, boolean operators and conditional expressions: 0 (the statements
  inside a ``with`` are counted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "avionics"
MAX_LINES = 700
MAX_BRANCHES = 20
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def branches(statements: list[ast.stmt]) -> int:
    """The branches of ``statements`` by the rule of the module docstring."""
    total = 0
    for node in statements:
        if isinstance(node, ast.If):
            total += 1 + branches(node.body)
            orelse = node.orelse
            if len(orelse) == 1 and isinstance(orelse[0], ast.If):  # an elif
                total += branches(orelse)
            elif orelse:
                total += 1 + branches(orelse)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            total += 1 + branches(node.body) + (1 + branches(node.orelse) if node.orelse else 0)
        elif isinstance(node, (ast.Try, ast.TryStar)):
            total += branches(node.body)
            total += sum(1 + branches(handler.body) for handler in node.handlers)
            total += 1 + branches(node.orelse) if node.orelse else 0
            total += 1 + branches(node.finalbody) if node.finalbody else 0
        elif isinstance(node, ast.Match):
            total += sum(1 + branches(case.body) for case in node.cases)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            total += branches(node.body)
    return total


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, line, branches) of every function in ``tree``, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, FUNCTIONS):
            name = f"{prefix}{node.name}"
            yield name, node.lineno, branches(node.body)
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_passes_700_lines():
    long = [
        f"{path.relative_to(PACKAGE.parent)}: {lines} lines"
        for path in _modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    ]
    assert long == [], f"modules over {MAX_LINES} lines (split them by concern):\n" + "\n".join(
        long
    )


def test_no_function_passes_20_branches():
    tangled = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {name}: {count} branches"
        for path in _modules()
        for name, line, count in functions(ast.parse(path.read_text(encoding="utf-8")))
        if count > MAX_BRANCHES
    ]
    assert tangled == [], (
        f"functions over {MAX_BRANCHES} branches (split them into named steps):\n"
        + "\n".join(tangled)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(x):\n    return x\n", 0),
        ("def f(x):\n    if x:\n        pass\n", 1),
        ("def f(x):\n    if x:\n        pass\n    else:\n        pass\n", 2),
        ("def f(x):\n    if x:\n        pass\n    elif x > 1:\n        pass\n"
         "    elif x > 2:\n        pass\n    else:\n        pass\n", 4),
        ("def f(x):\n    for i in x:\n        if i:\n            break\n    else:\n"
         "        pass\n", 3),
        ("def f(x):\n    while x:\n        x -= 1\n", 1),
        ("def f(x):\n    try:\n        if x:\n            pass\n    except ValueError:\n"
         "        pass\n    except KeyError:\n        pass\n    else:\n        pass\n"
         "    finally:\n        pass\n", 5),
        ("def f(x):\n    with x:\n        if x:\n            pass\n", 1),
        ("def f(x):\n    match x:\n        case 1:\n            pass\n        case _:\n"
         "            pass\n", 2),
        ("def f(x):\n    def g():\n        if x:\n            pass\n"
         "    return [y for y in x if y]\n", 0),
    ],
)  # fmt: skip
def test_the_branch_count_follows_its_rule(source, expected):
    (name, _, count), *_ = functions(ast.parse(source))
    assert (name, count) == ("f", expected)


def test_the_checks_see_the_package():
    found = {name: count for path in _modules() for name, _, count in functions(ast.parse(
        path.read_text(encoding="utf-8")))}  # fmt: skip
    assert len(found) > 500
    assert max(found.values()) > 5


def _step_modules(micro_batches: int) -> set[str]:
    """The avionics/step modules whose code runs in one tracked step of ``micro_batches``."""
    import sys

    import torch

    from avionics import Cockpit, quantities
    from tests import models

    model, X, y, loss_fn = models.mlp(n=6)
    cockpit = Cockpit(model, [quantities.Loss(), quantities.GradNorm(), quantities.NormTest()])
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and (path := Path(frame.f_code.co_filename)).parent == PACKAGE / "step":
            seen.add(path.stem)

    sys.setprofile(profile)
    try:
        for i, (Xi, yi) in enumerate(zip(X.chunk(micro_batches), y.chunk(micro_batches))):
            losses = loss_fn(model(Xi), yi)
            info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(yi)}
            with cockpit(0, info, micro_batch=i, micro_batches=micro_batches):
                (losses.mean() / micro_batches).backward()
    finally:
        sys.setprofile(None)
    assert torch.isfinite(torch.tensor(cockpit.get_output()[0]["NormTest"]))
    return seen


def test_a_plain_step_runs_no_accumulation_or_data_parallel_code():
    plain = _step_modules(micro_batches=1)
    assert {"checks", "batch", "compute", "output"} <= plain
    assert plain.isdisjoint({"accumulation", "parallel"})
    assert "accumulation" in _step_modules(micro_batches=2)
