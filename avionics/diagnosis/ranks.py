"""Findings about the processes of a data-parallel run, from its per-rank view (``Ranks``): a
straggler (a rank whose step takes far longer than the others') and a shard whose loss or
gradient norm is far above the others'.

Each rank's value at a step is compared with the median of the *other* ranks' values at that
step (with two processes: the other one), as a ratio; a rank is found when the median of its
ratio over the tracked steps is at least the threshold (one slow or odd step is not a
finding), over at least ``MIN_STEPS`` steps.
"""

from __future__ import annotations

import numpy as np

from avionics.diagnosis.finding import Finding
from avionics.records.ranks import rank_series, ratios_to_the_others

MIN_STEPS = 3
STRAGGLER_RATIO = 2.0  # its step time over the others' median
STRAGGLER_SECONDS = 0.005  # ... and at least this much longer (timer noise of fast steps)
OUTLIER_RATIO = 3.0  # its loss or gradient norm over the others'
OUTLIERS = (("loss", "loss"), ("grad_norm", "gradient norm"))


def _typical(ratios: np.ndarray) -> np.ndarray:
    """Per rank the median of its finite ratios, nan with fewer than MIN_STEPS of them."""
    counts = np.isfinite(ratios).sum(0)
    with np.errstate(all="ignore"):
        medians = np.nanmedian(np.where(np.isfinite(ratios), ratios, np.nan), axis=0)
    return np.where(counts >= MIN_STEPS, medians, np.nan)


def straggler_ranks(run) -> list[Finding]:
    """A rank whose step time (outside the collectives) is an outlier among the ranks'."""
    steps, fields = rank_series(run)
    times = fields["step_time"]
    if len(steps) < MIN_STEPS or times.shape[1] < 2:
        return []
    typical = _typical(ratios_to_the_others(times))
    findings = []
    for rank in np.flatnonzero(typical >= STRAGGLER_RATIO):
        others = np.nanmedian(np.delete(times, rank, axis=1), axis=1)
        excess = np.nanmedian(times[:, rank] - others)
        if not excess >= STRAGGLER_SECONDS:
            continue
        sizes = fields["batch_size"]
        findings.append(
            Finding(
                check="straggler_ranks",
                title=f"Rank {rank} is a straggler: its steps take {typical[rank]:.1f}x the "
                "other ranks'",
                evidence=f"median over {len(steps)} tracked steps ({steps[0]}-{steps[-1]}) of "
                f"the time from the end of one step to the backward of the next (optimizer "
                f"step, data loading, forward): {np.nanmedian(times[:, rank]) * 1e3:.1f} ms on "
                f"rank {rank}, {np.nanmedian(others) * 1e3:.1f} ms on the others; its batch "
                f"has {np.nanmedian(sizes[:, rank]):.0f} samples (the others "
                f"{np.nanmedian(np.delete(sizes, rank, axis=1)):.0f}). Every rank waits for it "
                "in the gradient all-reduce.",
                advice=f"look at rank {rank}'s host and device: its data loader (more workers, "
                "pinned memory, a local copy of the data), another job or throttling on its "
                "GPU, a larger shard than the others' (balance the sampler), or work that only "
                "it does (logging, checkpoints, evaluation on rank 0 inside the step).",
                step=int(steps[0]),
            )
        )
    return findings


def outlier_shards(run) -> list[Finding]:
    """A rank whose shard's loss or gradient norm is far above the other ranks'."""
    steps, fields = rank_series(run)
    if len(steps) < MIN_STEPS or fields["loss"].shape[1] < 2:
        return []
    findings = []
    for field, label in OUTLIERS:
        values = fields[field]
        typical = _typical(ratios_to_the_others(values))
        for rank in np.flatnonzero(typical >= OUTLIER_RATIO):
            others = np.nanmedian(np.delete(values, rank, axis=1), axis=1)
            findings.append(
                Finding(
                    check="outlier_shards",
                    title=f"Rank {rank}'s shard has a {label} {typical[rank]:.1f}x the other "
                    "ranks'",
                    evidence=f"median over {len(steps)} tracked steps ({steps[0]}-{steps[-1]}) "
                    f"of each rank's own {label} (of its shard alone, before the all-reduce): "
                    f"{np.nanmedian(values[:, rank]):.4g} on rank {rank}, "
                    f"{np.nanmedian(others):.4g} on the others.",
                    advice=f"rank {rank} reads different data: check the sampler "
                    "(DistributedSampler with set_epoch, the same seed on every rank), how the "
                    "data set is split into shards (one file or source per rank), corrupt or "
                    "mislabelled samples in its shard (LossOutliers names them), and its "
                    "preprocessing (a transform or tokenizer that differs on that host).",
                    step=int(steps[0]),
                )
            )
    return findings
