"""What every benchmark shares: interleaved runs and the machine fingerprint printed with each table."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torchvision

from pet.utils.cpu import cpu_class, cpu_has_native, cpu_int8_support, cpu_model_name, cpu_native_support

__all__ = ["interleaved", "fingerprint", "format_fingerprint", "process_tree_rss"]


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


def process_tree_rss(pid: int | None = None) -> int:
    """Resident memory (bytes) of process ``pid`` (default: this one) and all its descendants (DataLoader
    workers), from /proc: what the machine holds for a run, workers included."""
    pid = os.getpid() if pid is None else pid
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status", encoding="utf-8") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children", encoding="utf-8") as f:
                    pending += [int(child) for child in f.read().split()]
        except (OSError, StopIteration):  # the process ended meanwhile
            continue
    return total
