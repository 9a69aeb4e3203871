"""Precision chosen from the hardware: SOLVER.AMP / TEST.AMP ``auto``, explicit True / False.

The AVX2-only case is real, not mocked: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``
makes torch on an AVX-512 machine report capability AVX2 and no native bfloat16, exactly as
an AVX2-only CPU does, so the subprocess tests below hold on both kinds of machine.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import InfiniteToyLoader, ToyModel

from pet.config import load_cfg
from pet.engine import precision as precision_module
from pet.engine.inference import inference_on_dataset, inference_precision
from pet.engine.precision import choose_precision
from pet.engine.trainer import Trainer
from pet.utils.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
WARNING = "SOLVER.AMP.ENABLED True asks for bfloat16 autocast, but this CPU has no native bfloat16"


def train_toy_as_avx2_only(ckpt, *opts: str) -> str:
    """Train the toy model for 2 iterations in a child that sees an AVX2-only CPU; return its log."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "toy_train.py"), "--ckpt", str(ckpt), "--max-iter", "2", *opts],
        env={**os.environ, **AVX2_ONLY}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    with open(os.path.join(ckpt, "log.txt"), encoding="utf-8") as f:
        return f.read()


def test_emulated_avx2_cpu_reports_no_native_bf16():
    """The emulation the tests below rely on: torch itself reports an AVX2-only CPU."""
    code = ("import torch; from pet.engine.precision import cpu_has_native; "
            "print(torch.backends.cpu.get_cpu_capability(), cpu_has_native('bfloat16'))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **AVX2_ONLY}, capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout.split()
    assert out == ["AVX2", "False"]


def test_auto_trains_in_float32_on_a_cpu_without_native_bf16_and_logs_why(tmp_path):
    log = train_toy_as_avx2_only(tmp_path / "run")
    assert ("Training precision: float32 (no autocast): SOLVER.AMP.ENABLED auto and this CPU has no native "
            "bfloat16 (torch CPU capability AVX2)") in log
    assert WARNING not in log


def test_explicit_true_on_a_cpu_without_native_bf16_runs_bf16_and_warns_once(tmp_path):
    log = train_toy_as_avx2_only(tmp_path / "run", "SOLVER.AMP.ENABLED", "True", "TEST.AMP.ENABLED", "False")
    assert "Training precision: bfloat16 autocast: SOLVER.AMP.ENABLED True" in log
    assert log.count(WARNING) == 1
    assert "Set SOLVER.AMP.ENABLED auto (or False)" in log


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_what_torch_reports_on_the_cpu(monkeypatch, native):
    monkeypatch.setattr(precision_module, "cpu_has_native", lambda dtype: native)
    chosen = choose_precision("auto", "auto", "cpu", training=True)
    assert chosen.dtype == (torch.bfloat16 if native else None)
    assert not chosen.grad_scaler
    assert choose_precision(False, "auto", "cpu", training=True).dtype is None
    assert choose_precision(True, "float16", "cpu", training=True).dtype == torch.float16


def test_cuda_uses_float16_with_a_scaler_for_training_and_bf16_only_where_supported(monkeypatch):
    chosen = choose_precision("auto", "auto", "cuda", training=True)
    assert (chosen.dtype, chosen.grad_scaler) == (torch.float16, True)
    assert choose_precision("auto", "auto", "cuda", training=False).grad_scaler is False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    chosen = choose_precision(True, "bfloat16", "cuda", training=True)
    assert (chosen.dtype, chosen.grad_scaler) == (torch.bfloat16, False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Old GPU")
    with pytest.raises(ConfigError, match="DTYPE bfloat16 but this GPU \\(Old GPU\\) does not support it"):
        choose_precision(True, "bfloat16", "cuda", training=True)


@pytest.mark.parametrize("opts, message", [
    (["SOLVER.AMP.ENABLED", "atuo"], "SOLVER.AMP.ENABLED must be auto, True or False, got 'atuo'"),
    (["TEST.AMP.DTYPE", "float8"], "TEST.AMP.DTYPE must be auto, bfloat16 or float16, got 'float8'"),
])
def test_bad_precision_values_are_config_errors(opts, message):
    with pytest.raises(ConfigError, match=message):
        load_cfg(None, opts)


def test_precision_keys_take_auto_true_and_false_from_yaml_and_command_line(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("SOLVER:\n  AMP:\n    ENABLED: True\nTEST:\n  AMP:\n    ENABLED: false\n")
    cfg = load_cfg(str(cfg_file), ["TEST.AMP.DTYPE", "bfloat16"])
    assert (cfg.SOLVER.AMP.ENABLED, cfg.TEST.AMP.ENABLED, cfg.TEST.AMP.DTYPE) == (True, False, "bfloat16")
    assert load_cfg(str(cfg_file), ["SOLVER.AMP.ENABLED", "auto"]).SOLVER.AMP.ENABLED == "auto"
    assert load_cfg(None, []).SOLVER.AMP.ENABLED == "auto"  # the default everywhere


class AutocastRecorder(ToyModel):
    """Records the autocast dtype its forward runs under (None: no autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.dtype | None] = []

    def forward(self, x, y):
        on = torch.is_autocast_enabled("cpu")
        self.seen.append(torch.get_autocast_dtype("cpu") if on else None)
        return super().forward(x, y) if self.training else self.linear(x)


@pytest.mark.parametrize("enabled, expected", [(True, torch.bfloat16), (False, None)])
def test_the_train_step_and_the_test_loop_run_under_the_chosen_precision(tmp_path, enabled, expected):
    opts = ["CKPT", str(tmp_path), "DEVICE", "cpu", "SOLVER.MAX_ITER", "2", "SOLVER.AMP.ENABLED", str(enabled),
            "TEST.AMP.ENABLED", str(enabled), "HOOKS.CHECKPOINT.PERIOD", "0"]
    cfg = load_cfg(None, opts)
    model = AutocastRecorder()
    trainer = Trainer(cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                      data_loader=InfiniteToyLoader())
    trainer.train()
    assert model.seen == [expected, expected]

    class Collect:
        def reset(self):
            pass

        def process(self, inputs, outputs):
            self.dtype = outputs.dtype

        def evaluate(self):
            return {}

    model.seen.clear()
    batches = [(torch.randn(2, 4), torch.randn(2, 1))]
    evaluator = Collect()
    inference_on_dataset(model, batches, evaluator, precision=inference_precision(cfg, torch.device("cpu")))
    assert model.seen == [expected]
    assert evaluator.dtype == (expected or torch.float32)

