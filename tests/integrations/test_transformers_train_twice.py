"""CockpitTrainer.train() a second time on the same trainer (issue 28, item 8): refused
before it starts, naming the Trainer's remedy; the first run's values stay as they were."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from avionics import quantities  # noqa: E402
from integrations.test_transformers import tiny_gpt2, trainer_for  # noqa: E402


def test_a_second_train_is_refused_with_the_trainers_remedy(tmp_path):
    trainer = trainer_for(tmp_path, tiny_gpt2(), [quantities.Loss()], steps=2)
    trainer.train()
    before = dict(trainer.cockpit.get_output())
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(RuntimeError, match=r"train\(\) ran before on this trainer") as refused:
        trainer.train()
    assert "Build a new CockpitTrainer" in str(refused.value)
    assert "resume_from_checkpoint" in str(refused.value)
    assert dict(trainer.cockpit.get_output()) == before and sorted(before) == [0, 1]
    assert all((p == w).all() for p, w in zip(trainer.model.parameters(), weights))
    trainer.cockpit.close()
