"""The README's examples are code users copy: run them as written."""
from __future__ import annotations

import csv
import os
import re

import torch
from conftest import InfiniteToyLoader, ToyModel

from pet.config import load_cfg
from pet.engine.trainer import Trainer

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def _blocks(language: str) -> list[str]:
    with open(README, encoding="utf-8") as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), flags=re.S)


def test_quick_start_has_exactly_two_commands_and_ci_runs_the_second():
    quick_start = open(README, encoding="utf-8").read().split("## Quick start")[1].split("\n## ")[0]
    commands = re.findall(r"```bash\n(.*?)```", quick_start, flags=re.S)
    assert len(commands) == 2 and all(len(c.strip().splitlines()) == 1 for c in commands)
    ci = open(os.path.join(os.path.dirname(README), ".ci", "run"), encoding="utf-8").read()
    assert commands[1].strip() in ci


def test_custom_hook_and_writer_examples_work_from_yaml(tmp_path, monkeypatch):
    package = tmp_path / "my_project"
    package.mkdir()
    (package / "__init__.py").write_text("")
    python_blocks = _blocks("python")
    (package / "hooks.py").write_text(next(b for b in python_blocks if "class LossIsFinite" in b))
    (package / "writers.py").write_text(next(b for b in python_blocks if "class CSVWriter" in b))
    yaml_block = next(b for b in _blocks("yaml") if "my_project.hooks.LossIsFinite" in b)
    (tmp_path / "run.yaml").write_text(yaml_block + "SOLVER:\n  MAX_ITER: 12\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    cfg = load_cfg(str(tmp_path / "run.yaml"), ["CKPT", str(tmp_path / "out"), "DEVICE", "cpu", "DISPLAY_ITER", "4",
                                                "TRAIN.AUTO_RESUME", "False"])

    class NaNAfter(ToyModel):
        def forward(self, x, y):
            losses = super().forward(x, y)
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 6:
                losses["loss_mse"] = losses["loss_mse"] * float("nan")
            return losses

    cfg.defrost()
    cfg.SOLVER.SKIP_NONFINITE = True  # let the hook, not the trainer, react to the NaN
    trainer = Trainer(cfg, model=NaNAfter(), data_loader=InfiniteToyLoader())
    trainer.train()
    assert trainer.iter == 6  # stopped by LossIsFinite after the NaN step
    with open(tmp_path / "out" / "losses.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["iteration"] for r in rows] == ["4", "6"]  # every DISPLAY_ITER, plus the last state
    assert {"loss_mse", "loss_l1", "total_loss"} <= set(rows[0])
    assert torch.isfinite(torch.tensor(float(rows[0]["total_loss"])))
