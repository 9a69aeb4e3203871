"""TEST.VAL_LOSS: the training losses on the validation set, measured without disturbing training."""
from __future__ import annotations

import math

import torch
from conftest import ToyLoader, ToyModel
from helpers import DEMO_CFG, custom_datasets

from pet.config import load_cfg
from pet.engine.inference import evaluate_on_datasets, validation_loss
from pet.engine.precision import Precision
from pet.modeling import build_model

FLOAT32 = Precision("cpu", None, False, "test")


def test_validation_loss_is_the_mean_loss_and_changes_nothing():
    torch.manual_seed(0)
    model = ToyModel(with_bn=True)
    model.bn.running_mean.fill_(0.5)
    model.eval()
    loader = ToyLoader(num_batches=3)
    expected: dict[str, float] = {}
    with torch.no_grad():
        for x, y in loader:  # what the losses are with the BN statistics frozen
            for name, value in model(x, y).items():
                expected[name] = expected.get(name, 0.0) + float(value) / 3
    expected["total_loss"] = expected["loss_mse"] + expected["loss_l1"]

    torch.manual_seed(1)
    after_seed = torch.rand(3)
    torch.manual_seed(1)
    losses = validation_loss(model, loader, FLOAT32)

    assert losses.keys() == expected.keys()
    for name, value in expected.items():
        assert math.isclose(losses[name], value, rel_tol=1e-6), name
    assert torch.all(model.bn.running_mean == 0.5) and model.bn.num_batches_tracked == 0  # no BN update
    assert not model.training  # the mode it was in
    assert torch.equal(torch.rand(3), after_seed)  # the RNG stream training continues with is untouched


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
