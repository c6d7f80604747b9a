"""Write one benchmark's results into its own section of BENCHMARKS.md.

Each benchmark script owns the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``
and rewrites only that, so scripts can run in any order and never clobber each other.
"""

from __future__ import annotations

import platform
import re
import time
from pathlib import Path

import torch

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def machine() -> str:
    """One line naming the machine and the versions, for the top of a section."""
    threads = torch.get_num_threads()
    return (
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {threads} "
        f"thread{'s' if threads > 1 else ''}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, markdown: str) -> None:
    """Replace (or append) the section NAME of BENCHMARKS.md with MARKDOWN."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)
