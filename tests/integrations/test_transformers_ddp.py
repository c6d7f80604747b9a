"""CockpitTrainer under several processes: the real ``transformers.Trainer`` on 2 gloo
processes (accelerate wraps the model in DistributedDataParallel, each process trains on its
shard of every step's batch, ``num_items_in_batch`` counts the tokens of both) against one
process's CockpitTrainer on the global batch: the same micro-batches, and every cockpit
value equal (float64), on every process; rank 0's log records carry them.
"""

import copy
import os

import numpy as np
import pytest
import torch
from compare import assert_same_output
from spawned import on_ranks

from avionics import configuration

transformers = pytest.importorskip("transformers")
from integrations.test_transformers import RTOL, tiny_gpt2, trainer_for  # noqa: E402

WORLD, PER_PROCESS = 2, 2
# The Monte-Carlo GGN diagonal's estimates (curvature="auto" on GPT-2): each process draws the
# labels of its own samples, so they are another draw than one process's; compared by sign.
DRAWN = ("HessTrace", "TICDiag")
# The gradient histograms' counts: from the second step on, each process's parameters are the
# one process's to rounding (DDP averages the gradients in another order), so a value within
# rounding of a bin edge may fall into the neighbouring bin (12 of 15,110 in one cell on one
# machine, none on another). Their totals must agree exactly, the bins to this fraction.
HISTOGRAMS, MOVED_FRACTION = ("GradHist1d", "GradHist2d"), 1e-3


def _without_counts(expected: dict) -> dict:
    """A copy of ``expected`` without the histograms' counts (compared by _assert_same_counts)."""
    copied = copy.deepcopy(expected)
    for t in copied:
        for q in HISTOGRAMS:
            copied[t].get(q, {}).pop("hist", None)
    return copied


def _assert_same_counts(output: dict, expected: dict) -> None:
    """Pops the histograms' counts from both and compares them: the same totals and shapes,
    the bins to within MOVED_FRACTION of the total."""
    for t in expected:
        for q in HISTOGRAMS:
            if q in expected[t]:
                ours, theirs = (np.asarray(o[t][q].pop("hist")) for o in (output, expected))
                assert ours.shape == theirs.shape and ours.sum() == theirs.sum(), (t, q)
                moved = np.abs(ours - theirs).sum()
                assert moved <= MOVED_FRACTION * theirs.sum(), (t, q, moved, theirs.sum())


def _trainer_on_a_rank(rank, world, tmp_path, preset, steps, accumulation):
    """The Trainer on this process (the group is up; accelerate reads the launcher's
    variables torchrun would set): its micro-batches, cockpit output and log records."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    model = tiny_gpt2()
    trainer = trainer_for(
        tmp_path / f"rank{rank}",
        model,
        configuration(preset),
        steps=steps,
        batch=PER_PROCESS,
        accumulation=accumulation,
        max_grad_norm=0.05,
        samples=steps * world * PER_PROCESS * accumulation,
        ddp_backend="gloo",
    )
    assert trainer.args.world_size == world and trainer.cockpit is None
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    output = trainer.cockpit.get_output()
    trainer.cockpit.close()
    return trainer.seen, output, trainer.state.log_history


def _rows(seen, accumulation):
    """Each step's input ids, as a set of sequences (the order of samples within a step does
    not change a value of the global batch)."""
    steps = [seen[s : s + accumulation] for s in range(0, len(seen), accumulation)]
    return [
        sorted(tuple(row.tolist()) for m, _ in micro for row in m["input_ids"]) for micro in steps
    ]


@pytest.mark.parametrize(
    "preset, steps, accumulation",
    [
        pytest.param("economy", 3, 1, id="economy"),
        pytest.param("economy", 2, 2, id="economy accumulated"),
        pytest.param("transformer", 2, 1, id="transformer", marks=pytest.mark.slow),
        # HessMaxEV's Lanczos and the curvature diagonals: a step in no_sync() on each process
        pytest.param("full", 2, 1, id="full", marks=pytest.mark.slow),
    ],
)
def test_two_processes_equal_one_process_on_the_global_batch(
    tmp_path, preset, steps, accumulation
):
    ranks = on_ranks(_trainer_on_a_rank, WORLD, tmp_path, tmp_path, preset, steps, accumulation)
    model = tiny_gpt2()
    single = trainer_for(
        tmp_path / "single",
        copy.deepcopy(model),
        configuration(preset),
        steps=steps,
        batch=WORLD * PER_PROCESS,
        accumulation=accumulation,
        max_grad_norm=0.05,
    )
    single.train()
    expected = single.cockpit.get_output()
    single.cockpit.close()
    # the processes' shards of each step are the one process's batch
    shards = [_rows(seen, accumulation) for seen, _, _ in ranks]
    assert [sorted(a + b) for a, b in zip(*shards, strict=True)] == _rows(
        single.seen, accumulation
    )
    # each process's num_items_in_batch counts the tokens of both: the one process's count
    for seen, _, _ in ranks:
        assert [int(c) for _, c in seen] == [int(c) for _, c in single.seen]
    assert sorted(expected) == list(range(steps))
    single_records = [r for r in single.state.log_history if "loss" in r]
    drawn = {t: {q: expected[t].pop(q) for q in DRAWN if q in expected[t]} for t in expected}
    for rank, (_, output, log_history) in enumerate(ranks):
        for t, values in drawn.items():
            assert set(values) <= set(output[t])
            assert all(np.sum(output[t].pop(q)) > 0 for q in values), output[t]
        _assert_same_counts(output, copy.deepcopy(expected))
        assert_same_output(output, _without_counts(expected), rel=RTOL, abs=1e-10)
        records = [r for r in log_history if "loss" in r]
        assert len(records) == steps
        for record, alone in zip(records, single_records, strict=True):
            # the Trainer's own loss and gradient norm: the global batch's
            assert record["loss"] == pytest.approx(alone["loss"], rel=1e-6)
            assert record["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-9)
            if rank == 0:  # the cockpit's sinks receive the values on rank 0
                names = [k for k in alone if k.startswith("cockpit/") and k[8:] not in DRAWN]
                assert {"cockpit/Loss", "cockpit/GradNorm"} <= set(names) <= set(record)
                for name in names:
                    assert record[name] == pytest.approx(alone[name], rel=1e-9), name
                assert record["cockpit/GradNorm"] == pytest.approx(record["grad_norm"], rel=1e-9)
            else:
                assert not any(key.startswith("cockpit/") for key in record), record


# FSDP2 as the Trainer is asked for it (accelerate's FullyShardedDataParallelPlugin)
FSDP2 = {
    "fsdp": True,
    "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
}


def _fsdp_asked_on_a_rank(rank, world, tmp_path, steps):
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    trainer = trainer_for(
        tmp_path / f"rank{rank}",
        tiny_gpt2(),
        configuration("economy"),
        steps=steps,
        batch=PER_PROCESS,
        samples=steps * world * PER_PROCESS,
        ddp_backend="gloo",
        **FSDP2,
    )
    trainer.train()
    wrapper = type(trainer.model_wrapped).__name__
    output = trainer.cockpit.get_output()
    trainer.cockpit.close()
    return trainer.is_fsdp_enabled, wrapper, output


@pytest.mark.slow
def test_fsdp_asked_of_cpu_processes_trains_ddp_with_the_global_batch_values(tmp_path):
    """accelerate 1.15 shards with FSDP on accelerators only: on CPU processes (its MULTI_CPU
    state) it drops the FSDP plugin and the Trainer trains under DistributedDataParallel, whose
    values the cockpit gives as one process's on the global batch."""
    steps = 2
    ranks = on_ranks(_fsdp_asked_on_a_rank, WORLD, tmp_path, tmp_path, steps)
    single = trainer_for(
        tmp_path / "single", tiny_gpt2(), configuration("economy"), steps=steps, batch=4
    )
    single.train()
    expected = single.cockpit.get_output()
    single.cockpit.close()
    for fsdp_enabled, wrapper, output in ranks:
        assert (fsdp_enabled, wrapper) == (False, "DistributedDataParallel")
        assert_same_output(output, expected, rel=RTOL, abs=1e-10)
