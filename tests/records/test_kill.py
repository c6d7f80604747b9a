"""A training process killed with SIGKILL leaves a readable log of every finished step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from avionics.records import read_run

REPO = Path(__file__).resolve().parents[2]
PER_STEP = {"Loss", "GradNorm", "NormTest", "GradHist1d"}

TRAINING = textwrap.dedent(
    """
    import sys
    import torch
    from avionics import Cockpit, quantities as q

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = torch.randn(32, 20), torch.randn(32, 1)
    instruments = [q.Loss(), q.GradNorm(), q.NormTest(), q.UpdateSize(), q.GradHist1d(bins=3000)]
    cockpit = Cockpit(model, quantities=instruments, log=sys.argv[1])
    for step in range(100_000):
        opt.zero_grad()
        losses = ((model(X) - y) ** 2).squeeze(1)
        loss = losses.mean()
        info = {"loss": loss, "individual_losses": losses, "batch_size": 32, "optimizer": opt}
        with cockpit(step, info=info):
            loss.backward()
        opt.step()
        print(step, flush=True)  # the step is finished: the cockpit has written it
    """
)


def test_sigkill_mid_run_loses_at_most_the_step_in_progress(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINING, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    finished = -1
    while finished < 15:
        line = process.stdout.readline()
        assert line, "the training process ended before it could be killed"
        finished = int(line)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = max([finished] + [int(line) for line in process.stdout.read().split()])
    assert process.returncode == -signal.SIGKILL

    run = read_run(tmp_path / "run")
    assert run.metadata["format"] == "avionics-log"
    for step in range(finished + 1):
        assert PER_STEP <= set(run.steps[step]), step
        assert len(run.steps[step]["GradHist1d"]["hist"]) == 3000
    for step in range(finished):  # a step's update size is written at the next step
        assert "UpdateSize" in run.steps[step], step
    assert max(run.steps) <= finished + 1  # at most the step whose print was cut off
    assert run.problems == [] or (
        len(run.problems) == 1 and "truncated last line" in run.problems[0]
    )
