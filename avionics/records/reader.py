"""Reading a run log back: every readable step, and a list of what could not be read."""

from __future__ import annotations

import os
from pathlib import Path

from avionics.records.encoding import decode_line
from avionics.records.export import read_cockpit_json
from avionics.records.run import Run
from avionics.records.writer import LOG_FORMAT, log_file


def _parse(lines: list[bytes], run: Run) -> None:
    session_of_step: dict[int, int] = {}
    rewritten: dict[int, list[int]] = {}
    last = len(lines)
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = decode_line(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            if number == last:
                run.problems.append(
                    f"line {number}: truncated last line (the writer stopped in the middle "
                    "of it, e.g. it was killed); ignored"
                )
            else:
                run.problems.append(f"line {number}: not valid JSON ({error}); ignored")
            continue
        if "metadata" in record and isinstance(record["metadata"], dict):
            run.sessions.append(dict(record["metadata"]))
            if record["metadata"].get("format") != LOG_FORMAT:
                run.problems.append(f"line {number}: metadata of an unknown log format")
        elif "metadata_update" in record and isinstance(record["metadata_update"], dict):
            if not run.sessions:
                run.sessions.append({})
            run.sessions[-1].update(record["metadata_update"])
        elif isinstance(record.get("step"), int) and isinstance(record.get("values"), dict):
            step, session = record["step"], len(run.sessions)
            if session_of_step.setdefault(step, session) != session:
                rewritten.setdefault(session, []).append(step)
                session_of_step[step] = session
            run.steps.setdefault(step, {}).update(record["values"])
        else:
            run.problems.append(
                f"line {number}: a JSON object that is neither metadata nor a step record "
                "(expected keys 'metadata', or 'step' and 'values'); ignored"
            )
        if number == 1 and "metadata" not in record:
            run.problems.append("line 1: no metadata line; is this an avionics log?")
    for session, steps in rewritten.items():
        run.problems.append(
            f"session {session} rewrote {len(steps)} step(s) already in the log "
            f"(steps {steps[0]}..{steps[-1]}); the later values are kept"
        )


def read_run(path: str | os.PathLike) -> Run:
    """Read a run log (a run directory, or its ``.jsonl`` file), or a ``.json`` log of the
    reference Cockpit tool.

    Unreadable lines (a truncated last line after a crash, corrupt lines) do not fail the
    read: they are skipped and reported in ``run.problems`` with their line numbers.
    """
    if Path(path).suffix == ".json":
        return read_cockpit_json(path)
    file = log_file(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"no run log at {file}: pass a run directory holding {file.name} (as written by "
            "Cockpit(..., log=DIR)) or the path of a .jsonl log."
        )
    run = Run(path=file)
    _parse(file.read_bytes().split(b"\n"), run)
    run.steps = dict(sorted(run.steps.items()))
    run.metadata = dict(run.sessions[0]) if run.sessions else {}
    return run


def as_run(source) -> Run:
    """A :class:`Run` from a ``Run``, anything with ``get_output()`` (a live ``Cockpit``),
    or the path of a run log."""
    if isinstance(source, Run):
        return source
    if hasattr(source, "get_output"):
        return Run.from_output(source.get_output(), getattr(source, "metadata", None))
    if isinstance(source, (str, os.PathLike)):
        return read_run(source)
    raise TypeError(
        f"Cannot draw or diagnose a {type(source).__name__}: pass a run directory or log "
        "path, a Run from avionics.read_run, or a Cockpit."
    )
