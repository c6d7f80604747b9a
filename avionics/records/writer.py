"""The crash-safe, append-only run log.

On disk a run is a directory holding ``log.jsonl`` (or any file named ``*.jsonl``): one JSON
object per line, each line written with a single unbuffered ``write`` as soon as its values are
known, so that a killed process loses at most the line being written. The lines are:

* ``{"metadata": {...}}`` -- first line of every session (a session is one ``RunWriter``):
  the log format, its version, the time, and what the caller passed (versions, model,
  quantities and their schedules, optimizer);
* ``{"metadata_update": {...}}`` -- metadata learnt later (e.g. the optimizer at the first
  step); it is merged into the session's metadata;
* ``{"step": t, "values": {...}}`` -- values of step t. A step may have several records (the
  values of two-step quantities arrive one step later; ``cockpit.log`` adds metrics); readers
  merge them, later values winning.

Non-finite floats are encoded as described in :mod:`avionics.records.encoding`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from avionics.records.encoding import decode_line, encode_line, to_plain

LOG_FORMAT = "avionics-log"
LOG_FORMAT_VERSION = 1
LOG_FILE_NAME = "log.jsonl"
EXIST_MODES = ("append", "error")


def log_file(path: str | os.PathLike) -> Path:
    """The log file of a run: ``path`` itself if it ends in ``.jsonl``, else ``path/log.jsonl``."""
    path = Path(path)
    return path if path.suffix == ".jsonl" else path / LOG_FILE_NAME


def _check_appendable(file: Path) -> bool:
    """Check that ``file`` is an avionics log; return whether it lacks a final newline."""
    with open(file, "rb") as f:
        first_line = f.readline()
        f.seek(-1, os.SEEK_END)
        ends_with_newline = f.read(1) == b"\n"
    try:
        record = decode_line(first_line.decode("utf-8"))
        is_log = record.get("metadata", {}).get("format") == LOG_FORMAT
    except (ValueError, UnicodeDecodeError, AttributeError):
        is_log = False
    if not is_log:
        raise ValueError(
            f"{file} exists but is not an avionics log (its first line is not avionics "
            "metadata); refusing to append to it. Choose another run path."
        )
    return not ends_with_newline


class RunWriter:
    """Appends the records of one training session to a run's log.

    Args:
        path: the run directory (the log is ``path/log.jsonl``) or a ``.jsonl`` file.
        metadata: JSON-ready description of the session, written as the first record.
        exist: what to do when the run already has a log: ``"append"`` continues it (a new
            session), ``"error"`` refuses. A log is never overwritten.
        fsync: also force every line to disk (survives a power cut, costs a disk sync per
            line). Without it each line is handed to the operating system at once, which
            survives the process being killed.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        metadata: dict,
        exist: str = "append",
        fsync: bool = False,
    ):
        if exist not in EXIST_MODES:
            raise ValueError(f"exist must be one of {EXIST_MODES}, got {exist!r}.")
        self.path = log_file(path)
        self._fsync = fsync
        header = encode_line(
            {
                "metadata": {
                    "format": LOG_FORMAT,
                    "format_version": LOG_FORMAT_VERSION,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    **metadata,
                }
            }
        )
        repair_newline = False
        if self.path.exists() and self.path.stat().st_size > 0:
            if exist == "error":
                raise FileExistsError(
                    f"{self.path} already holds a run. Pass exist='append' to continue it, "
                    "or choose a new run path."
                )
            repair_newline = _check_appendable(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab", buffering=0)
        if repair_newline:  # end a line cut short by a crash, so it stays a separate line
            self._file.write(b"\n")
        self._write_bytes(header)

    def _write_bytes(self, line: bytes) -> None:
        if self._file is None:
            raise ValueError(f"the log {self.path} is closed; open a new RunWriter to append.")
        self._file.write(line)
        if self._fsync:
            os.fsync(self._file.fileno())

    def write(self, step: int, values: dict) -> None:
        """Append the values of ``step`` (all of them, or some that arrived late)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be a non-negative int, got {step!r}.")
        if not isinstance(values, dict):
            raise TypeError(f"values must be a dict of name -> value, got {type(values)}.")
        self._write_bytes(encode_line({"step": step, "values": to_plain(values, "values")}))

    def update_metadata(self, metadata: dict) -> None:
        """Append metadata learnt after the start (merged into this session's metadata)."""
        self._write_bytes(encode_line({"metadata_update": metadata}))

    def close(self) -> None:
        """Close the log file; further writes raise."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
