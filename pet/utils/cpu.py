"""What this CPU has: bfloat16 / float16 instructions (oneDNN, torch), 8-bit integer dot products (VNNI).

Read from the CPU's own feature flags, as torch reads them from CPUID, and the instruction-set caps in
force. Flags say which instructions *exist*, not which precision is *faster* for a model: where bfloat16
instructions exist, :mod:`pet.engine.speed_probe` measures. That gives the classes of CPU that speed figures
are labelled with (:func:`cpu_class`): "AVX2" (most laptops, many cloud VMs), "AVX-512" without bfloat16
(Intel Skylake-SP to Ice Lake) and "AVX-512 BF16" (AMD Zen 4+, Intel Cooper Lake, Sapphire Rapids+, with or
without AMX). The run's precision (:mod:`pet.engine.precision`), the deployment backend
(:mod:`pet.deploy.backend`, :mod:`pet.deploy.int8`) and every benchmark's machine fingerprint read it here;
:func:`machine_fingerprint` keys the measured precision decisions.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NativeSupport", "cpu_native_support", "cpu_has_native", "cpu_int8_support", "cpu_class",
           "machine_fingerprint"]


# oneDNN's instruction sets, lowest first (the names ONEDNN_MAX_CPU_ISA takes; aliases share a rank).
_ONEDNN_ISA_RANK = {
    "SSE41": 0, "AVX": 1, "AVX2": 2, "AVX2_VNNI": 3, "AVX2_VNNI_2": 4, "AVX512_CORE": 5, "AVX512_CORE_VNNI": 6,
    "AVX512_CORE_BF16": 7, "AVX512_CORE_FP16": 8, "AVX10_1_512": 8, "AVX512_CORE_AMX": 9, "AVX10_1_512_AMX": 9,
    "AVX512_CORE_AMX_FP16": 10, "AVX10_1_512_AMX_FP16": 10, "AVX10_2_512": 11, "AVX10_2_512_AMX_2": 12,
}
# Per autocast dtype: the CPU flags (any one) that give native kernels, and the lowest oneDNN cap keeping them.
_FLAG_NAMES = {"avx512_bf16": "AVX512_BF16", "amx_tile": "AMX", "avx512_fp16": "AVX512_FP16", "amx_fp16": "AMX_FP16",
               "avx512_vnni": "AVX512_VNNI", "avx_vnni": "AVX_VNNI", "amx_int8": "AMX_INT8"}
# The instructions that multiply unsigned by signed 8-bit integers and accumulate in 32 bits, without the 16-bit
# intermediate sum of AVX2's VPMADDUBSW (which saturates on large u8 x s8 products).
_VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")
_NATIVE = {
    "bfloat16": (("avx512_bf16", "amx_tile"), "AVX512_CORE_BF16"),
    "float16": (("avx512_fp16", "amx_fp16"), "AVX512_CORE_FP16"),
}


@dataclass(frozen=True)
class NativeSupport:
    """Whether this CPU runs ``dtype`` natively, and the facts the answer rests on (for the log)."""

    dtype: str
    native: bool
    reason: str


def cpu_native_support(dtype: str) -> NativeSupport:
    """Whether ``dtype`` ("bfloat16" or "float16") runs natively here, from the CPU's flags and the ISA caps.

    Flags come from torch's CPUID reader (``torch.cpu`` capabilities: the hardware, whatever the caps);
    the caps are ``ONEDNN_MAX_CPU_ISA`` (or the older ``DNNL_MAX_CPU_ISA``) for oneDNN's convolutions and
    matrix products and ``ATEN_CPU_CAPABILITY`` for torch's own kernels. Deterministic: no timing.
    """
    wanted, lowest_cap = _NATIVE[dtype]
    flags = _cpu_flags()
    capability = torch.backends.cpu.get_cpu_capability()
    if flags is None:
        return NativeSupport(dtype, False, "this torch cannot read the CPU's feature flags")
    present = [_FLAG_NAMES[f] for f in wanted if flags.get(f)]
    if not present:
        return NativeSupport(dtype, False, f"this CPU has no {' or '.join(_FLAG_NAMES[f] for f in wanted)} "
                                           f"(torch CPU capability {capability})")
    found = " and ".join(present)
    cap_var, cap = _onednn_cap()
    if cap in _ONEDNN_ISA_RANK and _ONEDNN_ISA_RANK[cap] < _ONEDNN_ISA_RANK[lowest_cap]:
        return NativeSupport(dtype, False, f"this CPU has {found}, but {cap_var}={cap} holds oneDNN below "
                                           f"{lowest_cap}")
    if not capability.startswith("AVX512"):
        return NativeSupport(dtype, False, f"this CPU has {found}, but torch's own kernels are held to "
                                           f"{capability} (ATEN_CPU_CAPABILITY)")
    capped = f", {cap_var}={cap}" if cap_var else ""
    return NativeSupport(dtype, True, f"this CPU has {found} (torch CPU capability {capability}{capped})")


def cpu_has_native(dtype: str) -> bool:
    """Whether ``dtype`` ("bfloat16" or "float16") runs natively on this CPU (see :func:`cpu_native_support`)."""
    return cpu_native_support(dtype).native


def cpu_int8_support() -> NativeSupport:
    """Whether this CPU multiplies 8-bit integers with a VNNI instruction (AVX512_VNNI, AVX_VNNI or AMX_INT8).

    That decides two things for an int8 model in onnxruntime (which picks its kernels from the CPU itself,
    whatever the ISA caps say): without VNNI, its u8 x s8 products go through AVX2's VPMADDUBSW, whose 16-bit
    pairwise sums can saturate unless the weights were quantized to 7 bits (``reduce_range``), and int8 gains
    less over float32. From the CPU's flags, as torch reads them; no timing.
    """
    flags = _cpu_flags()
    if flags is None:
        return NativeSupport("int8", False, "this torch cannot read the CPU's feature flags")
    present = [_FLAG_NAMES[f] for f in _VNNI if flags.get(f)]
    if not present:
        return NativeSupport("int8", False, f"this CPU has no {', '.join(_FLAG_NAMES[f] for f in _VNNI[:-1])} or "
                                            f"{_FLAG_NAMES[_VNNI[-1]]}")
    return NativeSupport("int8", True, f"this CPU has {' and '.join(present)}")


def cpu_class() -> str:
    """This CPU's class for speed figures: "AVX-512 BF16", "AVX-512" (no native bfloat16), "AVX2" or the
    capability torch reports, as the ISA caps in force make it look."""
    capability = torch.backends.cpu.get_cpu_capability()
    if cpu_has_native("bfloat16"):
        return "AVX-512 BF16"
    _, cap = _onednn_cap()
    if capability.startswith("AVX512") and _ONEDNN_ISA_RANK.get(cap, 99) >= _ONEDNN_ISA_RANK["AVX512_CORE"]:
        return "AVX-512"
    return "AVX2" if capability.startswith("AVX") else capability


def machine_fingerprint() -> dict[str, Any]:
    """What a timing on this machine depends on besides the model: the CPU's model name and feature flags, the
    instruction-set caps in force, torch's version and CPU capability, and the threads torch computes with."""
    flags = _cpu_flags()
    return {
        "cpu": cpu_model_name(),
        "flags": sorted(name for name, present in (flags or {}).items() if present),
        "caps": {var: os.environ.get(var, "") for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                                                          "ATEN_CPU_CAPABILITY")},
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def cpu_model_name() -> str:
    """The CPU's model name as the OS reports it (``/proc/cpuinfo`` on Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _onednn_cap() -> tuple[str | None, str]:
    """The variable capping oneDNN's instruction set (``ONEDNN_MAX_CPU_ISA``, or the older ``DNNL_MAX_CPU_ISA``)
    and its value in upper case; ``(None, "")`` when neither is set."""
    var = next((v for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if os.environ.get(v)), None)
    return var, os.environ[var].strip().upper() if var else ""


def _cpu_flags() -> dict[str, bool] | None:
    """The CPU feature flags torch read from CPUID (lower-case names), or None when this torch has no reader."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return None
    try:
        return {str(k).lower(): v is True for k, v in get().items()}
    except (RuntimeError, AttributeError):
        return None
