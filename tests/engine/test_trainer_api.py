"""The Python API as researchers use it: ``Trainer(cfg, model=..., optimizer=..., data_loader=...)``.

Any re-iterable of batches trains in iteration mode (a finite one is cycled, its sampler told
each pass's epoch), config keys mean what they mean for tools/train_net.py (TRAIN.AUTO_RESUME,
PreciseBN on the caller's data), and an empty loader is one clear error.
"""
from __future__ import annotations

import pytest
import torch

from pet.engine.hooks import MOUNT_POINTS, EvalHook, TrainHook
from pet.engine.models import default_evaluator_builder, default_model_builder, unwrap_model
from pet.engine.trainer import Trainer
from pet.evaluation import build_evaluator
from pet.modeling import META_ARCH_REGISTRY, build_model
from pet.utils.errors import TrainingError
from support.toys import ToyModel


def _batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(8, 4, generator=gen) * 3 for _ in range(count)]
    return [(x, x.sum(dim=1, keepdim=True)) for x in xs]


class RecordingModel(ToyModel):
    """Remembers which batch (by its first value) each training step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def forward(self, x, y):
        if self.training:
            self.seen.append(float(x[0, 0]))
        return super().forward(x, y)


class EpochRecordingSampler(torch.utils.data.Sampler):
    def __init__(self, size: int) -> None:
        self.size = size
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.size))

    def __len__(self) -> int:
        return self.size


def _trainer(cfg, model, loader) -> Trainer:
    return Trainer(cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), data_loader=loader)


@META_ARCH_REGISTRY.register()
class TrainerApiToyDetector(ToyModel):
    """A meta-architecture only this file's config names."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg = cfg


def test_trainer_builds_the_model_its_config_names(make_cfg):
    """``Trainer(cfg)`` with no model: Pet's own builders, which importing pet hands to the engine."""
    assert default_model_builder() is build_model and default_evaluator_builder() is build_evaluator
    cfg = make_cfg("MODEL.META_ARCHITECTURE", "TrainerApiToyDetector", "SOLVER.MAX_ITER", 2)
    trainer = Trainer(cfg, data_loader=_batches(2), default_hooks=False)
    assert type(unwrap_model(trainer.model)) is TrainerApiToyDetector and unwrap_model(trainer.model).cfg is cfg
    trainer.train()
    assert trainer.iter == 2


def test_iteration_mode_cycles_a_python_list_of_batches(make_cfg):
    batches = _batches(4)
    model = RecordingModel()
    trainer = _trainer(make_cfg("SOLVER.MAX_ITER", 25), model, batches)
    trainer.train()
    assert trainer.iter == 25
    assert model.seen == [float(batches[i % 4][0][0, 0]) for i in range(25)]


def test_iteration_mode_sets_the_sampler_epoch_on_every_pass(make_cfg):
    xs = torch.randn(16, 4)
    dataset = torch.utils.data.TensorDataset(xs, xs.sum(dim=1, keepdim=True))
    sampler = EpochRecordingSampler(len(dataset))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)  # 4 batches a pass
    _trainer(make_cfg("SOLVER.MAX_ITER", 25), RecordingModel(), loader).train()
    assert sampler.epochs == [0, 1, 2, 3, 4, 5, 6]  # 25 iterations = 6 full passes and a quarter


def test_an_empty_loader_is_one_clear_error(make_cfg):
    trainer = _trainer(make_cfg("SOLVER.MAX_ITER", 5), RecordingModel(), [])
    try:
        trainer.train()
    except TrainingError as exc:
        assert "yielded no batch" in str(exc) and "list" in str(exc)
    else:
        raise AssertionError("training on an empty loader did not fail")


class StopAt(TrainHook):
    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def after_step(self, trainer, **kwargs) -> None:
        if trainer.iter == self.iteration:
            trainer.stop_training = True


def test_auto_resume_from_python_continues_a_stopped_run_bit_identically(make_cfg, caplog):
    """Stopped by a hook at 6 of 12, a new Trainer built the same way with TRAIN.AUTO_RESUME True starts at 6."""
    batches = _batches(4)
    opts = ("SOLVER.MAX_ITER", 12, "TRAIN.AUTO_RESUME", True, "HOOKS.CHECKPOINT.PERIOD", 3)

    torch.manual_seed(0)
    first = _trainer(make_cfg(*opts), RecordingModel(), batches)
    first.register_hooks([StopAt(6)])
    first.train()
    assert first.iter == 6

    torch.manual_seed(0)
    resumed_model = RecordingModel()
    resumed = _trainer(make_cfg(*opts), resumed_model, batches)
    with caplog.at_level("INFO", logger="pet"):
        resumed.train()
    assert "at iteration 6" in caplog.text and "Starting training from iteration 6 to 12" in caplog.text
    assert resumed_model.seen == [float(batches[i % 4][0][0, 0]) for i in range(6, 12)]

    torch.manual_seed(0)
    straight_model = RecordingModel()
    straight = _trainer(make_cfg(*opts, "CKPT", str(first.output_dir) + "_straight"), straight_model, batches)
    straight.train()
    for (name, a), b in zip(resumed_model.state_dict().items(), straight_model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.numeric
def test_precise_bn_estimates_on_the_callers_loader(make_cfg):
    """With a caller's loader, HOOKS.PRECISE_BN draws from it (not from TRAIN.DATASETS): the BN mean becomes the
    mean of those batches."""
    batches = _batches(3, seed=1)
    model = RecordingModel()
    model.bn = torch.nn.BatchNorm1d(4)
    cfg = make_cfg("SOLVER.MAX_ITER", 2, "HOOKS.PRECISE_BN.ENABLED", True, "HOOKS.PRECISE_BN.NUM_ITER", 3)
    _trainer(cfg, model, batches).train()
    expected = torch.cat([x for x, _ in batches]).mean(dim=0)
    assert torch.allclose(model.bn.running_mean, expected, atol=1e-5)


class CounterProbe(TrainHook):
    """Records ``(point, trainer.iter, storage.iter)`` at every mount point."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []

    def _record(self, point: str, trainer, storage) -> None:
        self.seen.append((point, trainer.iter, storage.iter))


for _point in MOUNT_POINTS:
    setattr(CounterProbe, _point, lambda self, trainer, storage, _p=_point, **kw: self._record(_p, trainer, storage))


@pytest.mark.parametrize("mode", [("SOLVER.MAX_ITER", 6), ("SOLVER.MAX_EPOCHS", 3, "SOLVER.MAX_ITER", 0)],
                         ids=["iterations", "epochs"])
def test_one_counter_storage_iter_equals_trainer_iter_at_every_mount_point(make_cfg, mode):
    """Also across a resume: after_load_checkpoint and the resumed run's points see the same numbers."""
    opts = (*mode, "HOOKS.CHECKPOINT.PERIOD", 2, "TRAIN.AUTO_RESUME", True)
    first_probe = CounterProbe()
    first = _trainer(make_cfg(*opts), RecordingModel(), _batches(2))
    first.register_hooks([first_probe, EvalHook(2, lambda trainer: {"val/acc": trainer.iter / 10}), StopAt(4)])
    first.train()
    probe = CounterProbe()
    resumed = _trainer(make_cfg(*opts), RecordingModel(), _batches(2))
    resumed.register_hooks([probe])
    resumed.train()

    for point, trainer_iter, storage_iter in first_probe.seen + probe.seen:
        assert trainer_iter == storage_iter, point
    points = {point for point, _, _ in first_probe.seen + probe.seen}
    assert points == set(MOUNT_POINTS) - {"before_stop"}  # a stop's: tests/engine/test_stops.py
    steps = [i for p, i, _ in first_probe.seen if p == "before_step"]
    assert steps == [1, 2, 3, 4] == [i for p, i, _ in first_probe.seen if p == "after_step"]
    assert ("before_train", 0, 0) in first_probe.seen and ("after_train", 4, 4) in first_probe.seen
    assert [i for p, i, _ in probe.seen if p in ("after_load_checkpoint", "before_train")] == [4, 4]
    assert [i for p, i, _ in probe.seen if p == "after_step"] == [5, 6]
    assert probe.seen[-1] == ("after_train", 6, 6)
