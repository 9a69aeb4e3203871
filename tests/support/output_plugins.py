"""A test callback for tools/test_net.py runs in tests, named in ``TEST.HOOKS`` by dotted path
(``support.output_plugins.SaveOutputs``, with tests/ on PYTHONPATH): it saves the model's raw outputs, so a test can
compare what test_net's model gave, field by field, beyond what the evaluator writes."""
from __future__ import annotations

import os
from typing import Any

import torch

from pet.engine.inference import TestCallback


class SaveOutputs(TestCallback):
    """Saves ``{image_id: the model's output dict}`` to ``<output_dir>/outputs.pth`` after the test."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, "outputs.pth")
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}

    def after_test_iter(self, inputs: Any, outputs: list[dict[str, torch.Tensor]], **kwargs: Any) -> None:
        for target, output in zip(inputs[1], outputs):
            self.outputs[int(target["image_id"])] = {k: v.detach().cpu() for k, v in output.items()}

    def after_test(self, **kwargs: Any) -> None:
        torch.save(self.outputs, self.path)
