"""Smoke run of benchmarks/economy_floor.py: one round of the ResNet, nothing written."""

import re

from benchmarks import economy_floor


def test_economy_floor_prints_the_ratios_and_writes_nothing(capsys, monkeypatch):
    def refuse(*args):
        raise AssertionError("--no-write must not write BENCHMARKS.md")

    monkeypatch.setattr(economy_floor, "write_section", refuse)
    economy_floor.main(["--models", "resnet", "--rounds", "1", "--warmup", "0", "--no-write"])
    out = capsys.readouterr().out
    row = re.search(r"^\| BasicBlock ResNet \| ([\d.]+) \| (-?[\d.]+) \| (-?[\d.]+) \|", out, re.M)
    assert row is not None and float(row.group(1)) > 0
