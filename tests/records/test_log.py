"""The run log: written and read back exactly, appended or refused, corrupt lines reported."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from avionics.records import Run, RunWriter, describe_optimizer, read_run
from avionics.records.writer import log_file

VALUES = {
    "Loss": 2.302585092994046,
    "Alpha": math.nan,
    "HessMaxEV": math.inf,
    "TICDiag": -math.inf,
    "GradNorm": [0.5, 1e-300, 3.0],
    "Parameters": [[[1.0, -2.0], [math.nan, 4.0]], [0.25]],
    "GradHist1d": {"hist": [0, 3, 7, 1], "edges": [-2.0, -1.0, 0.0, 1.0, 2.0]},
    "GradHist2d": {
        "hist": [[1, 2], [3, 4]],
        "edges": [[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0]],
        "param_hist": [{"hist": [[1, 0], [0, 0]], "edges": [[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0]]}],
    },
    "epoch": 3,
    "note": "NaN",
    "flag": True,
    "nothing": None,
}


def same(a, b) -> bool:
    """Equality that treats nan as equal to nan and requires equal types."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_values_read_back_exactly(tmp_path):
    with RunWriter(tmp_path / "run", {"optimizer": "SGD"}) as writer:
        writer.write(0, VALUES)
        writer.write(7, {"Loss": 1.0})
    run = read_run(tmp_path / "run")
    assert run.problems == []
    assert list(run.steps) == [0, 7]
    assert same(run.steps[0], VALUES)
    assert run.metadata["optimizer"] == "SGD"
    assert run.metadata["format"] == "avionics-log"


def test_every_line_is_strict_json_with_metadata_first(tmp_path):
    with RunWriter(tmp_path / "run", {"model": {"class": "MLP"}}) as writer:
        writer.write(0, VALUES)
    lines = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]  # no NaN tokens
    assert records[0]["metadata"]["model"] == {"class": "MLP"}
    assert records[1]["step"] == 0
    assert records[1]["values"]["Alpha"] == {"$float": "NaN"}


def test_numpy_and_torch_values_become_plain(tmp_path):
    with RunWriter(tmp_path / "run.jsonl", {}) as writer:
        writer.write(
            1,
            {
                "a": np.float32(0.5),
                "b": torch.tensor(2.0),
                "c": np.arange(3),
                "d": torch.tensor([[1.0, float("inf")]]),
            },
        )
    steps = read_run(tmp_path / "run.jsonl").steps
    assert same(steps[1], {"a": 0.5, "b": 2.0, "c": [0, 1, 2], "d": [[1.0, math.inf]]})


def test_late_values_and_logged_metrics_merge_into_their_step(tmp_path):
    with RunWriter(tmp_path / "run", {}) as writer:
        writer.write(0, {"Loss": 3.0, "GradNorm": [1.0]})
        writer.write(1, {"Loss": 2.0})
        writer.write(0, {"Alpha": 0.1, "UpdateSize": [0.2]})  # two-step values, one step late
        writer.write(1, {"train_accuracy": 0.5, "learning_rate": 0.1})  # cockpit.log
    steps = read_run(tmp_path / "run").steps
    assert steps == {
        0: {"Loss": 3.0, "GradNorm": [1.0], "Alpha": 0.1, "UpdateSize": [0.2]},
        1: {"Loss": 2.0, "train_accuracy": 0.5, "learning_rate": 0.1},
    }


def test_bad_values_raise_before_anything_is_written(tmp_path):
    with RunWriter(tmp_path / "run", {}) as writer:
        with pytest.raises(TypeError, match=r"values\['model'\] is a Linear"):
            writer.write(0, {"Loss": 1.0, "model": torch.nn.Linear(1, 1)})
        with pytest.raises(TypeError, match="non-negative int"):
            writer.write(-1, {"Loss": 1.0})
        with pytest.raises(TypeError, match="non-negative int"):
            writer.write(1.0, {"Loss": 1.0})
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 1
    with pytest.raises(ValueError, match="closed"):
        writer.write(0, {"Loss": 1.0})


def test_reopening_appends_a_session_or_refuses(tmp_path):
    with RunWriter(tmp_path / "run", {"session": "first"}) as writer:
        writer.write(0, {"Loss": 3.0})
    before = log_file(tmp_path / "run").read_bytes()
    with pytest.raises(FileExistsError, match="exist='append'"):
        RunWriter(tmp_path / "run", {}, exist="error")
    with pytest.raises(ValueError, match="exist must be one of"):
        RunWriter(tmp_path / "run", {}, exist="overwrite")
    assert log_file(tmp_path / "run").read_bytes() == before
    with RunWriter(tmp_path / "run", {"session": "second"}) as writer:
        writer.write(1, {"Loss": 2.0})
    run = read_run(tmp_path / "run")
    assert log_file(tmp_path / "run").read_bytes().startswith(before)
    assert [s["session"] for s in run.sessions] == ["first", "second"]
    assert run.metadata["session"] == "first"
    assert run.steps == {0: {"Loss": 3.0}, 1: {"Loss": 2.0}}
    assert run.problems == []


def test_rewritten_steps_are_reported(tmp_path):
    for loss in (3.0, 4.0):
        with RunWriter(tmp_path / "run", {}) as writer:
            writer.write(0, {"Loss": loss})
            writer.write(1, {"Loss": loss})
    run = read_run(tmp_path / "run")
    assert run.steps[0] == {"Loss": 4.0}
    assert run.problems == [
        "session 2 rewrote 2 step(s) already in the log (steps 0..1); the later values are kept"
    ]


def test_metadata_update_is_merged(tmp_path):
    with RunWriter(tmp_path / "run", {"a": 1}) as writer:
        writer.update_metadata({"optimizer": {"name": "SGD"}})
    assert read_run(tmp_path / "run").metadata["optimizer"] == {"name": "SGD"}


def test_refuses_to_append_to_a_file_that_is_not_a_log(tmp_path):
    other = tmp_path / "notes.jsonl"
    other.write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not an avionics log"):
        RunWriter(other, {})
    assert other.read_text() == '{"hello": 1}\n'


def test_truncated_last_line_is_reported_and_the_rest_read(tmp_path):
    with RunWriter(tmp_path / "run", {}) as writer:
        writer.write(0, {"Loss": 3.0})
        writer.write(1, {"Loss": 2.0})
    file = log_file(tmp_path / "run")
    file.write_bytes(file.read_bytes() + b'{"step": 2, "values": {"Lo')
    run = read_run(tmp_path / "run")
    assert run.steps == {0: {"Loss": 3.0}, 1: {"Loss": 2.0}}
    assert len(run.problems) == 1 and run.problems[0].startswith("line 4: truncated last line")

    # appending after the crash starts a fresh line; the cut line stays reported
    with RunWriter(tmp_path / "run", {}) as writer:
        writer.write(2, {"Loss": 1.0})
    run = read_run(tmp_path / "run")
    assert run.steps[2] == {"Loss": 1.0}
    assert len(run.problems) == 1 and run.problems[0].startswith("line 4: not valid JSON")


def test_corrupt_lines_are_reported_with_line_numbers(tmp_path):
    with RunWriter(tmp_path / "run", {}) as writer:
        writer.write(0, {"Loss": 3.0})
    file = log_file(tmp_path / "run")
    with open(file, "ab") as f:
        f.write(b"garbage\n")
        f.write(b"[1, 2]\n")
        f.write(b'{"step": "one", "values": {}}\n')
        f.write(b'{"step": 1, "values": {"Loss": \xff}}\n')
        f.write(b"\n")
        f.write(b'{"step": 2, "values": {"Loss": 1.0}}\n')
    run = read_run(tmp_path / "run")
    assert run.steps == {0: {"Loss": 3.0}, 2: {"Loss": 1.0}}
    assert [p.split(":")[0] for p in run.problems] == ["line 3", "line 4", "line 5", "line 6"]
    assert "not valid JSON" in run.problems[0]
    assert "neither metadata nor a step record" in run.problems[2]


def test_missing_run_says_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory holding log.jsonl"):
        read_run(tmp_path / "nowhere")


def test_dataframe_has_one_row_per_step(tmp_path):
    with RunWriter(tmp_path / "run", {}) as writer:
        writer.write(0, {"Loss": 3.0, "GradNorm": [1.0, 2.0]})
        writer.write(2, {"Loss": 2.0, "valid_accuracy": 0.5})
    frame = read_run(tmp_path / "run").to_dataframe()
    assert list(frame.index) == [0, 2]
    assert frame.index.name == "step"
    assert frame["Loss"].tolist() == [3.0, 2.0]
    assert frame.loc[0, "GradNorm"] == [1.0, 2.0]
    assert math.isnan(frame.loc[0, "valid_accuracy"])


def test_run_from_cockpit_output_is_sorted():
    run = Run.from_output({3: {"Loss": 1.0}, 1: {"Loss": 2.0}})
    assert list(run.steps) == [1, 3]
    assert run.names == ["Loss"]


def test_optimizer_description_is_json_ready(tmp_path):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9)
    described = describe_optimizer(optimizer)
    assert described["name"] == "SGD"
    assert described["param_groups"][0]["lr"] == pytest.approx(0.1)
    assert described["param_groups"][0]["momentum"] == 0.9
    with RunWriter(tmp_path / "run", {}) as writer:
        writer.update_metadata({"optimizer": described})
    assert read_run(tmp_path / "run").metadata["optimizer"] == json.loads(json.dumps(described))
