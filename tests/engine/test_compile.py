"""MODEL.COMPILE: torch.compile named submodules in place, without changing what checkpoints hold."""
from __future__ import annotations

import pytest
import torch

from pet.engine.trainer import Trainer
from pet.utils.errors import ConfigError
from support.toys import InfiniteToyLoader, ToyModel


@pytest.mark.slow
def test_compiled_submodule_trains_and_keeps_its_state_dict_keys(make_cfg):
    model = ToyModel()
    keys = list(model.state_dict())
    cfg = make_cfg("SOLVER.MAX_ITER", 3, "MODEL.COMPILE", "['linear']", "TRAIN.SAVE_AS_JSON", False)
    trainer = Trainer(cfg, model=model, data_loader=InfiniteToyLoader(), default_hooks=False)
    assert model.linear._compiled_call_impl is not None and model.bn._compiled_call_impl is None
    before = model.linear.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, model.linear.weight)  # the compiled module learnt
    assert list(model.state_dict()) == keys
    assert torch.isfinite(torch.tensor(trainer.storage.history("total_loss").latest()))


def test_unknown_submodule_is_a_clear_error(make_cfg):
    cfg = make_cfg("MODEL.COMPILE", "['backbone']")
    with pytest.raises(ConfigError, match="MODEL.COMPILE names 'backbone', which is not a submodule of ToyModel"):
        Trainer(cfg, model=ToyModel(), data_loader=InfiniteToyLoader(), default_hooks=False)
