"""The source text: no control characters other than newline in files or docstrings.

A control character in a docstring usually comes from an escape in a non-raw string
(``"\\beta"`` is a backspace and "eta"): it reads as garbage in ``help()`` and the docs.
"""

from __future__ import annotations

import ast
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SOURCE_FOLDERS = ("avionics", "tests", "benchmarks")
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _python_files(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


def control_characters(text: str) -> list[tuple[int, str]]:
    """(line number, repr of the character) of every control character but newline."""
    return [
        (number, repr(character))
        for number, line in enumerate(text.split("\n"), start=1)
        for character in line
        if unicodedata.category(character) == "Cc"
    ]


def docstrings(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, name, evaluated docstring, not cleaned: tabs kept) of every documented node."""
    return [
        (getattr(node, "lineno", 1), getattr(node, "name", "<module>"), docstring)
        for node in ast.walk(tree)
        if isinstance(node, DOCUMENTED)
        and (docstring := ast.get_docstring(node, clean=False)) is not None
    ]


def test_the_source_files_have_no_control_characters():
    files = _python_files(*SOURCE_FOLDERS)
    assert files
    found = [
        f"{path.relative_to(ROOT)}:{line}: {character}"
        for path in files
        for line, character in control_characters(path.read_text(encoding="utf-8"))
    ]
    assert not found, "control characters in the source:\n" + "\n".join(found)


def test_the_package_docstrings_have_no_control_characters():
    found = []
    for path in _python_files("avionics"):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name, docstring in docstrings(tree):
            characters = sorted({c for _, c in control_characters(docstring)})
            if characters:
                found.append(f"{path.relative_to(ROOT)}:{line} {name}: {', '.join(characters)}")
    assert not found, "control characters in docstrings:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [('def f():\n    """\\beta"""\n', ["'\\x08'"]),
     ('r"""\\beta"""\n', []),
     ('class C:\n    """a\tb"""\n', ["'\\t'"])],
)  # fmt: skip
def test_the_check_sees_escapes_evaluated_in_docstrings(source, expected):
    (docstring,) = [d for _, _, d in docstrings(ast.parse(source))]
    assert [c for _, c in control_characters(docstring)] == expected


def test_every_public_quantity_and_operator_class_states_its_own_docstring():
    import inspect

    import avionics.curvature
    import avionics.quantities

    missing = [
        f"{module.__name__}.{name}"
        for module in (avionics.quantities, avionics.curvature)
        for name in module.__all__
        if inspect.isclass(obj := getattr(module, name)) and not obj.__dict__.get("__doc__")
    ]
    assert missing == []
