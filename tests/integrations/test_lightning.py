"""CockpitCallback in the real lightning.Trainer (CPU, a tiny MLP, a few steps): its values
equal those of a plain avionics loop on the same data from the same weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from compare import assert_same_output
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from avionics import Cockpit, configuration, read_run  # noqa: E402
from avionics.integrations.lightning import CockpitCallback  # noqa: E402
from avionics.quantities import (  # noqa: E402
    Alpha,
    Distance,
    GradHist1d,
    GradHist2d,
    GradNorm,
    Loss,
    NormTest,
    UpdateSize,
)
from avionics.records.encoding import to_python  # noqa: E402

N, D_IN, D_OUT, BATCHES = 8, 4, 3, 3
LR = 0.3


def make_data(dtype=torch.float64, batches=BATCHES):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(N * batches, D_IN, generator=g, dtype=dtype)
    y = torch.randint(0, D_OUT, (N * batches,), generator=g)
    return X, y


def make_net(dtype=torch.float64):
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(D_IN, 5), nn.Tanh(), nn.Linear(5, D_OUT)).to(dtype)


class Classifier(pl.LightningModule):
    """Returns {"loss", "individual_losses"} from training_step (automatic optimisation)."""

    def __init__(self, net, optimizer=torch.optim.SGD):
        super().__init__()
        self.net, self.optimizer = net, optimizer

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        return {"loss": losses.mean(), "individual_losses": losses}

    def validation_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=LR)


class ManualClassifier(Classifier):
    """Manual optimisation: passes the per-sample losses to manual_backward."""

    def __init__(self, net, optimizer=torch.optim.SGD):
        super().__init__(net, optimizer)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        losses = F.cross_entropy(self(x), y, reduction="none")
        self.manual_backward(losses.mean(), individual_losses=losses)
        opt.step()


def fit(
    module,
    callback,
    tmp_path,
    data,
    batch_size=N,
    val_data=None,
    ckpt_path=None,
    **trainer_options,
):
    loader = DataLoader(TensorDataset(*data), batch_size=batch_size, shuffle=False)
    val = DataLoader(TensorDataset(*val_data), batch_size=N) if val_data is not None else None
    options = dict(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=pl.loggers.CSVLogger(tmp_path),
        num_sanity_val_steps=0,
    )
    trainer = pl.Trainer(callbacks=[callback], **{**options, **trainer_options})
    trainer.fit(module, loader, val, ckpt_path=ckpt_path)
    return trainer


def plain_loop(net, quantities, data, optimizer=torch.optim.SGD, batch_size=N, clip=None):
    """The README's loop on the same batches; optionally clipping the gradients' norm as
    Lightning's gradient_clip_val does (after the backward, before the step)."""
    X, y = data
    opt = optimizer(net.parameters(), lr=LR)
    cockpit = Cockpit(net, quantities)
    for step, start in enumerate(range(0, len(X), batch_size)):
        x, t = X[start : start + batch_size], y[start : start + batch_size]
        opt.zero_grad()
        losses = F.cross_entropy(net(x), t, reduction="none")
        loss = losses.mean()
        info = {"loss": loss, "individual_losses": losses, "batch_size": len(x), "optimizer": opt}
        with cockpit(step, info):
            loss.backward(create_graph=cockpit.create_graph(step))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    cockpit.close()
    return cockpit.get_output()


def assert_close(actual, expected, rel, path="values"):
    """Equal nested values to a relative tolerance (and an absolute one of rel / 1000)."""
    assert_same_output(actual, expected, rel, rel * 1e-3, (path,))


def without_time(output):
    return {s: {k: v for k, v in named.items() if k != "Time"} for s, named in output.items()}


def test_every_full_quantity_equals_a_plain_loop(tmp_path):
    """Also after a sanity-check validation pass (inference mode: nothing captured)."""
    data, net = make_data(), make_net()
    expected = plain_loop(copy.deepcopy(net), configuration("full"), data)
    callback = CockpitCallback(configuration("full"), log=tmp_path / "run")
    fit(
        Classifier(net),
        callback,
        tmp_path,
        data,
        val_data=make_data(batches=1),
        num_sanity_val_steps=1,
    )
    output = callback.cockpit.get_output()
    assert sorted(output) == list(range(BATCHES))
    assert {q.name for q in configuration("full")} <= set(output[0])
    assert_close(to_python(dict(output)), to_python(dict(expected)), rel=1e-10)
    assert read_run(tmp_path / "run").steps[1]["NormTest"] == to_python(output[1]["NormTest"])


def test_manual_optimisation_equals_a_plain_loop(tmp_path):
    data, net = make_data(), make_net()
    quantities = configuration("full")
    expected = plain_loop(copy.deepcopy(net), configuration("full"), data)
    callback = CockpitCallback(quantities)
    fit(ManualClassifier(net), callback, tmp_path, data)
    assert_close(to_python(dict(callback.cockpit.get_output())), to_python(dict(expected)), 1e-10)


def test_gradient_norm_is_before_clipping_and_the_update_after(tmp_path):
    """Lightning clips in on_before_optimizer_step, after the block: GradNorm is the norm
    before clipping, UpdateSize the clipped step's, lr * clip (to 1e-4: clip_grad_norm_
    divides by the norm + 1e-6)."""
    data, net, clip = make_data(), make_net(), 0.05
    quantities = [Loss(), GradNorm(), UpdateSize(), Distance(), NormTest()]
    expected = plain_loop(copy.deepcopy(net), [type(q)() for q in quantities], data, clip=clip)
    callback = CockpitCallback(quantities)
    fit(Classifier(net), callback, tmp_path, data, gradient_clip_val=clip)
    output = to_python(dict(callback.cockpit.get_output()))
    assert_close(output, to_python(dict(expected)), rel=1e-10)
    for step in range(BATCHES - 1):
        assert math.hypot(*output[step]["GradNorm"]) > 2 * clip
        assert math.isclose(math.hypot(*output[step]["UpdateSize"]), LR * clip, rel_tol=1e-4)


def test_a_loss_fn_gives_the_per_sample_losses(tmp_path):
    class Logits(Classifier):
        def training_step(self, batch, batch_idx):
            out = self(batch[0])
            return {"loss": F.cross_entropy(out, batch[1]), "logits": out}

    def per_sample(output, batch):
        return F.cross_entropy(output["logits"], batch[1], reduction="none")

    data, net = make_data(), make_net()
    expected = plain_loop(copy.deepcopy(net), configuration("economy"), data)
    callback = CockpitCallback(configuration("economy"), loss_fn=per_sample)
    fit(Logits(net), callback, tmp_path, data)
    assert_close(to_python(dict(callback.cockpit.get_output())), to_python(dict(expected)), 1e-10)


def test_bf16_mixed_is_close_to_float32(tmp_path):
    """precision="bf16-mixed" (autocast to bfloat16 on CPU: the Linear layers compute in
    bfloat16, cross_entropy in float32) against a float32 plain loop. bfloat16 keeps 8 bits of
    mantissa (relative rounding 2^-9 per operation); measured: Loss 4e-4, the gradient tests
    2e-3, GradNorm, Distance, UpdateSize, Alpha 8e-3, HessTrace 2e-2 relative deviation, so
    5 % here. TICDiag, which divides by each Hessian diagonal entry + 1e-7, is left out: its
    small entries differ by 86 %."""
    data, net = make_data(torch.float32), make_net(torch.float32)
    expected = plain_loop(copy.deepcopy(net), configuration("full"), data)
    callback = CockpitCallback(configuration("full"))
    fit(Classifier(net), callback, tmp_path, data, precision="bf16-mixed")
    output = to_python(dict(callback.cockpit.get_output()))
    assert sorted(output) == sorted(expected)
    names = {q.name for q in configuration("full")} - {"TICDiag", "GradHist1d", "GradHist2d"}
    for step, named in to_python(dict(expected)).items():
        for name in names & set(named):
            assert_close(output[step][name], named[name], rel=0.05, path=f"{step}: {name}")


def test_the_tensorboard_logger_gets_scalars_at_their_steps_and_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, net = make_data(), make_net()
    quantities = [Loss(), GradNorm(), Alpha(), GradHist1d(), GradHist2d()]
    callback = CockpitCallback(quantities)
    logger = pl.loggers.TensorBoardLogger(tmp_path)
    fit(Classifier(net), callback, tmp_path, data, logger=logger)
    output = to_python(dict(callback.cockpit.get_output()))
    events = EventAccumulator(logger.log_dir, size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()

    def scalars(tag):
        return {e.step: e.value for e in events.Scalars(tag)}

    assert scalars("avionics/Loss") == pytest.approx({s: output[s]["Loss"] for s in output})
    # Alpha of step t is known at step t + 1 and logged at t
    assert sorted(scalars("avionics/Alpha")) == list(range(BATCHES - 1))
    assert scalars("avionics/Alpha") == pytest.approx(
        {s: output[s]["Alpha"] for s in range(BATCHES - 1)}, rel=1e-6
    )
    norms = scalars("avionics/GradNorm/net.0.weight")
    assert norms == pytest.approx({s: output[s]["GradNorm"][0] for s in output}, rel=1e-6)
    assert {"avionics/GradHist1d", "avionics/GradHist2d/gradient"} <= set(
        events.Tags()["histograms"]
    )
    n_elements = N * sum(p.numel() for p in net.parameters())
    for tag in ("avionics/GradHist1d", "avionics/GradHist2d/gradient"):
        histograms = events.Histograms(tag)
        assert [h.step for h in histograms] == list(range(BATCHES))
        assert histograms[0].histogram_value.num == n_elements
    counts = events.Histograms("avionics/GradHist1d")[1].histogram_value.bucket
    assert list(counts) == output[1]["GradHist1d"]["hist"]


def test_the_mlflow_logger_gets_scalars_and_per_parameter_values(tmp_path, monkeypatch):
    """MLflow's file store keeps a metric in a file of its name: the per-parameter values
    go under ``Name_per_parameter/...`` so that ``Name`` and they can both be stored."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    data, net = make_data(), make_net()
    callback = CockpitCallback([Loss(), GradNorm(), GradHist1d()])
    logger = pl.loggers.MLFlowLogger(experiment_name="lightning", tracking_uri=uri)
    fit(Classifier(net), callback, tmp_path, data, logger=logger)
    output = to_python(dict(callback.cockpit.get_output()))
    client = MlflowClient(tracking_uri=uri)

    def series(key):
        return {m.step: m.value for m in client.get_metric_history(logger.run_id, key)}

    assert series("avionics/Loss") == pytest.approx({s: output[s]["Loss"] for s in output})
    norms = series("avionics/GradNorm")  # the whole gradient's norm
    total = {s: math.sqrt(sum(v * v for v in output[s]["GradNorm"])) for s in output}
    assert norms == pytest.approx(total, rel=1e-6)
    for i, (name, _) in enumerate(net.named_parameters()):
        values = series(f"avionics/GradNorm_per_parameter/net.{name}")
        assert values == pytest.approx({s: output[s]["GradNorm"][i] for s in output}, rel=1e-6)


def test_accumulated_batches_equal_one_batch_of_all_their_samples(tmp_path):
    """accumulate_grad_batches=2 over 5 batches: Lightning backpropagates loss / 2 of each
    half, and steps after the fifth batch alone; each step's values are those of one batch of
    all its samples (2N, 2N, N), Alpha included (its block runs inside optimizer.step(closure))."""
    data, net = make_data(batches=5), make_net()
    expected = plain_loop(copy.deepcopy(net), configuration("full"), data, batch_size=2 * N)
    callback = CockpitCallback(configuration("full"))
    fit(Classifier(net), callback, tmp_path, data, accumulate_grad_batches=2)
    output = callback.cockpit.get_output()
    assert sorted(output) == [0, 1, 2]
    assert_close(to_python(dict(output)), to_python(dict(expected)), rel=1e-10)


def test_validation_between_the_steps_changes_no_value(tmp_path):
    """val_check_interval=1: a validation pass (and Lightning's zero_grad before it) after
    every optimiser step."""
    data, net = make_data(), make_net()
    expected = plain_loop(copy.deepcopy(net), configuration("full"), data)
    callback = CockpitCallback(configuration("full"))
    fit(
        Classifier(net),
        callback,
        tmp_path,
        data,
        val_data=make_data(batches=1),
        val_check_interval=1,
    )
    assert_close(to_python(dict(callback.cockpit.get_output())), to_python(dict(expected)), 1e-10)


def test_missing_per_sample_losses_are_refused_before_the_step(tmp_path):
    class LossOnly(Classifier):
        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1])

    data, net = make_data(), make_net()
    before = [p.detach().clone() for p in net.parameters()]
    callback = CockpitCallback([Loss(), NormTest()])
    with pytest.raises(KeyError, match=r"Step 0: NormTest.*'individual_losses': losses"):
        fit(LossOnly(net), callback, tmp_path, data)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))  # no step taken
    assert callback.cockpit.get_output() == {}


def test_manual_optimisation_without_per_sample_losses_says_where_to_pass_them(tmp_path):
    class NoLosses(ManualClassifier):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self(batch[0]), batch[1]))
            opt.step()

    callback = CockpitCallback([NormTest()])
    with pytest.raises(KeyError, match=r"self.manual_backward\(loss, individual_losses=losses\)"):
        fit(NoLosses(make_net()), callback, tmp_path, make_data())


def test_the_strategy_is_restored_after_the_fit(tmp_path):
    callback = CockpitCallback([Loss()])
    trainer = fit(Classifier(make_net()), callback, tmp_path, make_data())
    assert "backward" not in vars(trainer.strategy)
    assert "training_step" not in vars(trainer.strategy)
    with pytest.raises(RuntimeError, match="closed"):
        callback.cockpit(BATCHES, {"loss": torch.tensor(1.0)}).__enter__()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"individual_losses": ""}, r"individual_losses=\.\.\.\).*got ''"),
        ({"loss_fn": 3}, r"loss_fn=\.\.\.\).*got 3"),
        ({"prefix": None}, r"prefix=\.\.\.\) must be a str, got None"),
        ({"first_step": 3}, r"\['first_step'\].*global_step"),
    ],
)
def test_bad_arguments_are_refused(options, match):
    with pytest.raises(TypeError, match=match):
        CockpitCallback(**options)


# Lightning's "ddp" strategy starts the other process by running the same command again: a
# script, not this test (ddp_spawn would pickle the quantities, whose schedules are closures)
DDP_SCRIPT = """
import os, sys
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from integrations.test_lightning import BATCHES, N, Classifier, make_data, make_net, pl
from avionics import configuration
from avionics.integrations.lightning import CockpitCallback
from avionics.records.encoding import to_python

out, rank = Path(sys.argv[1]), int(os.environ.get("LOCAL_RANK", 0))
torch.set_num_threads(1)
dataset = TensorDataset(*make_data(batches=2 * BATCHES))
shard = Subset(dataset, range(rank, len(dataset), 2))  # every second sample
callback = CockpitCallback(configuration("full"), log=out / "run")
ddp = pl.strategies.DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
trainer = pl.Trainer(
    strategy=ddp,
    accelerator="cpu", devices=2, max_epochs=1, use_distributed_sampler=False,
    callbacks=[callback], logger=False, num_sanity_val_steps=0, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False,
)
trainer.fit(Classifier(make_net()), DataLoader(shard, batch_size=N, shuffle=False))
torch.save(to_python(dict(callback.cockpit.get_output())), out / f"rank{rank}.pt")
"""


@pytest.mark.slow
def test_lightning_ddp_on_two_processes_gives_the_global_batch_values(tmp_path):
    """strategy=DDPStrategy (gloo, 2 CPU processes), each with every second sample: on both
    processes every "full" value is that of the global batch (the two shards' batches
    together, 2N contiguous samples), as a plain loop on one process gets it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parents[1]
    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)
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
        make_net(), configuration("full"), make_data(batches=2 * BATCHES), batch_size=2 * N
    )
    for rank in range(2):
        output = torch.load(tmp_path / f"rank{rank}.pt")
        assert sorted(output) == list(range(BATCHES))
        assert_close(output, to_python(dict(expected)), rel=1e-10, path=f"rank {rank}")
    assert read_run(tmp_path / "run").steps[2]["HessMaxEV"] == output[2]["HessMaxEV"]


def test_a_fit_resumed_from_a_checkpoint_continues_the_cockpit(tmp_path):
    """The callback's state (the cockpit's) travels in Lightning's checkpoint: the second
    epoch (steps 2, 3) of a fit resumed after the first equals that of one uninterrupted
    fit (Distance from step 0's parameters, the pending Alpha of step 1)."""
    data, net = make_data(batches=2), make_net()

    def economy():
        return CockpitCallback(configuration("economy"))

    whole, first, resumed = economy(), economy(), economy()
    fit(Classifier(copy.deepcopy(net)), whole, tmp_path, data, max_epochs=2)
    trainer = fit(Classifier(copy.deepcopy(net)), first, tmp_path, data, max_epochs=1)
    trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    fit(
        Classifier(copy.deepcopy(net)),
        resumed,
        tmp_path,
        data,
        max_epochs=2,
        ckpt_path=tmp_path / "epoch1.ckpt",
    )
    expected = to_python(dict(whole.cockpit.get_output()))
    output = to_python(dict(resumed.cockpit.get_output()))
    assert sorted(output) == [1, 2, 3]
    assert_close({s: output[s] for s in (2, 3)}, {s: expected[s] for s in (2, 3)}, rel=1e-10)
    assert_close(output[1], {k: expected[1][k] for k in ("Alpha", "UpdateSize")}, rel=1e-10)


class HoldsANetwork(Classifier):
    """A LightningModule that calls its network directly (``self.net(x)``, not ``self(x)``)
    and holds a frozen teacher beside it."""

    def __init__(self, net):
        super().__init__(net)
        self.teacher = copy.deepcopy(net).requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.teacher(x)  # another model's forward inside the step
        losses = F.cross_entropy(self.net(x), y, reduction="none")
        return {"loss": losses.mean(), "individual_losses": losses}


def test_full_sees_the_network_s_output_as_the_plain_loop_does(tmp_path):
    """configuration("full") under the callback on a LightningModule that holds its network:
    curvature="auto" sees the output (a GGN diagonal, not the exact Hessian diagonal of every
    weight) and the values are the plain loop's on the same network."""
    import warnings

    data = make_data()
    torch.manual_seed(3)
    wide = nn.Sequential(nn.Linear(D_IN, 600), nn.Tanh(), nn.Linear(600, D_OUT)).double()
    expected = plain_loop(copy.deepcopy(wide), configuration("full"), data)
    callback = CockpitCallback(configuration("full"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fit(HoldsANetwork(wide), callback, tmp_path, data)
    chosen = [str(w.message) for w in said if "(curvature='auto') computes" in str(w.message)]
    assert chosen and all("computes 'diag_ggn_exact'" in m for m in chosen), chosen
    output = without_time(to_python(dict(callback.cockpit.get_output())))
    assert_close(output, without_time(to_python(expected)), rel=1e-6)
