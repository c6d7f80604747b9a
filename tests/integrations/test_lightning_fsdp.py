"""CockpitCallback under Lightning's ModelParallelStrategy (FSDP2: ``fully_shard`` in
``configure_model``) on 2 CPU gloo processes, each with every second sample: on both processes
every economy value is that of the global batch, as a plain loop on one process gets it
(float64). Lightning's FSDPStrategy (FSDP1) needs a GPU, and the cockpit refuses FSDP1 by
name (avionics.step.sharded): ModelParallelStrategy is the strategy to shard with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from avionics import configuration  # noqa: E402
from avionics.records.encoding import to_python  # noqa: E402
from integrations.test_lightning import (  # noqa: E402
    BATCHES,
    N,
    assert_close,
    make_data,
    make_net,
    plain_loop,
    without_time,
)

# Lightning's strategy starts the other process by running the same command again: a script
SCRIPT = """
import os, sys
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from integrations.test_lightning import BATCHES, N, Classifier, make_data, make_net, pl
from avionics import configuration
from avionics.integrations.lightning import CockpitCallback
from avionics.records.encoding import to_python


class ShardedClassifier(Classifier):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


out, rank = Path(sys.argv[1]), int(os.environ.get("LOCAL_RANK", 0))
torch.set_num_threads(1)
dataset = TensorDataset(*make_data(batches=2 * BATCHES))
shard = Subset(dataset, range(rank, len(dataset), 2))  # every second sample
callback = CockpitCallback(configuration("economy"))
strategy = pl.strategies.ModelParallelStrategy(
    data_parallel_size=2,
    tensor_parallel_size=1,
    process_group_backend="gloo",
    timeout=timedelta(seconds=60),
)
trainer = pl.Trainer(
    strategy=strategy,
    accelerator="cpu", devices=2, max_epochs=1, use_distributed_sampler=False,
    callbacks=[callback], logger=False, num_sanity_val_steps=0, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False,
)
trainer.fit(ShardedClassifier(make_net()), DataLoader(shard, batch_size=N, shuffle=False))
sharded = all(type(p).__name__ == "DTensor" for p in trainer.lightning_module.parameters())
output = to_python(dict(callback.cockpit.get_output()))
torch.save({"sharded": sharded, "output": output}, out / f"rank{rank}.pt")
"""


@pytest.mark.slow
def test_model_parallel_strategy_gives_the_global_batch_values(tmp_path):
    tests = Path(__file__).parents[1]
    script = tmp_path / "fsdp2_fit.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = plain_loop(
        make_net(), configuration("economy"), make_data(batches=2 * BATCHES), batch_size=2 * N
    )
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["sharded"]  # fully_shard made every parameter a DTensor
        output = result["output"]
        assert sorted(output) == list(range(BATCHES))
        assert {q.name for q in configuration("economy")} - {"Time"} <= set(output[1])
        assert_close(
            without_time(output),
            without_time(to_python(dict(expected))),
            rel=1e-10,
            path=f"rank {rank}",
        )
