"""The ``avionics`` command line, through a subprocess and in process."""

from __future__ import annotations

import json
import os
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


@pytest.fixture
def run(tmp_path):
    return write_run(tmp_path / "run", num_steps=30)


def test_help_lists_every_command():
    top = avionics("--help")
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


def test_plot_writes_the_dashboard_and_secondary_screen(run, tmp_path):
    result = avionics("plot", run, "-o", tmp_path / "c.svg", "--secondary", tmp_path / "s.png")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "c.svg").read_bytes().startswith(b"<?xml")
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")
    assert f"dashboard written to {tmp_path / 'c.svg'}" in result.stdout


def test_diagnose_prints_findings_and_json(run, capsys):
    result = avionics("diagnose", run)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Diagnosis of {run}: 30 tracked steps (steps 0-29)")
    assert "CABS suggests a batch size of about" in result.stdout
    assert main(["diagnose", str(run), "--json"]) == 0
    findings = json.loads(capsys.readouterr().out)
    assert [f["check"] for f in findings] == ["cabs_batch_size"]
    assert set(findings[0]) == {"check", "title", "evidence", "advice", "step"}


def test_errors_say_what_to_do(tmp_path, capsys):
    missing = avionics("diagnose", tmp_path / "nowhere")
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
    assert "1 line(s) of the log could not be read" in captured.out


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
