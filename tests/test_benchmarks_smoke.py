"""Smoke runs of the benchmarks: ``--quick`` runs every cell and writes nothing."""

import re

import pytest

from benchmarks import real_models


def test_real_models_quick_prints_every_cell_and_writes_nothing(capsys, monkeypatch):
    def refuse(*args):
        raise AssertionError("a --quick run must not write BENCHMARKS.md")

    monkeypatch.setattr(real_models, "write_section", refuse)
    real_models.main(["--quick"])
    out = capsys.readouterr().out
    rows = re.findall(
        r"^\| (.+?) \| [\d,]+ \| \S+ \| (economy|business|full) \| (\S+) \| ([\d.]+)", out, re.M
    )
    cells = {(model, preset) for model, preset, _, _ in rows}
    assert cells == {(t, p) for t in real_models.TITLES.values() for p in real_models.PRESETS}
    for _, preset, variant, ratio in rows:
        assert float(ratio) > 0
        # economy computes no curvature diagonal; "auto" names the variant it chose
        expected = {"-"} if preset == "economy" else {"diag_h", "diag_ggn_exact", "diag_ggn_mc"}
        assert variant in expected


def test_real_models_refuses_an_unknown_model(capsys):
    with pytest.raises(SystemExit):
        real_models.main(["--quick", "--models", "vgg"])
    assert "argument --models: invalid choice: 'vgg'" in capsys.readouterr().err
