"""Resuming with another schedule continues on the new one; another optimizer type needs --resume-weights-only."""
from __future__ import annotations

import pytest
import torch

from pet.engine.hooks import TrainHook
from pet.engine.optim import build_lr_scheduler
from pet.engine.trainer import Trainer
from pet.utils.errors import ConfigError
from support.toys import IndexedToyLoader, ToyModel

SCHEDULE = ("SOLVER.LR_POLICY", "step", "SOLVER.WARMUP_ITERS", 2, "SOLVER.BASE_LR", 0.1, "TRAIN.AUTO_RESUME", True,
            "HOOKS.CHECKPOINT.PERIOD", 6)


class LRRecorder(TrainHook):
    """The learning rate each iteration trained with (before LRScheduler steps it)."""

    priority = "HIGHEST"

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def before_step(self, trainer, **kwargs):
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])


def _run(cfg) -> tuple[Trainer, LRRecorder]:
    torch.manual_seed(0)
    trainer = Trainer(cfg, model=ToyModel(), data_loader=IndexedToyLoader())
    recorder = LRRecorder()
    trainer.register_hooks([recorder])
    trainer.train()
    return trainer, recorder


def _expected_lrs(cfg, first: int, last: int) -> list[float]:
    """The LR of iterations first..last (1-based) under ``cfg``'s schedule, from a fresh scheduler."""
    optimizer = torch.optim.SGD(ToyModel().parameters(), lr=cfg.SOLVER.BASE_LR)
    scheduler = build_lr_scheduler(cfg, optimizer, cfg.SOLVER.MAX_ITER)
    lrs = []
    for _ in range(last):
        lrs.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return lrs[first - 1:]


def test_a_larger_max_iter_and_new_steps_follow_the_new_schedule_exactly(make_cfg, caplog):
    _run(make_cfg(*SCHEDULE, "SOLVER.MAX_ITER", 6, "SOLVER.STEPS", "(4,)"))
    new_cfg = make_cfg(*SCHEDULE, "SOLVER.MAX_ITER", 12, "SOLVER.STEPS", "(8, 10)", "SOLVER.BASE_LR", 0.2,
                       "SOLVER.WEIGHT_DECAY", 0.01)
    with caplog.at_level("INFO", logger="pet"):
        trainer, recorder = _run(new_cfg)
    assert trainer.start_iter == 6 and trainer.iter == 12
    assert recorder.lrs == _expected_lrs(new_cfg, 7, 12)  # 0.2 until 8, then 0.02, then 0.002
    assert recorder.lrs == pytest.approx([0.2, 0.2, 0.02, 0.02, 0.002, 0.002])
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.01  # this run's setting, the checkpoint's state
    assert trainer.optimizer.state  # (momentum buffers) came from the checkpoint
    changed = [r.getMessage() for r in caplog.records if "changed schedule" in r.getMessage()]
    assert changed == ["Resumed with a changed schedule (MAX_ITER 6 -> 12; BASE_LR 0.1 -> 0.2; STEPS [4] -> [8, 10]; "
                       "WEIGHT_DECAY 0.0001 -> 0.01): the learning rate follows the new schedule from iteration 6."]


def test_the_same_schedule_logs_no_change(make_cfg, caplog):
    _run(make_cfg(*SCHEDULE, "SOLVER.MAX_ITER", 6))
    with caplog.at_level("INFO", logger="pet"):
        _run(make_cfg(*SCHEDULE, "SOLVER.MAX_ITER", 6))
    assert "changed schedule" not in caplog.text


def test_another_optimizer_type_is_a_clear_error_unless_weights_only(make_cfg):
    first, _ = _run(make_cfg(*SCHEDULE, "SOLVER.MAX_ITER", 6))
    cfg = make_cfg(*SCHEDULE, "SOLVER.MAX_ITER", 9, "SOLVER.OPTIMIZER", "AdamW")
    with pytest.raises(ConfigError, match="trained with SGD, this run uses AdamW.*--resume-weights-only"):
        _run(cfg)

    torch.manual_seed(0)
    trainer = Trainer(cfg, model=ToyModel(), data_loader=IndexedToyLoader())
    trainer.resume_or_load(resume=True, weights_only=True)
    assert trainer.start_iter == 6 and not trainer.optimizer.state  # fresh AdamW, weights and iteration resumed
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, first.model.state_dict()[name]), name
    trainer.train()
    assert trainer.iter == 9 and trainer.optimizer.state
