"""Which precision a run computes in: bfloat16 or float16 autocast, or float32.

``SOLVER.AMP`` (training) and ``TEST.AMP`` (inference) default to ``ENABLED: auto``: the
fastest precision that this hardware runs natively, decided from the CPU's own feature flags
and the instruction-set caps in force, never from a timing probe, so one class of machine
always gets the same precision (and the same AP):

- CPU: bfloat16 autocast only where oneDNN runs it with native instructions: the CPU has
  AVX512_BF16 or AMX (as torch reads them from CPUID), no cap below them is set
  (``ONEDNN_MAX_CPU_ISA`` / ``DNNL_MAX_CPU_ISA`` under ``AVX512_CORE_BF16``, or
  ``ATEN_CPU_CAPABILITY`` under AVX512), float32 otherwise. That gives three classes of CPU
  (:func:`cpu_class`): "AVX2" (most laptops, many cloud VMs), "AVX-512" without bfloat16 (Intel
  Skylake-SP to Ice Lake) and "AVX-512 BF16" (AMD Zen 4+, Intel Cooper Lake, Sapphire Rapids+).
  Without native support bfloat16 is emulated: the demo trained 2.3x slower than float32 on
  AVX-512 without bfloat16 and ~11x on AVX2. (oneDNN's own "bf16 supported" answer is True on
  AVX-512 without BF16, where it emulates, so it is not the test.)
- CUDA: float16 autocast, with a gradient scaler when training; bfloat16 (no scaler) when the
  user asks for ``DTYPE: bfloat16`` and the GPU supports it.
- Anything else: float32.

``ENABLED: True`` forces autocast (warning once when the CPU would emulate it); ``False``
forces float32.

:func:`cpu_int8_support` answers the same question for 8-bit integer inference (onnxruntime's int8
models, :mod:`pet.deploy.int8`): whether the CPU has a VNNI dot-product instruction.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from pet.utils.errors import ConfigError

__all__ = ["Precision", "NativeSupport", "choose_precision", "cpu_class", "cpu_has_native", "cpu_int8_support",
           "cpu_native_support"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_warned: set[str] = set()


@dataclass(frozen=True)
class Precision:
    """The decision: ``dtype`` is the autocast dtype (``None``: plain float32); ``reason`` says why."""

    device_type: str
    dtype: torch.dtype | None
    grad_scaler: bool
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype or torch.float32).replace("torch.", "")

    def autocast(self) -> contextlib.AbstractContextManager:
        """A new context that autocasts to ``dtype`` on this device; a no-op for float32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def __str__(self) -> str:
        suffix = " with a gradient scaler" if self.grad_scaler else ""
        kind = "float32 (no autocast)" if self.dtype is None else f"{self.name} autocast{suffix}"
        return f"{kind}: {self.reason}"


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
    cap_var = next((v for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if os.environ.get(v)), None)
    cap = os.environ[cap_var].strip().upper() if cap_var else ""
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
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    if capability.startswith("AVX512") and _ONEDNN_ISA_RANK.get(cap, 99) >= _ONEDNN_ISA_RANK["AVX512_CORE"]:
        return "AVX-512"
    return "AVX2" if capability.startswith("AVX") else capability


def _cpu_flags() -> dict[str, bool] | None:
    """The CPU feature flags torch read from CPUID (lower-case names), or None when this torch has no reader."""
    get = getattr(torch.cpu, "get_capabilities", None)
    if get is None:
        return None
    try:
        return {str(k).lower(): v is True for k, v in get().items()}
    except (RuntimeError, AttributeError):
        return None


def choose_precision(enabled: Any, dtype: str, device: torch.device | str, *, training: bool,
                     key: str = "SOLVER.AMP") -> Precision:
    """Decide the precision for ``device`` from ``{key}.ENABLED`` (auto/True/False) and ``{key}.DTYPE``.

    ``dtype`` is "auto" (bfloat16 on CPU, float16 on CUDA), "bfloat16" or "float16" (the values
    :func:`pet.config.validate_cfg` admits). Raises :class:`ConfigError` for a choice the hardware
    cannot run (bfloat16 on a GPU without it).
    """
    device_type = torch.device(device).type
    if enabled is False:
        return Precision(device_type, None, False, f"{key}.ENABLED False")
    if device_type == "cuda":
        return _cuda_precision(enabled, dtype, training, key)
    if device_type != "cpu":
        return Precision(device_type, None, False, f"no autocast rule for device type '{device_type}'")
    name = "bfloat16" if dtype == "auto" else dtype
    support = cpu_native_support(name)
    if enabled == "auto":
        if support.native:
            return Precision("cpu", _DTYPES[name], False, f"{key}.ENABLED auto and {support.reason}")
        return Precision("cpu", None, False, f"{key}.ENABLED auto and {support.reason}, so {name} would be "
                                             "emulated, many times slower than float32")
    if not support.native:
        _warn_once(f"{key}.ENABLED True asks for {name} autocast, which this CPU does not run natively "
                   f"({support.reason}): torch emulates it, many times slower than float32. Set {key}.ENABLED "
                   "auto (or False) to train and test in float32 here.")
    return Precision("cpu", _DTYPES[name], False, f"{key}.ENABLED True")


def _cuda_precision(enabled: Any, dtype: str, training: bool, key: str) -> Precision:
    if dtype == "bfloat16":
        if not torch.cuda.is_bf16_supported():
            raise ConfigError(f"{key}.DTYPE bfloat16 but this GPU ({torch.cuda.get_device_name()}) does not support "
                              f"it; use {key}.DTYPE auto (float16 with a gradient scaler).")
        return Precision("cuda", torch.bfloat16, False, f"{key}.ENABLED {enabled}, DTYPE bfloat16 on a GPU with it")
    return Precision("cuda", torch.float16, training, f"{key}.ENABLED {enabled}: float16 on CUDA")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
