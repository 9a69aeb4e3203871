"""TEST.VAL_LOSS: the training losses on the validation set, measured without disturbing training."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pet.config import load_cfg
from pet.engine.inference import evaluate_on_datasets, validation_loss
from pet.engine.precision import Precision
from pet.modeling import build_model
from support.helpers import DEMO_CFG, custom_datasets
from support.toys import ToyLoader, ToyModel

FLOAT32 = Precision("cpu", None, False, "test")


class RandomDrawingModel(ToyModel):
    """A :class:`ToyModel` whose training forward draws from Python's, numpy's and torch's generators, as a detector
    sampling proposals and an augmentation would; the draws do not enter the losses."""

    def __init__(self) -> None:
        super().__init__(with_bn=True)
        self.draws = 0

    def forward(self, x, y):
        random.random(), np.random.rand(), torch.rand(1)
        self.draws += 1
        return super().forward(x, y)


def _next_draws() -> tuple:
    return random.random(), np.random.rand(), torch.rand(3)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.numeric
def test_validation_loss_is_the_mean_loss_and_changes_nothing():
    torch.manual_seed(0)
    model = RandomDrawingModel()
    model.bn.running_mean.fill_(0.5)
    model.eval()
    loader = ToyLoader(num_batches=3)
    expected: dict[str, float] = {}
    with torch.no_grad():
        for x, y in loader:  # what the losses are with the BN statistics frozen
            for name, value in model(x, y).items():
                expected[name] = expected.get(name, 0.0) + float(value) / 3
    expected["total_loss"] = expected["loss_mse"] + expected["loss_l1"]

    _seed_all(1)
    after_seed = _next_draws()
    _seed_all(1)
    draws = model.draws
    losses = validation_loss(model, loader, FLOAT32)
    assert model.draws == draws + 3  # its forward drew from all three generators, once per batch

    assert losses.keys() == expected.keys()
    for name, value in expected.items():
        assert math.isclose(losses[name], value, rel_tol=1e-6), name
    assert torch.all(model.bn.running_mean == 0.5) and model.bn.num_batches_tracked == 0  # no BN update
    assert not model.training  # the mode it was in
    # The random streams training continues with (Python, numpy, torch) are the ones it would have had.
    (py, np_value, torch_values), (py_seed, np_seed, torch_seed) = _next_draws(), after_seed
    assert py == py_seed and np_value == np_seed and torch.equal(torch_values, torch_seed)


@pytest.mark.numeric
def test_val_loss_is_reported_next_to_the_ap(shapes_set, tmp_path):
    root = shapes_set(num_train=2, num_val=2)
    cfg = load_cfg(DEMO_CFG, [
        "DEVICE", "cpu", "CKPT", str(tmp_path), "TEST.VAL_LOSS", "True", "TEST.AMP.ENABLED", "False",
        "DATA.CUSTOM", custom_datasets(("vl_val", f"{root}/annotations/val.json", f"{root}/val")),
        "TEST.DATASETS", "('vl_val',)", "INPUT.MIN_SIZE_TEST", "128", "INPUT.MAX_SIZE_TEST", "160",
        "DATA.NUM_WORKERS", "0", "TEST.NUM_WARMUP", "0"])
    torch.manual_seed(0)
    model = build_model(cfg)
    metrics = evaluate_on_datasets(cfg, model, str(tmp_path / "val"))
    assert "bbox/AP" in metrics
    terms = {name for name in metrics if name.startswith("loss/")}
    assert {"loss/total_loss", "loss/loss_classifier", "loss/loss_box_reg", "loss/loss_objectness",
            "loss/loss_rpn_box_reg"} == terms
    assert all(math.isfinite(metrics[name]) and metrics[name] >= 0 for name in terms)
    parts = sum(metrics[name] for name in terms if name != "loss/total_loss")
    assert math.isclose(metrics["loss/total_loss"], parts, rel_tol=1e-6)
