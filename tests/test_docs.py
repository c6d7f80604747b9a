"""The README's quantity table and the docs/ pages it points to agree with the code."""

import re
from pathlib import Path

from avionics.configurations import PRESETS, TRANSFORMER_SPARSE
from avionics.quantities import BUILTIN

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
LETTERS = {"economy": "E", "business": "B", "full": "F", "transformer": "T"}


def table_presets() -> dict[str, set[str]]:
    """{quantity: the presets of its row} from the README's quantity table."""
    rows = {}
    for line in README.splitlines():
        row = re.fullmatch(r"\| `(\w+)` \|.*\|([EBFT\\* ]*)\|", line)
        if row:
            rows[row[1]] = set(row[2].replace("\\", "").split())
    return rows


def test_the_quantity_table_lists_every_quantity_with_its_presets():
    expected = {}
    for cls in BUILTIN:
        expected[cls.__name__] = {
            LETTERS[label] + ("*" if label == "transformer" and cls in TRANSFORMER_SPARSE else "")
            for label, members in PRESETS.items()
            if cls in members
        }
    assert table_presets() == expected


def test_every_docs_link_of_the_readme_and_the_docs_leads_to_a_section():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    links = 0
    for page in pages:
        for target, anchor in re.findall(
            r"\]\(((?:docs/)?\w+\.md)(?:#([\w-]+))?\)", page.read_text()
        ):
            linked = (page.parent / target).resolve()
            assert linked.is_file(), (page.name, target)
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
                assert anchor in slugs, (page.name, target, anchor)
            links += 1
    assert links >= 10
