"""What the tracker sinks' tests share: a short real training loop whose cockpit writes to
the sinks given, a bound on a test's time, and a reader of W&B's offline run file."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
from collections import defaultdict
from pathlib import Path

import models
import torch

from avionics import Cockpit, quantities

STEPS = 3
# the quantities of every kind a tracker shows: scalars, per-parameter values (UpdateSize
# arrives one step late), 1d and 2d histograms
QUANTITIES = (
    quantities.Loss,
    quantities.GradNorm,
    quantities.UpdateSize,
    quantities.GradHist1d,
    quantities.GradHist2d,
)


def train_into(sinks) -> tuple[dict, dict]:
    """Train models.mlp() for STEPS tracked steps into ``sinks``; (the cockpit's output, its
    metadata). The cockpit closes the sinks."""
    model, X, y, loss_fn = models.mlp(n=6)
    cockpit = Cockpit(model, [q() for q in QUANTITIES], sinks=sinks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = loss_fn(model(X), y)
        info = {"loss": losses.mean(), "individual_losses": losses, "batch_size": len(X)}
        info["optimizer"] = optimizer
        with cockpit(step, info=info):
            losses.mean().backward()
        optimizer.step()
    cockpit.close()
    return dict(cockpit.get_output()), cockpit.metadata


@contextlib.contextmanager
def bounded(seconds: int):
    """Fail with TimeoutError, rather than hang, where the block runs past ``seconds`` (a
    SIGALRM interrupts a blocked wait for another process's reply)."""

    def expire(signum, frame):
        raise TimeoutError(f"the block ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def child_commands() -> list[str]:
    """The command names of this process's live child processes (Linux /proc)."""
    names = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:  # a thread may end between the listing and the read
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for child in children:
            with contextlib.suppress(FileNotFoundError):
                state = Path(f"/proc/{child}/stat").read_text().split(") ")[-1][0]
                if state != "Z":
                    names.append(Path(f"/proc/{child}/comm").read_text().strip())
    return names


# W&B's run file (``run-<id>.wandb``) is a LevelDB-style log: a 7-byte file header (":W&B",
# magic 0xBEE1, version), then 32 KiB blocks of chunks, each with a 7-byte header (CRC32,
# uint16 length, uint8 type: 1 full, 2 first, 3 middle, 4 last) and its piece of a serialised
# wandb.proto Record; a block's tail too short for a header is zero padding.
_BLOCK, _HEADER = 32768, 7


def wandb_records(path) -> list:
    """The protobuf Records of a W&B run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is no W&B run file"
    records, pieces, position = [], b"", _HEADER
    while position + _HEADER <= len(data):
        room = _BLOCK - position % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        if room < _HEADER or (length == 0 and kind == 0):
            position += room
            continue
        pieces += data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def wandb_history(records) -> dict[int, dict]:
    """{the "step" of a row: {key: value}} of the history rows (rows of one step merged);
    a histogram reads as its JSON {"_type": "histogram", "values": ..., "bins": ...}."""
    rows = defaultdict(dict)
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            keys = list(item.nested_key) or [item.key]
            target = row
            for key in keys[:-1]:
                target = target.setdefault(key, {})
            target[keys[-1]] = json.loads(item.value_json)
        rows[int(row["step"])].update(row)
    return dict(rows)
