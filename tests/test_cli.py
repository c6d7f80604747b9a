"""The ``avionics`` command line, in process (``main``), and through a subprocess where the
process itself is what is tested (the entry point, a closed stdout pipe)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic import write_run

from avionics.cli import main
from avionics.records import read_cockpit_json

REPO = Path(__file__).resolve().parents[1]


def avionics(*args, cwd=None) -> subprocess.CompletedProcess:
    """Run ``avionics ARGS`` as a user would (``python -m avionics.cli`` when not installed)."""
    return subprocess.run(
        [sys.executable, "-m", "avionics.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"},
        timeout=300,
    )


def in_process(capsys, *args) -> subprocess.CompletedProcess:
    """Run ``avionics ARGS`` by :func:`avionics.cli.main` in this process: its exit status
    (argparse's ``SystemExit`` included) and what it printed, as :func:`avionics` returns."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


@pytest.fixture(scope="module")
def written_run(tmp_path_factory):
    """A synthetic run log of 30 steps, written once per module (copied for each test)."""
    return write_run(tmp_path_factory.mktemp("written") / "run", num_steps=30)


@pytest.fixture
def run(written_run, tmp_path):
    return Path(shutil.copytree(written_run, tmp_path / "run"))


def test_help_lists_every_command(capsys):
    top = in_process(capsys, "--help")
    assert top.returncode == 0
    for command in ("demo", "plot", "diagnose", "export"):
        assert command in top.stdout


@pytest.mark.parametrize(
    "command, option",
    [("demo", "--steps"), ("plot", "--secondary"), ("diagnose", "--json"), ("export", "--format")],
)
def test_help_of_each_command(command, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert option in capsys.readouterr().out


def test_plot_writes_the_dashboard_and_secondary_screen(run, tmp_path, capsys):
    result = in_process(
        capsys, "plot", run, "-o", tmp_path / "c.svg", "--secondary", tmp_path / "s.png"
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "c.svg").read_bytes().startswith(b"<?xml")
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")
    assert f"dashboard written to {tmp_path / 'c.svg'}" in result.stdout


def test_diagnose_prints_findings_and_json(run, capsys):
    result = in_process(capsys, "diagnose", run)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Diagnosis of {run}: 30 tracked steps (steps 0-29)")
    assert "CABS suggests a batch size of about" in result.stdout
    assert main(["diagnose", str(run), "--json"]) == 0
    findings = json.loads(capsys.readouterr().out)
    assert [f["check"] for f in findings] == ["cabs_batch_size"]
    assert set(findings[0]) == {"check", "title", "evidence", "advice", "step"}


def test_errors_say_what_to_do(tmp_path, capsys):
    missing = in_process(capsys, "diagnose", tmp_path / "nowhere")
    assert missing.returncode == 1
    assert "avionics diagnose: error: no run log at" in missing.stderr
    assert "Traceback" not in missing.stderr
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path), "--format", "xlsx"])
    assert exit_.value.code == 2 and "invalid choice: 'xlsx'" in capsys.readouterr().err


def test_plot_default_output_and_bad_suffix(run, capsys):
    assert main(["plot", str(run)]) == 0
    assert (run / "cockpit.png").read_bytes().startswith(b"\x89PNG")
    assert main(["plot", str(run), "-o", str(run / "cockpit.jpg")]) == 1
    assert "use a file name ending in .png, .pdf, .svg" in capsys.readouterr().err


def test_export_every_format(run, tmp_path, capsys):
    assert main(["export", str(run), "--format", "csv"]) == 0
    assert (run / "log.csv").read_text().startswith("step,")
    assert (
        main(["export", str(run), "--format", "cockpit-json", "-o", str(tmp_path / "c.json")]) == 0
    )
    assert list(read_cockpit_json(tmp_path / "c.json").steps) == list(range(30))
    assert (
        main(["export", str(run), "--format", "cockpit-json", "-o", str(tmp_path / "c.txt")]) == 1
    )
    assert "Pass -o FILE.json" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "tensorboard"]) == 0
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tb").iterdir())


def test_unreadable_lines_are_noted_but_do_not_fail(run, capsys):
    with open(run / "log.jsonl", "ab") as f:
        f.write(b'{"step": 30, "valu')
    assert main(["diagnose", str(run)]) == 0
    captured = capsys.readouterr()
    assert "note: 1 line(s)" in captured.err and "truncated last line" in captured.err
    assert "1 problem(s) reading the log" in captured.out


def test_demo_refuses_to_overwrite(tmp_path, capsys):
    (tmp_path / "good-lr").mkdir()
    assert main(["demo", "--out", str(tmp_path), "--quiet"]) == 1
    assert "already holds demo runs" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_trains_draws_and_tells_the_runs_apart(tmp_path, capsys):
    pytest.importorskip("sklearn", reason="the demo's data ship with scikit-learn")
    from avionics.demo import run_demo

    schedules = {"every": 1, "histogram_every": 5, "curvature_every": 20, "eval_every": 5}
    findings = run_demo(tmp_path, steps=12, progress=False, schedules=schedules)
    out = capsys.readouterr().out
    for name in ("good-lr", "too-large-lr"):
        for file in ("log.jsonl", "cockpit.png", "secondary.png"):
            assert (tmp_path / name / file).stat().st_size > 0, (name, file)
        assert f"Diagnosis of {tmp_path / name}: 12 tracked steps" in out
    assert "The two runs side by side:" in out
    too_large = {f.check for f in findings["too-large-lr"]}
    good = {f.check for f in findings["good-lr"]}
    assert {"edge_of_stability", "step_size_too_large"} <= too_large
    assert not good & {"edge_of_stability", "step_size_too_large", "non_finite_values"}


def test_the_default_demo_folder_is_never_overwritten(tmp_path, monkeypatch):
    from avionics.cli import _fresh_folder

    monkeypatch.chdir(tmp_path)
    assert _fresh_folder(Path("avionics-demo")) == Path("avionics-demo")
    (tmp_path / "avionics-demo").mkdir()
    (tmp_path / "avionics-demo-2").mkdir()
    assert _fresh_folder(Path("avionics-demo")) == Path("avionics-demo-3")


# Bad input: every error is one line on stderr, "avionics COMMAND: error: ...", a non-zero
# exit status and no traceback, and nothing is written.


def one_line_error(stderr: str, command: str) -> str:
    """The message of the single error line on ``stderr``, checked for its prefix."""
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    prefix = f"avionics {command}: error: " if command else "avionics: error: "
    assert lines[0].startswith(prefix), stderr
    return lines[0][len(prefix) :]


def failing(capsys, *args) -> tuple[int, str]:
    """Run ``avionics ARGS`` in process; its exit status (non-zero) and stderr."""
    try:
        code = main([str(a) for a in args])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    assert code != 0
    return code, capsys.readouterr().err


def tree(folder: Path) -> dict:
    """Every file under ``folder`` with its content: to check that nothing was written."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def not_logs(tmp_path) -> dict:
    """Files that are not run logs, by what they are."""
    folder = tmp_path / "not-logs"
    folder.mkdir()
    files = {
        "text file": ("notes.txt", b"hello\n"),
        "empty log": ("empty.jsonl", b""),
        "garbage log": ("garbage.jsonl", b"hello\nworld\n"),
        "binary log": ("binary.jsonl", bytes(range(256)) * 4),
        "invalid json": ("garbage.json", b"hello"),
        "json of no cockpit": ("list.json", b"[1, 2]"),
    }
    for name, content in files.values():
        (folder / name).write_bytes(content)
    return {what: folder / name for what, (name, _) in files.items()}


def test_usage_errors_are_one_line(capsys):
    for args, command, message in [
        ((), "", "the following arguments are required: COMMAND; see avionics --help"),
        (("plot",), "plot", "the following arguments are required: run; see avionics plot"),
        (("diagnose", "run", "--bogus"), "", "unrecognized arguments: --bogus; see avionics"),
        (("export", "run", "--format", "xlsx"), "export", "argument --format: invalid choice"),
    ]:
        code, err = failing(capsys, *args)
        assert code == 2
        assert one_line_error(err, command).startswith(message)


@pytest.mark.parametrize("steps", ["-5", "0", "ten", "2.5"])
def test_demo_refuses_steps_below_one(steps, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = failing(capsys, "demo", "--steps", steps, "--quiet")
    assert code == 2
    message = one_line_error(err, "demo")
    assert message.startswith(f"argument --steps: expected an integer >= 1, got '{steps}'")
    assert list(tmp_path.iterdir()) == []


def test_demo_steps_through_the_entry_point(tmp_path):
    result = avionics("demo", "--steps", "-5", "--out", tmp_path / "demo", cwd=tmp_path)
    assert result.returncode == 2
    assert "argument --steps: expected an integer >= 1, got '-5'" in one_line_error(
        result.stderr, "demo"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("steps, error", [(0, ValueError), (-5, ValueError), (2.0, TypeError)])
def test_run_demo_refuses_steps_below_one(steps, error, tmp_path):
    from avionics.demo import run_demo

    with pytest.raises(error, match=r"run_demo\(steps=\.\.\.\) needs an integer >= 1, got"):
        run_demo(tmp_path / "demo", steps=steps, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_demo_refuses_a_file_as_its_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    _, err = failing(capsys, "demo", "--out", tmp_path / "file", "--quiet", "--steps", "1")
    assert one_line_error(err, "demo") == (
        f"cannot write the demo runs to {tmp_path / 'file'}: it is a file, not a folder. "
        "Pass --out with another folder."
    )
    assert tree(tmp_path) == {Path("file"): b"mine"}


@pytest.mark.parametrize(
    "command",
    [("plot",), ("diagnose",), ("export", "--format", "csv")],
    ids=["plot", "diagnose", "export"],
)
def test_a_missing_run_or_a_file_that_is_no_log(command, not_logs, tmp_path, capsys):
    runs = {**not_logs, "missing run": tmp_path / "nowhere", "missing json": tmp_path / "x.json"}
    before = tree(tmp_path)
    for what, expected in [
        ("missing run", f"no run log at {runs['missing run'] / 'log.jsonl'}: pass a run"),
        ("missing json", f"{runs['missing json']}: no such file or directory; check the path"),
        ("text file", f"no run log at {runs['text file'] / 'log.jsonl'}"),
        ("empty log", f"no step could be read from {runs['empty log']} (first problem:"),
        ("garbage log", f"no step could be read from {runs['garbage log']} (first problem:"),
        ("binary log", f"no step could be read from {runs['binary log']} (first problem:"),
        ("invalid json", f"{runs['invalid json']} is not a valid JSON file"),
        ("json of no cockpit", f"{runs['json of no cockpit']} is not a Cockpit JSON log"),
    ]:
        _, err = failing(capsys, command[0], runs[what], *command[1:])
        assert one_line_error(err, command[0]).startswith(expected), (what, err)
    assert tree(tmp_path) == before


def test_a_log_that_has_not_logged_a_step_yet(tmp_path, capsys):
    from avionics.records import RunWriter

    RunWriter(tmp_path / "run", metadata={"optimizer": {"name": "SGD"}}).close()
    before = tree(tmp_path)
    _, err = failing(capsys, "plot", tmp_path / "run")
    assert one_line_error(err, "plot") == (
        f"no step could be read from {tmp_path / 'run' / 'log.jsonl'}: pass a run directory "
        "or .jsonl log written by Cockpit(..., log=DIR) once it has logged a step."
    )
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "args, kind",
    [
        (("plot", "-o", "{out}/cockpit.png"), "file"),
        (("plot", "--secondary", "{out}/secondary.png"), "file"),
        (("export", "--format", "csv", "-o", "{out}/log.csv"), "file"),
        (("export", "--format", "cockpit-json", "-o", "{out}/c.json"), "file"),
        (("export", "--format", "tensorboard", "-o", "{out}/tb"), "folder"),
        (("demo", "--steps", "1", "--quiet", "--out", "{out}/demo"), "folder"),
    ],
    ids=["plot", "secondary", "csv", "cockpit-json", "tensorboard", "demo"],
)
def test_outputs_in_a_folder_that_is_a_file(args, kind, run, tmp_path, capsys):
    """An output folder that cannot be created (a file is in the way) is refused before
    anything is drawn or written (a file in the way binds root too)."""
    (tmp_path / "taken").write_text("mine")
    command = args[0]
    out = tmp_path / "taken"
    argv = [a.format(out=out) for a in args]
    before = tree(tmp_path)
    _, err = failing(capsys, *(argv if command == "demo" else [command, run, *argv[1:]]))
    message = one_line_error(err, command)
    assert message.startswith("cannot write the ") and f"{out} is a file, not a folder." in message
    assert message.endswith(f"with another {kind}.")
    assert tree(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize(
    "args",
    [
        ("plot", "-o", "{out}/cockpit.png"),
        ("export", "--format", "csv", "-o", "{out}/log.csv"),
        ("export", "--format", "tensorboard", "-o", "{out}/tb"),
        ("demo", "--steps", "1", "--quiet", "--out", "{out}/demo"),
    ],
    ids=["plot", "csv", "tensorboard", "demo"],
)
def test_outputs_in_a_read_only_folder(args, run, tmp_path, capsys):
    out = tmp_path / "read-only"
    out.mkdir()
    out.chmod(0o555)
    argv = [a.format(out=out) for a in args]
    try:
        result = in_process(capsys, *(argv if args[0] == "demo" else [args[0], run, *argv[1:]]))
        assert list(out.iterdir()) == []
    finally:
        out.chmod(0o755)
    assert result.returncode == 1
    assert f"{out} is not writable (permission denied)" in one_line_error(result.stderr, args[0])


def test_a_directory_where_a_file_is_expected(run, tmp_path, capsys):
    folder = tmp_path / "figures"
    folder.mkdir()
    before = tree(tmp_path)
    for args in [
        ("plot", run, "-o", folder),
        ("plot", run, "--secondary", folder),
        ("export", run, "--format", "csv", "-o", folder),
        ("export", run, "--format", "cockpit-json", "-o", folder),
    ]:
        result = in_process(capsys, *args)
        assert result.returncode == 1
        assert f"to {folder}: it is a folder, not a file." in one_line_error(
            result.stderr, args[0]
        )
    assert tree(tmp_path) == before


def test_a_file_where_a_folder_is_expected(run, tmp_path, capsys):
    (tmp_path / "tb").write_text("mine")
    before = tree(tmp_path)
    _, err = failing(capsys, "export", run, "--format", "tensorboard", "-o", tmp_path / "tb")
    assert one_line_error(err, "export") == (
        f"cannot write the tensorboard export to {tmp_path / 'tb'}: it is a file, not a "
        "folder. Pass -o/--output with another folder."
    )
    assert tree(tmp_path) == before


def test_plot_checks_both_images_before_drawing_either(run, tmp_path, capsys):
    before = tree(tmp_path)
    _, err = failing(capsys, "plot", run, "--secondary", tmp_path / "s.jpg")
    assert one_line_error(err, "plot") == (
        "cannot save the secondary screen as 's.jpg': use a file name ending in .png, .pdf, "
        ".svg (pass --secondary)."
    )
    _, err = failing(
        capsys, "plot", run, "-o", tmp_path / "a.png", "--secondary", tmp_path / "a.png"
    )
    assert one_line_error(err, "plot") == (
        f"--secondary {tmp_path / 'a.png'} is the dashboard's file too: pass another file."
    )
    assert tree(tmp_path) == before


@pytest.mark.parametrize("fmt", ["csv", "cockpit-json"])
def test_export_never_overwrites_the_log(fmt, run, tmp_path, capsys):
    log = run / "log.jsonl"
    before = tree(tmp_path)
    _, err = failing(capsys, "export", log, "--format", fmt, "-o", log)
    message = one_line_error(err, "export")
    if fmt == "csv":
        assert message == (
            f"-o/--output {log} is the run's log: exporting there would overwrite it. Pass -o "
            "with another path."
        )
    else:
        assert "Pass -o FILE.json" in message
    assert tree(tmp_path) == before


def test_export_creates_missing_folders(run, tmp_path):
    assert main(["export", str(run), "--format", "csv", "-o", str(tmp_path / "a" / "b.csv")]) == 0
    assert (tmp_path / "a" / "b.csv").read_text().startswith("step,")


def test_operating_system_errors_are_one_line_with_advice(run, monkeypatch, capsys):
    from avionics import records

    def disk_full(run, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(records, "to_csv", disk_full)
    _, err = failing(capsys, "export", run, "--format", "csv")
    assert one_line_error(err, "export") == (
        f"{run / 'log.csv'}: no space left on device; free some disk space or write elsewhere."
    )


def test_an_interrupt_is_one_line(run, monkeypatch, capsys):
    from avionics import diagnosis

    def interrupted(run):
        raise KeyboardInterrupt

    monkeypatch.setattr(diagnosis, "diagnose", interrupted)
    code, err = failing(capsys, "diagnose", run)
    assert code == 130
    assert err == "avionics diagnose: interrupted\n"


def test_bugs_keep_their_traceback(run, monkeypatch):
    """A TypeError cannot come from the command line's strings: it is a bug, not printed
    away as a user error."""
    from avionics import diagnosis

    def bug(run):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(diagnosis, "diagnose", bug)
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["diagnose", str(run)])


def test_a_closed_stdout_stops_quietly(run):
    """Like ``avionics diagnose RUN | head -0``: stdout is a pipe nobody reads."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE
    try:
        result = subprocess.run(
            [sys.executable, "-m", "avionics.cli", "diagnose", str(run)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=300,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert result.stderr == ""
