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

One writer at a time: a ``RunWriter`` holds an exclusive advisory lock (``flock``) on the log
file while it is open, so a second writer of the same log, in this or another process, is
refused; the operating system releases the lock when the writer closes or its process dies.
Without ``fcntl`` (not POSIX, e.g. Windows) the log is written without a lock.

A log that cannot be written (disk full, quota exceeded, any ``OSError``) does not stop
training: the writer warns once, keeps the unwritten lines in memory, in order, and writes
them before the next line at every later write and at ``close()``.

Non-finite floats are encoded as described in :mod:`avionics.records.encoding`.
"""

from __future__ import annotations

import errno
import os
import time
import warnings
import weakref
from collections import deque
from pathlib import Path

from avionics.records.encoding import decode_line, encode_line, to_plain

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks, the log is written without one
    fcntl = None

LOG_FORMAT = "avionics-log"
LOG_FORMAT_VERSION = 1
LOG_FILE_NAME = "log.jsonl"
EXIST_MODES = ("append", "error")


def log_file(path: str | os.PathLike) -> Path:
    """The log file of a run: ``path`` itself if it ends in ``.jsonl``, else ``path/log.jsonl``.

    Raises ``TypeError`` when ``path`` is not a path and ``ValueError`` when it is blank (an
    empty path would silently mean the current directory)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"path must be a run directory path (str or os.PathLike), got {path!r} of type "
            f"{type(path).__name__}: pass a directory such as 'runs/exp1' (Cockpit's log=), "
            "or a .jsonl log file."
        )
    if isinstance(path, str) and not path.strip():
        raise ValueError(
            f"path is {path!r}, an empty path: pass a run directory such as 'runs/exp1' "
            "(Cockpit's log=), or a .jsonl log file."
        )
    path = Path(path)
    return path if path.suffix == ".jsonl" else path / LOG_FILE_NAME


def _checked_log_file(path: str | os.PathLike) -> Path:
    """The log file of ``path`` (see :func:`log_file`), after checking that it is not a
    directory and that its folder is not a file."""
    file = log_file(path)
    if file.is_dir():
        raise IsADirectoryError(
            f"{file} is a directory, not a log file: pass a run directory (its log is "
            f"DIR/{LOG_FILE_NAME}) or the path of a .jsonl file that is not a directory."
        )
    if file.parent.is_file():
        raise NotADirectoryError(
            f"{file.parent} is a file, not a run directory: pass a directory (the log is "
            f"written to DIR/{LOG_FILE_NAME}) or a .jsonl log file."
        )
    return file


def _check_is_log(file: Path) -> None:
    """Check that the non-empty ``file`` starts with the metadata of a log this avionics
    writes (the format, at a version no newer than :data:`LOG_FORMAT_VERSION`)."""
    with open(file, "rb") as f:
        first_line = f.readline()
    try:
        metadata = decode_line(first_line.decode("utf-8")).get("metadata", {})
        is_log = metadata.get("format") == LOG_FORMAT
    except (ValueError, UnicodeDecodeError, AttributeError):
        is_log = False
    if not is_log:
        raise ValueError(
            f"{file} exists but is not an avionics log (its first line is not avionics "
            "metadata); refusing to append to it. Choose another run path."
        )
    version = metadata.get("format_version")
    if isinstance(version, int) and version > LOG_FORMAT_VERSION:
        raise ValueError(
            f"{file} was written by a newer avionics (log format_version {version}; this "
            f"avionics writes format_version {LOG_FORMAT_VERSION}): upgrade avionics to append "
            "to it, or choose another run path."
        )


def _lacks_final_newline(file: Path) -> bool:
    """Whether the non-empty ``file`` ends in the middle of a line (a writer was killed)."""
    with open(file, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _open_for_append(file: Path):
    """``file`` opened unbuffered for appending, creating its folders; a folder on the path
    that is a file, or a permission denied, raises an error naming the path and what to do."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        return open(file, "ab", buffering=0)
    except NotADirectoryError as error:  # a folder further up the path is a file
        raise NotADirectoryError(
            f"cannot create the run log {file}: a folder on that path is a file. Pass a run "
            "directory (or .jsonl file) whose path goes through directories only."
        ) from error
    except PermissionError as error:
        raise PermissionError(
            f"cannot open the run log {file} for writing: permission denied on "
            f"{error.filename}. Pass a run directory you may write to, or change its permissions."
        ) from error


def _lock(file, path: Path) -> None:
    """Take the exclusive advisory lock of the open log ``file`` (at ``path``), or refuse."""
    if fcntl is None:
        return
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as error:
        raise RuntimeError(
            f"another live process (or another open RunWriter) is writing the log {path}. "
            "Choose another run path, or stop the other process (close its writer) first."
        ) from error
    except OSError as error:  # a file system without flock: write, but say it is unguarded
        warnings.warn(
            f"cannot lock the run log {path} ({error}); writing it unlocked: make sure no "
            "other process writes the same log.",
            stacklevel=3,
        )


_OPEN_WRITERS: weakref.WeakSet = weakref.WeakSet()


def _close_in_child() -> None:
    """In a forked child (a DataLoader worker): close the inherited log files without
    unlocking them, so that the lock stays with the parent alone and ends with its writer."""
    for writer in list(_OPEN_WRITERS):
        if writer._file is not None:
            writer._file.close()
            writer._file = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


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

    Every argument is checked before anything is created. While open, the writer holds the
    log's lock (see the module's description): a second writer of the same log raises
    ``RuntimeError``. A write the operating system refuses (``OSError``: disk full, quota)
    warns once and keeps the line in memory until a later write or ``close()`` gets it out;
    lines stay whole and in order, and the memory held grows until they do.
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
        if not isinstance(metadata, dict):
            raise TypeError(
                f"metadata must be a dict of JSON-ready values, got a {type(metadata).__name__}."
            )
        file = _checked_log_file(path)
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
        self.path = file
        self._fsync = fsync
        self._pending: deque[bytes] = deque()  # lines not yet (fully) written, oldest first
        self._pending_sent = 0  # bytes of the oldest pending line already written
        self._error: OSError | None = None  # what stopped the last write, while it lasts
        # the folders and an empty file are created only where the log did not exist: every
        # check that can refuse below applies to a log that was already there
        self._file = _open_for_append(file)
        try:
            _lock(self._file, file)
            if file.stat().st_size > 0:  # read under the lock: no writer is appending now
                if exist == "error":
                    raise FileExistsError(
                        f"{file} already holds a run. Pass exist='append' to continue it, "
                        "or choose a new run path."
                    )
                _check_is_log(file)
                if _lacks_final_newline(file):  # end a line cut short by a crash
                    header = b"\n" + header
        except BaseException:
            self._file.close()
            raise
        _OPEN_WRITERS.add(self)
        # the lines that start a recreated log (see _follow_deletion)
        self._header = [header.lstrip(b"\n")]
        self._append(header)

    def write(self, step: int, values: dict) -> None:
        """Append the values of ``step`` (all of them, or some that arrived late)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be a non-negative int, got {step!r}.")
        if not isinstance(values, dict):
            raise TypeError(f"values must be a dict of name -> value, got {type(values)}.")
        self._append(encode_line({"step": step, "values": to_plain(values, "values")}))

    def update_metadata(self, metadata: dict) -> None:
        """Append metadata learnt after the start (merged into this session's metadata)."""
        if not isinstance(metadata, dict):
            raise TypeError(
                f"metadata must be a dict of JSON-ready values, got a {type(metadata).__name__}."
            )
        line = encode_line({"metadata_update": metadata})
        self._header.append(line)
        self._append(line)

    def close(self) -> None:
        """Write what is still held in memory, close the log file (releasing its lock);
        further writes raise. Lines that still cannot be written are lost, with a warning."""
        if self._file is None:
            return
        self._drain(closing=True)
        try:
            self._file.close()
        except OSError as error:  # e.g. a network file system reporting a late write error
            warnings.warn(f"closing the run log {self.path} failed: {error}.", stacklevel=2)
        self._file = None

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _append(self, line: bytes) -> None:
        """Queue ``line`` after the lines held back, and write them all."""
        if self._file is None:
            raise ValueError(f"the log {self.path} is closed; open a new RunWriter to append.")
        self._pending.append(line)
        self._drain(closing=False)

    def _drain(self, closing: bool) -> None:
        """Write the pending lines; warn when writing stops, when it works again, and when
        ``closing`` loses lines."""
        held = len(self._pending)
        error = self._write_pending()
        if error is not None and closing:
            cut = "; its last line is cut short" if self._pending_sent else ""
            warnings.warn(
                f"the run log {self.path} is closed with {len(self._pending)} record(s) that "
                f"could not be written ({error}): they are lost{cut}.",
                stacklevel=3,
            )
        elif error is not None and self._error is None:
            warnings.warn(
                f"cannot write the run log {self.path}: {error}. Training goes on; the "
                "unwritten records are kept in memory, in order, and written at the next "
                "write or at close().",
                stacklevel=4,
            )
        elif error is None and self._error is not None:
            warnings.warn(
                f"the run log {self.path} is written again: the {held} record(s) held in "
                f"memory since the error ({self._error}) are now in it, in order.",
                stacklevel=4,
            )
        self._error = error

    def _follow_deletion(self) -> None:
        """Where the log file (or its folder) was deleted while open, recreate it, with its
        metadata lines first, and write there from now on, with a warning: the open file,
        unlinked, would take every later line unseen. Raises the OSError of a recreation
        that fails (the lines are then held in memory, as for a full disk)."""
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            on_disk = None
        opened = os.fstat(self._file.fileno())
        if on_disk is not None and (on_disk.st_ino, on_disk.st_dev) == (
            opened.st_ino,
            opened.st_dev,
        ):
            return
        file = _open_for_append(self.path)
        _lock(file, self.path)
        self._file.close()
        self._file = file
        self._pending.extendleft(reversed(self._header))  # whole lines, in the new file
        self._pending_sent = 0
        warnings.warn(
            f"the run log {self.path} was deleted while the run wrote it (its file or folder "
            "was removed): recreated it, with the run's metadata; the records written before "
            "the deletion are lost with it, the later ones are written there. Keep the run "
            "directory until training ends.",
            stacklevel=5,
        )

    def _write_pending(self) -> OSError | None:
        """Write the pending lines in order, finishing a line cut short by a short write or
        an error; return the ``OSError`` that stopped it (those lines stay pending), or None."""
        try:
            self._follow_deletion()
            while self._pending:
                line = self._pending[0]
                written = self._file.write(memoryview(line)[self._pending_sent :])
                if not written:  # no progress (0, or None: would block): retry later, no spin
                    raise BlockingIOError(errno.EAGAIN, "the log file took no bytes")
                self._pending_sent += written
                if self._pending_sent == len(line):
                    self._pending.popleft()
                    self._pending_sent = 0
            if self._fsync:
                os.fsync(self._file.fileno())
        except OSError as error:
            return error
        return None
