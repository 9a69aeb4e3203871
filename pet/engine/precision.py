"""Which precision a run computes in: bfloat16 or float16 autocast, or float32.

``SOLVER.AMP`` (training) and ``TEST.AMP`` (inference) default to ``ENABLED: auto``: the
fastest precision for this model on this hardware.

- CPU without bfloat16 instructions (no AVX512_BF16 or AMX, or an instruction-set cap below
  them): float32, without measuring. bfloat16 would be emulated there: the demo trained 2.3x
  slower than float32 on AVX-512 without bfloat16 and ~11x on AVX2. (oneDNN's own "bf16
  supported" answer is True on AVX-512 without BF16, where it emulates, so it is not the test.)
- CPU with bfloat16 instructions: the flags cannot tell whether bfloat16 *pays* (1.7x faster than
  float32 for the demo on AMD Zen 4, 1.4x slower on an Intel part whose VM hides AMX), so the
  configured model is timed in both precisions (:mod:`pet.engine.speed_probe`) and bfloat16 is
  taken only when it is at least ``speed_probe.MARGIN`` times faster. The measurement is cached
  per machine and model, so the same machine always makes the same choice; in a distributed run
  rank 0 decides and every rank follows.
- CUDA: float16 autocast, with a gradient scaler when training; bfloat16 (no scaler) when the
  user asks for ``DTYPE: bfloat16`` and the GPU supports it.
- Anything else: float32.

``ENABLED: True`` forces autocast (warning once when the CPU would emulate it); ``False``
forces float32. The log line says which, and why (with the measured times).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pet.engine.speed_probe import SpeedProbe, measured_speedup
from pet.utils import comm
from pet.utils.cpu import cpu_native_support
from pet.utils.errors import ConfigError

__all__ = ["Precision", "choose_precision"]

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


def choose_precision(enabled: Any, dtype: str, device: torch.device | str, *, training: bool,
                     key: str = "SOLVER.AMP", warn: bool = True,
                     probe: Callable[[], SpeedProbe | None] | None = None) -> Precision:
    """Decide the precision for ``device`` from ``{key}.ENABLED`` (auto/True/False) and ``{key}.DTYPE``.

    ``dtype`` is "auto" (bfloat16 on CPU, float16 on CUDA), "bfloat16" or "float16" (the values
    :func:`pet.config.validate_cfg` admits). Raises :class:`ConfigError` for a choice the hardware
    cannot run (bfloat16 on a GPU without it). ``probe`` makes the step to time where ``auto`` has to
    measure (a CPU with the instructions: see the module docstring); without one (or when it makes none:
    no batch to time), such a CPU gets float32. ``warn`` False: only weighing it (``--backend auto``).
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
        if not support.native:
            return Precision("cpu", None, False, f"{key}.ENABLED auto and {support.reason}, so {name} would be "
                                                 "emulated, many times slower than float32")
        return _measured_cpu_precision(name, key, support.reason, probe)
    if warn and not support.native:
        _warn_once(f"{key}.ENABLED True asks for {name} autocast, which this CPU does not run natively "
                   f"({support.reason}): torch emulates it, many times slower than float32. Set {key}.ENABLED "
                   "auto (or False) to train and test in float32 here.")
    return Precision("cpu", _DTYPES[name], False, f"{key}.ENABLED True")


def _measured_cpu_precision(name: str, key: str, support: str,
                            probe: Callable[[], SpeedProbe | None] | None) -> Precision:
    """``name`` autocast where it is measured clearly faster than float32 for ``probe``'s model, else float32.
    Rank 0 measures (or reads the cache) and every rank takes its decision."""
    force = f"set {key}.ENABLED True or False to force one"
    measurement, failure = None, ""
    if comm.is_main_process():
        try:
            step = probe() if probe is not None else None
            measurement = measured_speedup(step, _DTYPES[name]) if step is not None else None
        except Exception as exc:  # noqa: BLE001 - the model's own error surfaces where it runs for real
            failure = f"{type(exc).__name__}: {exc}"
            logger.warning(f"Could not time the model to choose its precision ({failure}); using float32")
    measurement, failure = comm.broadcast_object((measurement, failure))
    if measurement is None:
        why = (f"timing the model failed ({failure})" if failure
               else f"there was no model and batch to measure whether {name} is faster")
        return Precision("cpu", None, False, f"{key}.ENABLED auto and {support}, but {why}; {force}")
    reason = f"{key}.ENABLED auto and {support}; {measurement.describe()}; {force}"
    return Precision("cpu", _DTYPES[name] if measurement.faster else None, False, reason)


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
