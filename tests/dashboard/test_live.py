"""The live dashboard: redraws every k steps in the background, never blocking training."""

from __future__ import annotations

import threading
import time

import pytest
from synthetic import write_run

import avionics.dashboard.live as live_module
from avionics.dashboard import LiveDashboard


class GrowingCockpit:
    """Stands in for a Cockpit: its output gains a step at every training step."""

    def __init__(self):
        self.output = {}

    def train_step(self, step):
        self.output[step] = {"Loss": 1.0 / (step + 1)}

    def get_output(self):
        return {step: dict(values) for step, values in self.output.items()}


def test_updates_never_wait_for_a_drawing(monkeypatch, tmp_path):
    release, drawn_steps = threading.Event(), []

    def slow_plot(run, path):
        release.wait(timeout=30)
        drawn_steps.append(max(run.steps))

    monkeypatch.setattr(live_module, "plot", slow_plot)
    cockpit = GrowingCockpit()
    live = LiveDashboard(cockpit, tmp_path / "cockpit.png", every=5)
    started = time.perf_counter()
    due = []
    for step in range(20):
        cockpit.train_step(step)
        due.append(live.update(step))
    assert time.perf_counter() - started < 1.0  # the drawing is still blocked
    assert due == [step == 0 for step in range(20)]
    assert live.skipped == 3  # steps 5, 10, 15 came while step 0 was being drawn
    release.set()
    live.close()
    assert drawn_steps == [0, 19]  # the snapshot of step 0, then the final state
    assert live.drawn == 2


def test_draws_a_run_log_and_its_secondary_screen(tmp_path):
    run = write_run(tmp_path / "run", num_steps=10)
    live = LiveDashboard(run, tmp_path / "live.png", every=3, secondary_path=tmp_path / "s.png")
    assert not live.update(4)
    live.close()
    assert live.drawn == 1
    assert (tmp_path / "live.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")


def test_drawing_errors_reach_the_training_loop(tmp_path):
    live = LiveDashboard(tmp_path / "missing", tmp_path / "live.png", every=1)
    live.update(0)
    with pytest.raises(RuntimeError, match="failed to draw: no run log at"):
        live.close()


def test_every_must_be_a_positive_int(tmp_path):
    with pytest.raises(ValueError, match="every must be a positive int"):
        LiveDashboard(GrowingCockpit(), tmp_path / "x.png", every=0)
