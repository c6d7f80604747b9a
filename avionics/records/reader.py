"""Reading a run log back: every readable step, and a list of what could not be read."""

from __future__ import annotations

import os
from pathlib import Path

from avionics.records.encoding import decode_line
from avionics.records.export import read_cockpit_json
from avionics.records.run import Run
from avionics.records.writer import LOG_FORMAT, LOG_FORMAT_VERSION, log_file

NO_RECORDS = "the log holds no records (the file is empty or only whitespace)"


def _metadata_problem(metadata: dict, number: int, file: Path | None) -> str | None:
    """What is wrong with the session metadata on line ``number``, or None; raises
    ``ValueError`` for a log format newer than this avionics reads."""
    if metadata.get("format") != LOG_FORMAT:
        return f"line {number}: metadata of an unknown log format"
    version = metadata.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return f"line {number}: metadata with an unknown format_version {version!r}"
    if version > LOG_FORMAT_VERSION:
        raise ValueError(
            f"{file} line {number}: the log has format_version {version}, newer than the "
            f"format_version {LOG_FORMAT_VERSION} this avionics reads: upgrade avionics "
            "to read it."
        )
    return None


def _not_a_step_record(record: dict) -> str | None:
    """Why ``record`` is not a step record (``{"step": t, "values": {...}}`` with ``t`` a
    non-negative int), or None when it is one."""
    step = record.get("step")
    if "step" not in record or not isinstance(record.get("values"), dict):
        return "expected keys 'metadata', or 'step' and 'values'"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"its step {step!r} is not a non-negative int"
    return None


def _parse(lines: list[bytes], run: Run) -> None:
    session_of_step: dict[int, int] = {}
    rewritten: dict[int, list[int]] = {}
    last = len(lines)
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = decode_line(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            if number == last:
                run.problems.append(
                    f"line {number}: truncated last line (the writer stopped in the middle "
                    "of it, e.g. it was killed); ignored"
                )
            else:
                run.problems.append(f"line {number}: not valid JSON ({error}); ignored")
            continue
        if "metadata" in record and isinstance(record["metadata"], dict):
            problem = _metadata_problem(record["metadata"], number, run.path)
            run.sessions.append(dict(record["metadata"]))
            if problem is not None:
                run.problems.append(problem)
        elif "metadata_update" in record and isinstance(record["metadata_update"], dict):
            if not run.sessions:
                run.sessions.append({})
            run.sessions[-1].update(record["metadata_update"])
        elif (reason := _not_a_step_record(record)) is not None:
            run.problems.append(
                f"line {number}: a JSON object that is neither metadata nor a step record "
                f"({reason}); ignored"
            )
        else:
            step, session = record["step"], len(run.sessions)
            if session_of_step.setdefault(step, session) != session:
                rewritten.setdefault(session, []).append(step)
                session_of_step[step] = session
            run.steps.setdefault(step, {}).update(record["values"])
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

    Unreadable lines (a truncated last line after a crash, corrupt lines, records whose step
    is not a non-negative int) do not fail the read: they are skipped and reported in
    ``run.problems`` with their line numbers; so is an empty log (:data:`NO_RECORDS`). A log
    written in a newer format than :data:`~avionics.records.writer.LOG_FORMAT_VERSION` raises
    ``ValueError`` (upgrade avionics to read it).
    """
    file = log_file(path)  # checks that path is a path
    if Path(path).suffix == ".json":
        return read_cockpit_json(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"no run log at {file}: pass a run directory holding {file.name} (as written by "
            "Cockpit(..., log=DIR)) or the path of a .jsonl log."
        )
    run = Run(path=file)
    content = file.read_bytes()
    if not content.strip():
        run.problems.append(NO_RECORDS)
    _parse(content.split(b"\n"), run)
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
