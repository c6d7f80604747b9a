"""Reading a run log loads no instrument: ``avionics.records`` imports neither the cockpit nor
a quantity (nor the per-sample engine or the curvature operators they need), and reads the
built-in quantities' values through its own table of their declared outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from avionics import Cockpit, quantities
from avionics.quantities import BUILTIN
from avionics.records.outputs import BUILTIN_OUTPUTS
from tests import models

ROOT = Path(__file__).parents[2]
INSTRUMENTS = (
    "avionics.cockpit",
    "avionics.quantities",
    "avionics.persample",
    "avionics.curvature",
)

READ = """
import json, sys
import avionics.records as records
run = records.read_run(sys.argv[1])
records.to_csv(run, sys.argv[2])
values = {name: run.output(name, run.steps[1][name]).scalar(run.steps[1][name])
          for name in ("GradNorm", "NormTest", "Loss")}
loaded = sorted(m for m in sys.modules if m.startswith("avionics"))
print(json.dumps({"values": values, "loaded": loaded}))
"""


def _a_run(path: Path) -> dict:
    model, X, y, loss_fn = models.mlp(n=6)
    cockpit = Cockpit(
        model, [quantities.Loss(), quantities.GradNorm(), quantities.NormTest()], log=path
    )
    for step in range(2):
        losses = loss_fn(model(X), y)
        with cockpit(step, {"loss": losses.mean(), "individual_losses": losses, "batch_size": 6}):
            losses.mean().backward()
        model.zero_grad()
    cockpit.close()
    return cockpit.get_output()[1]


def test_reading_a_run_imports_no_instrument(tmp_path):
    expected = _a_run(tmp_path / "run")
    result = subprocess.run(
        [sys.executable, "-c", READ, str(tmp_path / "run"), str(tmp_path / "run.csv")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=True,
    )
    read = json.loads(result.stdout.strip().splitlines()[-1])
    assert [m for m in read["loaded"] if m.startswith(INSTRUMENTS)] == []
    assert "avionics.records" in read["loaded"]
    gradient_norm = torch.tensor(expected["GradNorm"], dtype=torch.float64).norm().item()
    assert read["values"]["GradNorm"] == pytest.approx(gradient_norm, rel=1e-12)
    assert read["values"]["NormTest"] == expected["NormTest"]
    assert read["values"]["Loss"] == expected["Loss"]


def test_the_table_of_builtin_outputs_is_what_each_quantity_declares():
    assert BUILTIN_OUTPUTS == {cls.__name__: cls.output for cls in BUILTIN}
    assert quantities.BUILTIN_OUTPUTS is BUILTIN_OUTPUTS
