"""What every benchmark shares: interleaved runs and the machine fingerprint printed with each table."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torchvision

from pet.utils.cpu import cpu_class, cpu_has_native, cpu_int8_support, cpu_model_name, cpu_native_support

__all__ = ["interleaved", "fingerprint", "format_fingerprint", "reference_package", "test_support"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def interleaved(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Call every run once per round, rotating which goes first (AB, BA, AB, ...), and collect the samples.

    Machine noise and drift then hit every side alike, and no side always runs on the caches the
    other just warmed. A run returning ``None`` (e.g. a framework that is not installed) adds no sample.
    """
    names = list(runs)
    samples: dict[str, list[Any]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            value = runs[name]()
            if value is not None:
                samples[name].append(value)
    return samples


def fingerprint() -> dict[str, Any]:
    """The machine as it affects speed: CPU model, torch's CPU capability, native bfloat16, VNNI, threads, versions."""
    return {
        "cpu": cpu_model_name(), "cores": os.cpu_count(), "cpu_class": cpu_class(),
        "bfloat16": cpu_native_support("bfloat16").reason,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bfloat16": cpu_has_native("bfloat16"), "vnni": cpu_int8_support().native,
        "int8_support": cpu_int8_support().reason, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "torchvision": torchvision.__version__,
        "emulation": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
                      if k in os.environ},
    }


def format_fingerprint(fp: dict[str, Any]) -> str:
    settings = " ".join(f"{k}={v}" for k, v in fp["emulation"].items())
    emulated = f" (emulated: {settings})" if settings else ""
    return (f"machine: {fp['cpu']}, {fp['cores']} cores, class {fp['cpu_class']}, torch CPU capability "
            f"{fp['torch_cpu_capability']}"
            f"{emulated}, native bf16 {'yes' if fp['native_bfloat16'] else 'no'}, VNNI {'yes' if fp['vnni'] else 'no'}"
            f", {fp['threads']} thread(s), "
            f"torch {fp['torch']}, torchvision {fp['torchvision']}")


@contextlib.contextmanager
def reference_package(package: str, user: str, how: str) -> Iterator[None]:
    """Around the import of a reference implementation Pet does not install: when ``package`` is missing, one line
    saying that ``user`` (a subcommand or flag) needs it and ``how`` to get it, instead of a traceback."""
    try:
        yield
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != package:
            raise
        raise SystemExit(f"{user} needs {package}, which Pet does not install: {how}") from None


def test_support(name: str) -> ModuleType:
    """The module ``tests/support/<name>.py``, loaded from its file: the one copy of what the tests and a benchmark
    both need (a synthetic COCO set, a process tree's memory), without putting tests/ on the import path."""
    path = os.path.join(REPO, "tests", "support", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"pet_test_support_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
