"""A finding of the diagnosis: what was found, the numbers it rests on, what to try."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    """One diagnosis.

    Attributes:
        check: the name of the check that found it (e.g. ``"step_size_too_large"``).
        title: the finding, in one line of plain language.
        evidence: the numbers it rests on, and where in the run.
        advice: what to try.
        step: the step where it began or was measured, when there is one.
    """

    check: str
    title: str
    evidence: str
    advice: str
    step: int | None = None

    def to_dict(self) -> dict:
        """The finding as a JSON-ready dict."""
        return asdict(self)

    def __str__(self) -> str:
        wrap = textwrap.TextWrapper(width=92, initial_indent="  ", subsequent_indent="  ")
        return "\n".join(
            [
                f"* {self.title}",
                wrap.fill(f"Evidence: {self.evidence}"),
                wrap.fill(f"Try: {self.advice}"),
            ]
        )
