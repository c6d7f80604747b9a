"""The run log survives misuse and a full disk: newer formats and bad records are named, an
empty log is reported, a second writer is refused, a refused write loses nothing, and bad
paths are refused before anything is created."""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from avionics import Cockpit
from avionics.cli import main
from avionics.dashboard import plot
from avionics.diagnosis import diagnose, report
from avionics.records import RunWriter, read_run, to_csv
from avionics.records.encoding import encode_line
from avionics.records.reader import NO_RECORDS
from avionics.records.writer import LOG_FORMAT, LOG_FORMAT_VERSION, fcntl, log_file

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 120  # the bound on a child python importing torch, on a loaded machine


def write_log(file: Path, *records: dict) -> bytes:
    """Write ``records`` as a log's lines; return the bytes written."""
    file.parent.mkdir(parents=True, exist_ok=True)
    content = b"".join(encode_line(record) for record in records)
    file.write_bytes(content)
    return content


def header(version=LOG_FORMAT_VERSION) -> dict:
    return {"metadata": {"format": LOG_FORMAT, "format_version": version}}


def lines_of(file: Path) -> list[dict]:
    """Every line of ``file`` as strict JSON (fails on a cut or merged line)."""
    return [json.loads(line) for line in file.read_text().splitlines()]


# ---------------------------------------------------------------- 1. the format version
@pytest.mark.parametrize("newer_session", [1, 2])
def test_a_newer_format_version_is_refused_naming_both_versions(tmp_path, newer_session):
    sessions = [header(), header()]
    sessions[newer_session - 1] = header(LOG_FORMAT_VERSION + 1)
    file = tmp_path / "run" / "log.jsonl"
    content = write_log(file, sessions[0], {"step": 0, "values": {"Loss": 1.0}}, sessions[1])
    found = rf"format_version {LOG_FORMAT_VERSION + 1}, newer than"
    reads = rf"format_version {LOG_FORMAT_VERSION} this avionics reads: upgrade avionics"
    with pytest.raises(ValueError, match=f"{found}.*{reads}"):
        read_run(tmp_path / "run")
    with pytest.raises(ValueError, match=f"{found}.*{reads}"):
        diagnose(tmp_path / "run")
    assert file.read_bytes() == content


def test_the_writer_refuses_to_append_to_a_newer_format(tmp_path):
    file = tmp_path / "run" / "log.jsonl"
    content = write_log(file, header(LOG_FORMAT_VERSION + 1))
    with pytest.raises(ValueError, match=rf"format_version {LOG_FORMAT_VERSION + 1}.*upgrade"):
        RunWriter(tmp_path / "run", {})
    assert file.read_bytes() == content


@pytest.mark.parametrize("version", ["2", None, 0, True, 1.5])
def test_an_unknown_format_version_is_reported(tmp_path, version):
    file = tmp_path / "run.jsonl"
    write_log(file, header(version), {"step": 0, "values": {"Loss": 1.0}})
    run = read_run(file)
    assert run.steps == {0: {"Loss": 1.0}}
    assert run.problems == [f"line 1: metadata with an unknown format_version {version!r}"]


# ---------------------------------------------------------------- 2. the step of a record
@pytest.mark.parametrize("step", [True, False, 1.0, "1", -1, None, [1]])
def test_a_record_whose_step_is_not_a_non_negative_int_is_skipped_and_named(tmp_path, step):
    file = tmp_path / "run.jsonl"
    write_log(
        file,
        header(),
        {"step": 0, "values": {"Loss": 3.0}},
        {"step": step, "values": {"Loss": 99.0}},
        {"step": 1, "values": {"Loss": 2.0}},
    )
    run = read_run(file)
    assert run.steps == {0: {"Loss": 3.0}, 1: {"Loss": 2.0}}
    assert run.problems == [
        "line 3: a JSON object that is neither metadata nor a step record "
        f"(its step {step!r} is not a non-negative int); ignored"
    ]


# ---------------------------------------------------------------- 3. an empty log
@pytest.mark.parametrize("content", [b"", b"\n", b"  \n\t\n \n"])
def test_an_empty_log_is_reported_and_every_reader_copes(tmp_path, capsys, content):
    file = tmp_path / "run" / "log.jsonl"
    file.parent.mkdir()
    file.write_bytes(content)
    run = read_run(tmp_path / "run")
    assert (run.steps, run.metadata, run.sessions) == ({}, {}, [])
    assert run.problems == [NO_RECORDS]
    assert diagnose(run) == []
    assert NO_RECORDS in report(run)
    plot(run, tmp_path / "cockpit.png")
    to_csv(run, tmp_path / "log.csv")
    assert (tmp_path / "log.csv").read_text().strip() == "step"
    # the command line refuses it in one line that quotes the problem
    assert main(["diagnose", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert NO_RECORDS in err and len(err.strip().splitlines()) == 1
    assert file.read_bytes() == content


def test_a_log_with_metadata_and_no_steps_is_not_empty(tmp_path):
    RunWriter(tmp_path / "run", {}).close()
    assert read_run(tmp_path / "run").problems == []


# ---------------------------------------------------------------- 4. one writer at a time
needs_flock = pytest.mark.skipif(fcntl is None, reason="no fcntl: the log is not locked")

HOLDER = textwrap.dedent(
    """
    import sys
    from avionics.records import RunWriter

    with RunWriter(sys.argv[1], {"writer": "other"}) as writer:
        writer.write(0, {"Loss": 1.0})
        print("open", flush=True)
        sys.stdin.read()  # hold the log until the test closes our stdin
    """
)


def start_holder(path: Path) -> subprocess.Popen:
    """A second python process holding a RunWriter of ``path`` open."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    ready, _, _ = select.select([process.stdout], [], [], STARTUP_S)
    if not ready or process.stdout.readline() != "open\n":
        process.kill()
        pytest.fail("the holder process did not open its writer")
    return process


@needs_flock
def test_a_log_held_by_another_process_is_refused_until_it_closes(tmp_path):
    process = start_holder(tmp_path / "run")
    try:
        before = log_file(tmp_path / "run").read_bytes()
        with pytest.raises(RuntimeError, match=r"another live process.*run/log\.jsonl.*another"):
            RunWriter(tmp_path / "run", {"writer": "this"})
        assert log_file(tmp_path / "run").read_bytes() == before
        process.stdin.close()  # the holder closes its writer and ends
        assert process.wait(timeout=STARTUP_S) == 0
    finally:
        process.kill()
    with RunWriter(tmp_path / "run", {"writer": "this"}) as writer:
        writer.write(1, {"Loss": 0.5})
    run = read_run(tmp_path / "run")
    assert [s["writer"] for s in run.sessions] == ["other", "this"]
    assert run.steps == {0: {"Loss": 1.0}, 1: {"Loss": 0.5}}


@needs_flock
def test_the_lock_dies_with_its_process(tmp_path):
    process = start_holder(tmp_path / "run")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=STARTUP_S)
    with RunWriter(tmp_path / "run", {"writer": "this"}) as writer:
        writer.write(1, {"Loss": 0.5})
    assert read_run(tmp_path / "run").steps == {0: {"Loss": 1.0}, 1: {"Loss": 0.5}}


@needs_flock
def test_a_second_writer_in_the_same_process_is_refused(tmp_path):
    with RunWriter(tmp_path / "run", {}) as writer:
        writer.write(0, {"Loss": 1.0})
        before = log_file(tmp_path / "run").read_bytes()
        with pytest.raises(RuntimeError, match="another open RunWriter"):
            RunWriter(tmp_path / "run", {}, exist="error")
        with pytest.raises(RuntimeError, match="another open RunWriter"):
            Cockpit(torch.nn.Linear(2, 1), log=tmp_path / "run")
        assert log_file(tmp_path / "run").read_bytes() == before
    RunWriter(tmp_path / "run", {}).close()  # closed: the lock is free again


# ---------------------------------------------------------------- 5. short writes, full disk
class FlakyFile:
    """The log's file, whose successive writes follow ``script``: an int n writes only the
    first n bytes, an OSError is raised, None writes everything (also once it runs out)."""

    def __init__(self, file, script):
        self.file, self.script = file, list(script)

    def write(self, data) -> int:
        action = self.script.pop(0) if self.script else None
        if isinstance(action, OSError):
            raise action
        return self.file.write(bytes(data)[:action])

    def __getattr__(self, name):
        return getattr(self.file, name)


def flaky(writer: RunWriter, script) -> FlakyFile:
    writer._file = FlakyFile(writer._file, script)
    return writer._file


def disk_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def messages(caught) -> list[str]:
    return [str(w.message) for w in caught]


def test_short_writes_are_finished_in_place(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with RunWriter(tmp_path / "run", {}) as writer:
            flaky(writer, [1, 5, 2, 3] * 20)
            for step in range(6):
                writer.write(step, {"Loss": float(step)})
    assert [r["step"] for r in lines_of(log_file(tmp_path / "run"))[1:]] == list(range(6))
    assert read_run(tmp_path / "run").problems == []


def test_a_write_that_takes_no_bytes_is_retried_not_spun_on(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RunWriter(tmp_path / "run", {}) as writer:
            script = flaky(writer, [0, 0])
            writer.write(0, {"Loss": 0.0})
            assert script.script == [0] and "took no bytes" in messages(caught)[0]
            writer.write(1, {"Loss": 1.0})
    assert len(caught) == 2 and "is written again: the 2 record(s)" in messages(caught)[1]
    assert list(read_run(tmp_path / "run").steps) == [0, 1]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_warns_once_keeps_the_lines_and_writes_them_in_order(tmp_path, code):
    full = disk_error(code)
    file = log_file(tmp_path / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = RunWriter(tmp_path / "run", {})
        writer.write(0, {"Loss": 0.0})
        # step 1: 7 bytes go out, then the disk is full; steps 2-4 and the metadata find it
        # still full (one retry each); step 5 gets the backlog out, after two short writes
        script = flaky(writer, [7, full, full, full, full, full, 3, 4])
        for step in range(1, 5):
            writer.write(step, {"Loss": float(step)})
        writer.update_metadata({"optimizer": {"name": "SGD"}})
        assert len(caught) == 1 and script.script == [3, 4]
        assert f"cannot write the run log {file}" in messages(caught)[0]
        assert os.strerror(code) in messages(caught)[0]
        assert len(file.read_bytes().split(b"\n")[2]) == 7  # step 1 is cut, for now
        writer.write(5, {"Loss": 5.0})
        writer.close()
    assert len(caught) == 2
    assert f"the run log {file} is written again: the 6 record(s)" in messages(caught)[1]
    records = lines_of(file)
    assert [r.get("step") for r in records] == [None, 0, 1, 2, 3, 4, None, 5]
    run = read_run(tmp_path / "run")
    assert run.problems == []
    assert run.steps == {step: {"Loss": float(step)} for step in range(6)}
    assert run.metadata["optimizer"] == {"name": "SGD"}


def test_the_backlog_is_retried_at_close(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = RunWriter(tmp_path / "run", {})
        flaky(writer, [disk_error(errno.ENOSPC)] * 3)
        for step in range(3):
            writer.write(step, {"Loss": float(step)})
        writer.close()
    assert len(caught) == 2 and "is written again: the 3 record(s)" in messages(caught)[1]
    assert list(read_run(tmp_path / "run").steps) == [0, 1, 2]


def test_lines_that_never_get_out_are_counted_at_close(tmp_path):
    file = log_file(tmp_path / "run")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer = RunWriter(tmp_path / "run", {})
        writer.write(0, {"Loss": 0.0})
        flaky(writer, [5] + [disk_error(errno.ENOSPC)] * 10)
        writer.write(1, {"Loss": 1.0})
        writer.write(2, {"Loss": 2.0})
        writer.close()
        with pytest.raises(ValueError, match="closed"):  # misuse still raises
            writer.write(3, {"Loss": 3.0})
    assert len(caught) == 2
    assert messages(caught)[1].startswith(f"the run log {file} is closed with 2 record(s)")
    assert "they are lost; its last line is cut short" in messages(caught)[1]
    run = read_run(tmp_path / "run")
    assert run.steps == {0: {"Loss": 0.0}}
    assert len(run.problems) == 1 and "truncated last line" in run.problems[0]
    RunWriter(tmp_path / "run", {}).close()  # the lock went with the close


def test_misuse_still_raises_while_the_disk_is_full(tmp_path):
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with RunWriter(tmp_path / "run", {}) as writer:
            flaky(writer, [disk_error(errno.ENOSPC)] * 10)
            writer.write(0, {"Loss": 0.0})
            with pytest.raises(TypeError, match="non-negative int"):
                writer.write(-1, {"Loss": 1.0})
            with pytest.raises(TypeError, match="metadata must be a dict"):
                writer.update_metadata(["SGD"])
            assert len(writer._pending) == 1


# ---------------------------------------------------------------- 6. bad paths and arguments
@pytest.mark.parametrize("blank", ["", " "])
def test_a_blank_path_is_refused(tmp_path, monkeypatch, blank):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"path is '{blank}', an empty path: pass a run dir"):
        RunWriter(blank, {})
    with pytest.raises(ValueError, match="path is '', an empty path"):
        Cockpit(torch.nn.Linear(2, 1), log="")
    with pytest.raises(ValueError, match="path is '', an empty path"):
        read_run("")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", [7, 2.5, b"runs/exp1", ["runs"]])
def test_a_path_that_is_not_a_path_is_refused(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    kind = type(path).__name__
    with pytest.raises(TypeError, match=rf"path must be a run directory path .* of type {kind}"):
        RunWriter(path, {})
    with pytest.raises(TypeError, match=rf" of type {kind}: pass a directory such as"):
        Cockpit(torch.nn.Linear(2, 1), log=path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["notes.txt", "notes", "notes.txt/run.jsonl"])
def test_an_existing_file_is_not_a_run_directory(tmp_path, name):
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "notes").write_text("more notes\n")
    with pytest.raises(NotADirectoryError, match="notes.* is a file, not a run directory"):
        RunWriter(tmp_path / name, {})
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"
    assert (tmp_path / "notes").read_text() == "more notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "notes.txt"]


def test_a_file_deeper_up_the_path_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("my notes\n")
    with pytest.raises(NotADirectoryError, match=r"exp1/log\.jsonl: a folder on that path is"):
        RunWriter(tmp_path / "notes.txt" / "runs" / "exp1", {})
    assert (tmp_path / "notes.txt").read_text() == "my notes\n"


@pytest.mark.parametrize("name", ["run.jsonl", "run/log.jsonl"])
def test_a_directory_named_like_a_log_file_is_refused(tmp_path, name):
    (tmp_path / name).mkdir(parents=True)
    with pytest.raises(IsADirectoryError, match=r"\.jsonl is a directory, not a log file: pass"):
        RunWriter(tmp_path / name.split("/")[0], {})
    assert list((tmp_path / name).iterdir()) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores chmod")
def test_a_read_only_folder_is_named(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match=r"cannot open the run log .*runs/exp1"):
            RunWriter(folder / "exp1", {})
        assert list(folder.iterdir()) == []
    finally:
        folder.chmod(0o700)


def test_a_permission_error_names_the_path_and_what_to_do(tmp_path, monkeypatch):
    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(
        PermissionError, match=r"exp1/log\.jsonl for writing: permission denied on .*exp1"
    ):
        RunWriter(tmp_path / "runs" / "exp1", {})
    with pytest.raises(
        PermissionError, match="Pass a run directory you may write to, or change its permissions"
    ):
        RunWriter(tmp_path / "runs" / "exp1", {})
    assert list(tmp_path.iterdir()) == []


def test_metadata_must_be_a_dict(tmp_path):
    with pytest.raises(
        TypeError, match="metadata must be a dict of JSON-ready values, got a list"
    ):
        RunWriter(tmp_path / "run", ["SGD"])
    assert not (tmp_path / "run").exists()


def _started_then_wait(started, release):
    started.set()
    release.wait(30)


def test_a_forked_child_leaves_the_lock_with_its_parent(tmp_path):
    # a DataLoader worker forked while the writer is open: once the parent closes, the log
    # can be opened again although the child still lives
    import multiprocessing

    writer = RunWriter(tmp_path / "run", metadata={})
    context = multiprocessing.get_context("fork")
    started, release = context.Event(), context.Event()
    child = context.Process(target=_started_then_wait, args=(started, release))
    child.start()
    assert started.wait(30)  # the child runs (its fork handlers have run)
    try:
        writer.close()
        RunWriter(tmp_path / "run", metadata={}).close()
    finally:
        release.set()
        child.join(30)
    assert child.exitcode == 0


def test_a_deeply_nested_line_is_a_problem_not_a_crash(tmp_path):
    RunWriter(tmp_path / "run", metadata={}).close()
    with open(tmp_path / "run" / "log.jsonl", "ab") as f:
        f.write(b"[" * 100_000 + b"\n" + b'{"step": 0, "values": {"Loss": 1.0}}\n')
    run = read_run(tmp_path / "run")
    assert run.steps[0]["Loss"] == 1.0
    assert any("line 2" in problem for problem in run.problems)
