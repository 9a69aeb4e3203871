"""The examples of README.md and docs/ are code users copy: run them as written."""
from __future__ import annotations

import csv
import json
import os
import sys

import pytest
import torch

from pet.config import load_cfg
from pet.engine.trainer import Trainer
from support.helpers import CFGS, doc_block
from support.toys import InfiniteToyLoader, ToyModel


@pytest.fixture
def my_project(tmp_path, monkeypatch):
    """The user's package of the docs' examples: ``my_project`` under tmp_path, importable and new to this test.

    ``my_project(module, marker)`` writes the docs' Python block containing ``marker`` as ``my_project/<module>.py``.
    """
    for name in [m for m in sys.modules if m == "my_project" or m.startswith("my_project.")]:
        monkeypatch.delitem(sys.modules, name)  # another test's my_project (and its submodules) must not leak in
    package = tmp_path / "my_project"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    def add_module(module: str, marker: str) -> None:
        (package / f"{module}.py").write_text(doc_block("python", marker))

    return add_module


def test_custom_hook_and_writer_examples_work_from_yaml(tmp_path, my_project):
    my_project("hooks", "class GradNorm")
    my_project("writers", "class CSVWriter")
    (tmp_path / "run.yaml").write_text(doc_block("yaml", "my_project.hooks.GradNorm") + "SOLVER:\n  MAX_ITER: 10\n")

    cfg = load_cfg(str(tmp_path / "run.yaml"), ["CKPT", str(tmp_path / "out"), "DEVICE", "cpu", "DISPLAY_ITER", "4",
                                                "TRAIN.AUTO_RESUME", "False"])
    trainer = Trainer(cfg, model=ToyModel(), data_loader=InfiniteToyLoader())
    trainer.train()

    norms = [value for value, _ in trainer.storage.history("grad_norm").values()]
    assert len(norms) == 10 and all(n > 0 for n in norms)
    with open(tmp_path / "out" / "metrics.json") as f:
        written = [json.loads(line) for line in f]
    assert [m["iteration"] for m in written] == [4, 8, 10] and all(m["grad_norm"] > 0 for m in written)
    with open(tmp_path / "out" / "losses.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["iteration"] for r in rows] == ["4", "8", "10"]  # every DISPLAY_ITER and the last iteration
    assert {"loss_mse", "loss_l1", "total_loss"} <= set(rows[0])
    assert torch.isfinite(torch.tensor(float(rows[0]["total_loss"])))


def test_add_your_own_model_example_builds_and_trains(tmp_path, my_project):
    from pet.modeling import build_model

    my_project("heads", "class ConvFCHead")
    cfg_dir = tmp_path / "cfgs" / "mine"
    cfg_dir.mkdir(parents=True)
    spec = doc_block("yaml", "my_project.heads.ConvFCHead")
    base_name = spec.split("_BASE_:")[1].split()[0]  # relative to the user's cfgs/mine/, like Pet's own configs
    shipped = os.path.normpath(os.path.join(CFGS, "mine", base_name))
    assert os.path.isfile(shipped), f"the example starts from {base_name}, which Pet does not ship"
    base = cfg_dir / base_name
    base.parent.mkdir(parents=True, exist_ok=True)
    base.write_text(open(shipped).read())
    (cfg_dir / "conv_head.yaml").write_text(spec)

    model = build_model(load_cfg(str(cfg_dir / "conv_head.yaml")))
    assert type(model.roi_heads.box_head).__name__ == "ConvFCHead"
    images = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8)
    targets = [{"image_id": i, "image_size": (64, 64), "orig_size": (64, 64),
                "boxes": torch.tensor([[8.0, 8.0, 40.0, 40.0]]), "labels": torch.tensor([2])} for i in range(2)]
    losses = model(images, targets)
    sum(losses.values()).backward()
    assert model.roi_heads.box_head.conv.weight.grad is not None


def test_dump_detections_test_hook_example_writes_one_line_per_image(tmp_path, my_project):
    from pet.engine.build import build_test_hooks
    from pet.engine.inference import inference_on_dataset

    my_project("test_hooks", "class DumpDetections")
    (tmp_path / "run.yaml").write_text(doc_block("yaml", "my_project.test_hooks.DumpDetections"))
    cfg = load_cfg(str(tmp_path / "run.yaml"), ["CKPT", str(tmp_path / "out"), "DEVICE", "cpu"])

    class TwoBoxes(torch.nn.Module):
        """Per image: one confident and one doubtful detection."""

        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))

        def forward(self, images, targets):
            return [{"boxes": torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]),
                     "scores": torch.tensor([0.9, 0.2]), "labels": torch.tensor([1, 2])} for _ in targets]

    class Ignore:
        predictions = []

        def reset(self):
            pass

        def process(self, inputs, outputs):
            pass

        def evaluate(self):
            return {}

    batches = [(torch.zeros(2, 3, 8, 8), [{"image_id": 2 * i}, {"image_id": 2 * i + 1}]) for i in range(3)]
    timer, hooks = build_test_hooks(cfg)
    inference_on_dataset(TwoBoxes(), batches, Ignore(), timer, hooks)
    with open(tmp_path / "out" / "test" / "detections.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [line["image_id"] for line in lines] == list(range(6))
    assert lines[0] == {"image_id": 0, "boxes": [[1.0, 2.0, 3.0, 4.0]], "scores": [pytest.approx(0.9)], "labels": [1]}
