"""Which precision a run computes in: bfloat16 or float16 autocast, or float32.

``SOLVER.AMP`` (training) and ``TEST.AMP`` (inference) default to ``ENABLED: auto``: the
fastest precision that this hardware runs natively, decided from what torch itself reports
rather than from a list of CPU names:

- CPU: bfloat16 autocast when oneDNN has native bfloat16 kernels on this CPU (AVX512-BF16 or
  AMX), float32 otherwise. Without native support torch emulates bfloat16, which made the
  demo ~11x slower than float32 on an AVX2-only CPU.
- CUDA: float16 autocast, with a gradient scaler when training; bfloat16 (no scaler) when the
  user asks for ``DTYPE: bfloat16`` and the GPU supports it.
- Anything else: float32.

``ENABLED: True`` forces autocast (warning once when the CPU would emulate it); ``False``
forces float32.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pet.utils.errors import ConfigError

__all__ = ["Precision", "choose_precision", "cpu_has_native"]

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


def cpu_has_native(dtype: str) -> bool:
    """Whether oneDNN runs ``dtype`` ("bfloat16" or "float16") natively on this CPU, as torch reports it.

    torch's check follows the instruction set oneDNN may use, so ``ONEDNN_MAX_CPU_ISA=AVX2``
    makes an AVX-512 machine answer as an AVX2-only one would.
    """
    check = {"bfloat16": torch.ops.mkldnn._is_mkldnn_bf16_supported,
             "float16": torch.ops.mkldnn._is_mkldnn_fp16_supported}[dtype]
    return bool(check())


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
    native = cpu_has_native(name)
    cpu = f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    if enabled == "auto":
        if native:
            return Precision("cpu", _DTYPES[name], False,
                             f"{key}.ENABLED auto and this CPU runs {name} natively ({cpu})")
        return Precision("cpu", None, False, f"{key}.ENABLED auto and this CPU has no native {name} ({cpu}), "
                                             f"so {name} would be emulated, many times slower than float32")
    if not native:
        _warn_once(f"{key}.ENABLED True asks for {name} autocast, but this CPU has no native {name} ({cpu}): "
                   f"torch emulates it, many times slower than float32. Set {key}.ENABLED auto (or False) "
                   "to train and test in float32 here.")
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
