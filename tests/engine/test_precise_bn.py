"""PreciseBN leaves the training batch sequence alone, and a resumed run continues its own batch stream."""
from __future__ import annotations

import pytest
import torch

from pet.engine.hooks import PreciseBN, Priority, TrainHook
from pet.engine.trainer import Trainer
from pet.utils.errors import ConfigError
from support.helpers import custom_datasets
from support.toys import IndexedToyLoader, ToyModel


class IdRecorder(torch.nn.Module):
    """A one-BN "detector" that records the image ids of each training batch.

    PreciseBN runs the model without gradients, so its passes are counted apart.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(3)
        self.train_ids: list[list[int]] = []
        self.precise_bn_batches = 0

    def forward(self, images: torch.Tensor, targets: list[dict]) -> dict[str, torch.Tensor]:
        if torch.is_grad_enabled():
            self.train_ids.append([int(t["image_id"]) for t in targets])
        else:
            self.precise_bn_batches += 1
        return {"loss_bn": self.bn(images.float()).mean()}


def _shapes_cfg(make_cfg, tiny_set, name, *opts):
    custom = custom_datasets(("pbn_train", f"{tiny_set}/annotations/train.json", f"{tiny_set}/train"))
    return make_cfg("CKPT", str(tiny_set) + f"-{name}", "DATA.CUSTOM", custom, "TRAIN.DATASETS", "('pbn_train',)",
                    "MODEL.NUM_CLASSES", 3, "DATA.NUM_WORKERS", 1, "SOLVER.IMS_PER_BATCH", 2, "SOLVER.MAX_ITER", 6,
                    "INPUT.MIN_SIZE_TRAIN", "(96,)", "INPUT.MAX_SIZE_TRAIN", 160, "TRAIN.SAVE_AS_JSON", False, *opts)


@pytest.mark.slow
def test_precise_bn_from_config_keeps_the_training_batch_sequence(make_cfg, tiny_set):
    """With persistent workers, drawing from the trainer's loader would restart its sampler mid-run."""
    runs = {}
    for precise_bn in (False, True):
        cfg = _shapes_cfg(make_cfg, tiny_set, f"pbn{precise_bn}", "HOOKS.PRECISE_BN.ENABLED", precise_bn,
                          "HOOKS.PRECISE_BN.PERIOD", 2, "HOOKS.PRECISE_BN.NUM_ITER", 3)
        model = IdRecorder()
        Trainer(cfg, model=model).train()  # the training loader and the default hooks come from the config
        runs[precise_bn] = model
    assert runs[True].precise_bn_batches == 9  # after iterations 2, 4 and 6
    assert len(runs[False].train_ids) == 6  # 8 images, batch 2: the run goes past one pass
    assert runs[True].train_ids == runs[False].train_ids


def test_precise_bn_refuses_a_persistent_worker_trainer_loader(make_cfg, tiny_set):
    cfg = _shapes_cfg(make_cfg, tiny_set, "refuse")
    trainer = Trainer(cfg, model=IdRecorder(), default_hooks=False)
    trainer.register_hook(PreciseBN(num_iter=1))
    with pytest.raises(ConfigError, match="persistent workers"):
        trainer.train()


class CrashAfter(TrainHook):
    priority = Priority.LOWEST

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def after_step(self, storage, **kwargs):
        if storage.iter == self.iteration:
            raise RuntimeError("simulated crash")


def _resume_run(make_cfg, ckpt, *hooks, resume=False):
    """4 iterations, checkpoint every 2, PreciseBN over 2 batches of its own loader after every iteration."""
    cfg = make_cfg("CKPT", ckpt, "SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.PERIOD", 2, "TRAIN.SAVE_AS_JSON", False)
    loader = IndexedToyLoader(num_batches=100, batch_size=16, seed=100)
    torch.manual_seed(0)
    trainer = Trainer(cfg, model=ToyModel(with_bn=True), data_loader=IndexedToyLoader())
    trainer.register_hooks([PreciseBN(period=1, num_iter=2, data_loader_fn=lambda: loader), *hooks])
    if resume:
        trainer.resume_or_load(resume=True)
    return trainer, loader


def test_resumed_run_continues_the_precise_bn_stream(make_cfg, tmp_path):
    reference, _ = _resume_run(make_cfg, str(tmp_path / "a"))
    reference.train()
    crashed, _ = _resume_run(make_cfg, str(tmp_path / "b"), CrashAfter(3))
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.train()
    resumed, loader = _resume_run(make_cfg, str(tmp_path / "b"), resume=True)
    assert resumed.start_iter == 2
    resumed.train()
    assert loader.start_iters == [4]  # 2 updates of 2 batches before the checkpoint
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(resumed.model.bn, name), getattr(reference.model.bn, name)), name
