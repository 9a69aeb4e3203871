"""Precision chosen from the hardware: SOLVER.AMP / TEST.AMP ``auto``, explicit True / False.

The three CPU classes are real, not mocked: on an AVX-512 BF16 machine
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` makes torch and oneDNN behave as on an
AVX2-only CPU, and ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` as on an AVX-512 CPU without bfloat16
(Intel Skylake-SP to Ice Lake), so the subprocess tests below hold on every kind of machine
(on a machine without AVX-512 the caps change nothing and float32 is still the answer).
The machine's own answer is checked against its flags read independently, from /proc/cpuinfo.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pet.config import load_cfg
from pet.engine import precision as precision_module
from pet.engine.inference import inference_on_dataset, inference_precision
from pet.engine.precision import choose_precision
from pet.engine.speed_probe import Measurement, SpeedProbe
from pet.engine.trainer import Trainer
from pet.utils import cpu as cpu_module
from pet.utils.cpu import NativeSupport, cpu_class, cpu_int8_support, cpu_native_support
from pet.utils.errors import ConfigError
from support.helpers import ROOT, TOY_TRAIN
from support.toys import InfiniteToyLoader, ToyModel

EMULATIONS = {
    "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "AVX-512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}
WARNING = "SOLVER.AMP.ENABLED True asks for bfloat16 autocast, which this CPU does not run natively"


def cpuinfo_flags() -> set[str]:
    """The CPU's flags as the kernel lists them (the first processor's); skips where /proc/cpuinfo is missing."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("the CPU's flags cannot be read here (no /proc/cpuinfo)")
    return set(line.split(":", 1)[1].split())


def child_env(emulation: str) -> dict[str, str]:
    """This process's environment with only ``emulation``'s caps (none of the caps the suite may run under)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    return {**env, **EMULATIONS[emulation]}


# One child per emulation (the caps are read when torch and oneDNN start): what Pet reports for that CPU class, then
# the toy model trained 2 iterations with SOLVER.AMP.ENABLED auto, then with True (auto first: True's warning is
# logged once per process), each run writing its own log (and no metrics.json: its curves cost the child a second).
# The child finds toy_train's imports (support.toys) through the PYTHONPATH conftest.py gives every process.
EMULATED_CHILD = r"""
import json, runpy, sys
from pet.utils.cpu import cpu_class, cpu_has_native
print(cpu_class(), cpu_has_native("bfloat16"), flush=True)
for argv in json.loads(sys.argv[1]):
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            raise
"""
RUNS = {"auto": ("TRAIN.SAVE_AS_JSON", "False"),
        "explicit": ("TRAIN.SAVE_AS_JSON", "False", "SOLVER.AMP.ENABLED", "True", "TEST.AMP.ENABLED", "False")}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """``emulated(name)``: for the emulation ``name``, what its child printed (``reported``: Pet's CPU class and
    native-bfloat16 answer) and the log of each toy training of :data:`RUNS`, from one child started once."""
    children: dict[str, dict[str, str]] = {}

    def run(emulation: str) -> dict[str, str]:
        if emulation not in children:
            base = tmp_path_factory.mktemp(emulation)
            argv = [[TOY_TRAIN, "--ckpt", str(base / name), "--max-iter", "2", *opts] for name, opts in RUNS.items()]
            proc = subprocess.run([sys.executable, "-c", EMULATED_CHILD, json.dumps(argv)],
                                  env=child_env(emulation), capture_output=True, text=True, timeout=300, cwd=ROOT)
            assert proc.returncode == 0, proc.stderr
            children[emulation] = {"reported": proc.stdout.splitlines()[0]}
            for name in RUNS:
                with open(base / name / "log.txt", encoding="utf-8") as f:
                    children[emulation][name] = f.read()
        return children[emulation]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("emulation", list(EMULATIONS))
def test_emulated_cpu_classes_report_no_native_bf16(emulated, emulation):
    """The emulations the tests below rely on: torch and Pet see the class they stand for."""
    # An AVX2-only machine stays AVX2 under the AVX-512 cap (a cap removes instructions, never adds them).
    expected = emulation if {"avx512f", "avx512bw"} <= cpuinfo_flags() else "AVX2"
    assert emulated(emulation)["reported"] == f"{expected} False"


@pytest.mark.slow
@pytest.mark.parametrize("emulation, because", [
    ("AVX2", "ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN below AVX512_CORE_BF16"),
    ("AVX-512", "ONEDNN_MAX_CPU_ISA=AVX512_CORE holds oneDNN below AVX512_CORE_BF16"),
])
def test_auto_trains_in_float32_on_a_cpu_without_native_bf16_and_logs_why(emulated, emulation, because):
    log = emulated(emulation)["auto"]
    line = next(line for line in log.splitlines() if "Training precision:" in line)
    assert "Training precision: float32 (no autocast): SOLVER.AMP.ENABLED auto and this CPU has" in line
    assert "so bfloat16 would be emulated, many times slower than float32" in line
    # The reason is the true one: the cap where the CPU has bfloat16 instructions, their absence otherwise.
    flags = cpuinfo_flags()
    assert (because if {"avx512_bf16", "amx_tile"} & flags else "this CPU has no AVX512_BF16 or AMX") in line
    assert WARNING not in log


@pytest.mark.slow
@pytest.mark.parametrize("emulation", list(EMULATIONS))
def test_explicit_true_on_a_cpu_without_native_bf16_runs_bf16_and_warns_once(emulated, emulation):
    log = emulated(emulation)["explicit"]
    assert "Training precision: bfloat16 autocast: SOLVER.AMP.ENABLED True" in log
    assert log.count(WARNING) == 1
    assert "Set SOLVER.AMP.ENABLED auto (or False)" in log


# Where the instructions exist, auto measures (tests/engine/test_speed_probe.py); here the measurement says bfloat16 is
# 2x.
def twice_as_fast(probe, dtype):
    return Measurement("bfloat16", 1.0, 0.5, rounds=3)


def no_step():
    return SpeedProbe(lambda autocast: None, "no step")
BF16 = {"avx512_bf16": True, "amx_tile": False}
AMX = {"avx512_bf16": False, "amx_tile": True}
NONE = {"avx512_bf16": False, "amx_tile": False}


@pytest.mark.parametrize("flags, capability, env, native", [
    (BF16, "AVX512", {}, True),
    (AMX, "AVX512", {}, True),
    (NONE, "AVX512", {}, False),                                      # Skylake-SP to Ice Lake
    (NONE, "AVX2", {}, False),                                        # AVX2-only
    (BF16, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False),   # the AVX-512 emulation
    (BF16, "AVX512", {"ONEDNN_MAX_CPU_ISA": "avx512_core_vnni"}, False),
    (BF16, "AVX512", {"DNNL_MAX_CPU_ISA": "AVX2"}, False),            # oneDNN's older variable
    (BF16, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True),
    (BF16, "AVX512", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
    (BF16, "AVX512", {"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
    (BF16, "AVX2", {}, False),                                        # ATEN_CPU_CAPABILITY=avx2 alone
    (None, "AVX512", {}, False),                                      # flags unreadable: never assumed
])
def test_native_bf16_needs_the_instructions_and_no_cap_below_them(monkeypatch, flags, capability, env, native):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cpu_module, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    support = cpu_native_support("bfloat16")
    assert support.native is native, support.reason
    monkeypatch.setattr(precision_module, "measured_speedup", twice_as_fast)
    chosen = choose_precision("auto", "auto", "cpu", training=True, probe=no_step)
    assert chosen.dtype == (torch.bfloat16 if native else None)
    assert support.reason in chosen.reason


@pytest.mark.parametrize("flags, vnni, named", [
    ({"avx512_vnni": True, "avx_vnni": True}, True, "AVX512_VNNI and AVX_VNNI"),  # AMD Zen 4, Intel Sapphire Rapids
    ({"avx_vnni": True}, True, "AVX_VNNI"),                                      # Intel Alder Lake: AVX2 with VNNI
    ({"amx_int8": True}, True, "AMX_INT8"),
    ({"avx512_bf16": True}, False, "no AVX512_VNNI, AVX_VNNI or AMX_INT8"),      # bf16 alone is not VNNI
    ({}, False, "no AVX512_VNNI, AVX_VNNI or AMX_INT8"),                         # Skylake-SP, Haswell
    (None, False, "cannot read"),                                                # flags unreadable: never assumed
])
def test_int8_support_is_the_vnni_flags_whatever_the_isa_caps(monkeypatch, flags, vnni, named):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # onnxruntime ignores oneDNN's and torch's caps
    monkeypatch.setattr(cpu_module, "_cpu_flags", lambda: flags)
    support = cpu_int8_support()
    assert support.native is vnni and named in support.reason


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_native_support_rule(monkeypatch, native):
    monkeypatch.setattr(precision_module, "cpu_native_support",
                        lambda dtype: NativeSupport(dtype, native, "as the test says"))
    monkeypatch.setattr(precision_module, "measured_speedup", twice_as_fast)
    chosen = choose_precision("auto", "auto", "cpu", training=True, probe=no_step)
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
    inference_on_dataset(model, batches, evaluator, precision=inference_precision(cfg, model))
    assert model.seen == [expected]
    assert evaluator.dtype == (expected or torch.float32)


def test_this_machine_measures_exactly_when_its_own_flags_and_caps_allow_bfloat16(monkeypatch):
    """On the machine running the suite, against the kernel's list of CPU flags (not torch's, not Pet's):
    ``auto`` must measure (and then follow the measurement) on a CPU with AVX512_BF16 or AMX unless a cap set for
    this run holds it below them, and pick float32 without measuring otherwise. "Never measure" fails here on
    every machine with bfloat16 instructions."""
    flags = cpuinfo_flags()
    has_instructions = bool({"avx512_bf16", "amx_tile"} & flags)
    onednn_cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    keeps_bf16 = onednn_cap in {"ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512",
                                "AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16",
                                "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"}
    aten_capped = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in {"avx2", "avx", "default"}
    expected = has_instructions and keeps_bf16 and not aten_capped
    measured = []
    monkeypatch.setattr(precision_module, "measured_speedup",
                        lambda probe, dtype: measured.append(probe) or Measurement("bfloat16", 1.0, 0.5, rounds=3))
    chosen = choose_precision("auto", "auto", "cpu", training=True, probe=no_step)
    assert chosen.dtype == (torch.bfloat16 if expected else None), chosen.reason
    assert len(measured) == int(expected)
    assert (cpu_class() == "AVX-512 BF16") is expected
