"""Smoke runs of the benchmarks: ``--quick`` runs every cell and writes nothing."""

import re

import pytest

from benchmarks import real_models


def refuse_writing(monkeypatch, benchmark) -> None:
    """Make ``benchmark``'s write of its BENCHMARKS.md section fail the test."""

    def refuse(*args):
        raise AssertionError("a --quick run must not write BENCHMARKS.md")

    monkeypatch.setattr(benchmark, "write_section", refuse)


def test_real_models_quick_prints_every_cell_and_writes_nothing(capsys, monkeypatch):
    refuse_writing(monkeypatch, real_models)
    real_models.main(["--quick"])
    out = capsys.readouterr().out
    presets = "|".join(real_models.PRESETS)
    rows = re.findall(
        rf"^\| (.+?) \| [\d,]+ \| \S+ \| ({presets}) \| (\S+) \| ([\d.]+)", out, re.M
    )
    cells = {(model, preset) for model, preset, _, _ in rows}
    assert cells == {(t, p) for t in real_models.TITLES.values() for p in real_models.PRESETS}
    for _, preset, variant, ratio in rows:
        assert float(ratio) > 0
        # economy and transformer compute no curvature diagonal; "auto" names what it chose
        no_diagonal = preset in ("economy", "transformer")
        expected = {"-"} if no_diagonal else {"diag_h", "diag_ggn_exact", "diag_ggn_mc"}
        assert variant in expected


def test_real_models_refuses_an_unknown_model(capsys):
    with pytest.raises(SystemExit):
        real_models.main(["--quick", "--models", "vgg"])
    assert "argument --models: invalid choice: 'vgg'" in capsys.readouterr().err


def test_engine_speed_quick_floors_equal_avionics_and_every_row_is_there(capsys, monkeypatch):
    import torch
    from torch import nn

    from benchmarks import engine_speed, floors

    refuse_writing(monkeypatch, engine_speed)
    engine_speed.main(["--quick"])
    out = capsys.readouterr().out
    # every floor's gradient tests equal avionics' (float64, two steps) on every tiny model
    exact = dict(re.findall(r"^\* (tiny-\w+): floors = avionics within (\S+) ", out, re.M))
    assert set(exact) == set(engine_speed.QUICK)
    assert all(float(v) <= 1e-8 for v in exact.values()), exact
    rows = re.findall(r"^\| (tiny [^|]+?) \| [^|]+ \| ([^|]+?) \| ([^|]+?) \|", out, re.M)
    expected = {"plain", *(f"avionics {r}" for r in engine_speed.AVIONICS),
                *(f"floor {r}" for r in floors.KINDS), *engine_speed.PEERS}  # fmt: skip
    for *_, title in engine_speed.QUICK.values():
        assert {row for t, row, _ in rows if t == title} == expected
    problem = {title: key for key, (*_, title) in engine_speed.QUICK.items()}
    for title, row, ratio in rows:
        # a peer that cannot run the model (tied weights) or is not installed: '-' and why
        if engine_speed._refused(row, problem[title]):
            assert ratio.startswith("- (") and len(ratio) > 10, (title, row, ratio)
        else:
            assert float(ratio.split("-")[0]) > 0, (title, row, ratio)
    assert engine_speed._refused("Opacus ghost clipping", "tiny-gpt")
    # the two per-sample convolution kernels against a loop over samples
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2).double()
    x = torch.randn(3, 3, 9, 9, dtype=torch.float64)
    d = torch.randn_like(conv(x))
    loop = torch.stack([torch.autograd.grad((conv(x[n : n + 1]) * d[n]).sum(), conv.weight)[0]
                        for n in range(3)])  # fmt: skip
    assert torch.allclose(floors._grouped(x, d, conv), loop, rtol=1e-12, atol=1e-12)
    assert torch.allclose(floors._unfolded(x, d, conv).view_as(loop), loop, rtol=1e-12)
    with pytest.raises(SystemExit):
        engine_speed.main(["--quick", "--threads", "0"])
    assert "argument --threads: got '0'; give positive integers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="floor='NormTests'; choose one of NormTest, "):
        floors.Floor(nn.Linear(2, 2), None, "sgd", "NormTests")
    with pytest.raises(ValueError, match="no kernel for parameter '1.weight' .* freeze it"):
        floors.Floor(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), None)
    with pytest.raises(ValueError, match="'0' has groups=2, padding=.1, 1.*"):
        floors.Floor(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, groups=2)), None)


def test_curvature_operators_keeps_the_rows_it_does_not_measure():
    from benchmarks.curvature_operators import kept_rows

    section = (
        "## Curvature operators vs curvlinops\n\nmethod\n\n### MLP\n\nOne gradient: 1 ms.\n\n"
        "| operator | a | b |\n|---|---|---|\n| GGN | 1.0 | 2.0 |\n| KFAC | 3.0 | 4.0 |\n\n"
        "### 3c3d\n\n| operator | a | b | c |\n|---|---|---|---|\n"
        "| KFAC | 5.0 | n/a (RuntimeError) |  |\n"
    )
    assert kept_rows(section, "MLP") == {"GGN": ["1.0", "2.0"], "KFAC": ["3.0", "4.0"]}
    assert kept_rows(section, "3c3d") == {"KFAC": ["5.0", "n/a (RuntimeError)", ""]}
    assert kept_rows(section, "GPT") == {}


def test_conv_plans_times_every_plan_and_the_rules_choice_is_one_of_them(capsys):
    from benchmarks import conv_plans

    conv_plans.main(["--repeats", "1", "--no-write", "--layers", "ResNet 36->36 3x3, 4x4"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ResNet")]
    assert len(rows) == len(conv_plans.REQUESTS)
    for row in rows:
        _, rule, fastest, ratio, times = [cell.strip() for cell in row.strip("|").split("|")][1:]
        assert rule in times and fastest in times and float(ratio) >= 1.0
