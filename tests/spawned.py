"""Run a function on several gloo processes from inside a test, bounded in time.

``on_ranks(fn, world, tmp_path, *args)`` spawns ``world`` processes; each joins one gloo group
and calls ``fn(rank, world, *args)``; what each returns comes back, in rank order, through a
file in ``tmp_path`` (torch.save). A process that raises fails the test with its traceback.
"""

from __future__ import annotations

import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, out, fn, args):
    torch.set_num_threads(1)
    result_file = Path(out) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        try:
            torch.save({"value": fn(rank, world, *args)}, result_file)
        finally:
            dist.destroy_process_group()
    except BaseException:
        torch.save({"error": traceback.format_exc()}, result_file)
        raise


def on_ranks(fn, world: int, tmp_path, *args) -> list:
    """[fn(0, world, *args), ..., fn(world - 1, world, *args)], each on its own process."""
    out = Path(tmp_path) / f"ranks-{fn.__name__}-{world}"
    out.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(
        _entry,
        args=(world, _free_port(), str(out), fn, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        # each process's own exit (a raise, or a kill by gloo while the group is torn down
        # after it saved its result) is judged by its result file below
        for process in context.processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = []
    for rank in range(world):
        file = out / f"rank{rank}.pt"
        assert file.exists(), f"rank {rank} returned nothing (killed or timed out)"
        result = torch.load(file, weights_only=False)
        assert "error" not in result, f"rank {rank} raised:\n{result['error']}"
        results.append(result["value"])
    return results
