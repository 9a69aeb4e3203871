"""Is bfloat16 faster than float32 for *this* model on *this* CPU? Measured once, then remembered.

A CPU's flags say whether bfloat16 instructions exist, not whether they pay: for the demo,
bfloat16 autocast trained 1.7x faster than float32 on an AMD Zen 4 and 1.4x *slower* on an
Intel AVX-512 BF16 part whose hypervisor hides AMX, with the same flags apart from AMX (and the
next CPU will fool any table written today). So where the flags allow bfloat16,
:func:`measured_speedup` times one step of the configured model itself in both precisions and
:mod:`pet.engine.precision` takes bfloat16 only when it is at least :data:`MARGIN` times faster.

- **The probe** (:func:`model_probe`): a copy of the model (the real one, its BatchNorm
  statistics and gradients stay untouched) on one fixed batch: forward and backward for
  training, a no-grad forward for inference. The random generators are restored afterwards,
  so a run that probed draws exactly what a run that reused the decision draws.
- **The timing**: one warm-up step per precision, then alternating rounds (float32, low,
  float32, ...), at least :data:`MIN_ROUNDS` and until :data:`BUDGET_S` seconds are spent
  (at most :data:`MAX_ROUNDS`); the medians are compared. Timings whose median absolute deviation
  exceeds :data:`MAX_SPREAD` of their median (other processes competing for the cores) are cached
  all the same, so the machine stays consistent, and the log says how to measure again.
- **The cache** (:class:`DecisionCache`): the result is stored under ``PET_CACHE_DIR`` (default
  ``$XDG_CACHE_HOME/pet`` or ``~/.cache/pet``), keyed by this machine's fingerprint
  (:func:`pet.utils.cpu.machine_fingerprint`: CPU model and flags, instruction-set caps, torch
  version, threads) and the probe's signature (the model's layers and parameter shapes, the
  batch's shape, training or inference). The same machine therefore always computes the same
  model in the same precision, and the same AP to the last digit; delete the file to measure again.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pet.engine.events import EventStorage
from pet.engine.models import call_model, unwrap_model
from pet.utils.cpu import machine_fingerprint
from pet.utils.files import write_json_atomic
from pet.utils.rng import get_rng_state, set_rng_state

__all__ = ["MARGIN", "DecisionCache", "JsonCache", "Measurement", "SpeedProbe", "Timing", "measured_speedup",
           "model_probe", "time_alternating"]

logger = logging.getLogger(__name__)

# bfloat16 must be this many times faster than float32 to be chosen: run-to-run noise of a few percent
# cannot flip the decision, and a gain below it is not worth bfloat16's coarser numbers.
MARGIN = 1.15
MIN_ROUNDS = 3
MAX_ROUNDS = 10
BUDGET_S = 3.0
# The largest median absolute deviation / median of either precision's timings the log calls steady (robust
# to one slow round, which a max - min spread is not: a quiet 2-core machine showed 35% max - min).
MAX_SPREAD = 0.1


@dataclass(frozen=True)
class SpeedProbe:
    """One step to time: ``step(autocast)`` runs it under the given autocast context; ``signature`` says
    what its time depends on besides the machine (the cache key's model half)."""

    step: Callable[[contextlib.AbstractContextManager], None]
    signature: str


@dataclass(frozen=True)
class Measurement:
    """Median seconds per step in float32 and in the low precision ``dtype``; ``source`` is "measured"
    or the cache file it was read from."""

    dtype: str
    float32_s: float
    low_s: float
    rounds: int
    spread: float = 0.0
    source: str = "measured"

    @property
    def speedup(self) -> float:
        """How many times faster ``dtype`` ran than float32 (below 1: slower)."""
        return self.float32_s / self.low_s

    @property
    def steady(self) -> bool:
        """Whether the timings agreed within :data:`MAX_SPREAD`."""
        return self.spread <= MAX_SPREAD

    @property
    def faster(self) -> bool:
        """Whether ``dtype`` is clearly faster: by at least :data:`MARGIN`."""
        return self.speedup >= MARGIN

    def describe(self) -> str:
        how = ("measured on this model" if self.source == "measured"
               else f"measured earlier on this machine and model, reused from {self.source}")
        verdict = (f"at least {MARGIN}x, so {self.dtype}" if self.faster
                   else f"below the {MARGIN}x needed, so float32")
        unsteady = ("" if self.steady else f"; the timings varied by {self.spread:.0%} (were other processes busy?): "
                    f"to measure again on a quiet machine, delete {DecisionCache().path}")
        return (f"{how}: float32 {self.float32_s * 1000:.1f} ms/step, {self.dtype} {self.low_s * 1000:.1f} ms/step "
                f"({self.speedup:.2f}x, {verdict}){unsteady}")


class JsonCache:
    """Entries by key in one JSON file under ``PET_CACHE_DIR`` (:func:`default_cache_dir`), written atomically: the
    measurements a machine makes once and then reuses (``what`` names them in the warning about a read-only home)."""

    def __init__(self, filename: str, directory: str | None = None, what: str = "measurement") -> None:
        self.path = os.path.join(directory or default_cache_dir(), filename)
        self.what = what

    def get_entry(self, key: str) -> dict[str, Any] | None:
        entry = self._read().get(key)
        return entry if isinstance(entry, dict) else None

    def put_entry(self, key: str, entry: dict[str, Any]) -> None:
        """Store ``entry`` under ``key``, with the time it was measured."""
        entries = self._read()
        entries[key] = {**entry, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_json_atomic(self.path, entries)
        except OSError as exc:  # a read-only home: the decision still holds for this run
            logger.warning(f"Could not cache the {self.what} in {self.path} ({exc.strerror}); "
                           "the next run measures again. Set PET_CACHE_DIR to a writable folder.")

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                entries = json.load(f)
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}


class DecisionCache(JsonCache):
    """The precision measurements (:class:`Measurement` by key), in ``PET_CACHE_DIR``/precision.json."""

    def __init__(self, directory: str | None = None) -> None:
        super().__init__("precision.json", directory, what="precision decision")

    def get(self, key: str) -> Measurement | None:
        entry = self.get_entry(key)
        if entry is None:
            return None
        try:
            return Measurement(entry["dtype"], float(entry["float32_s"]), float(entry["low_s"]),
                               int(entry["rounds"]), float(entry["spread"]), source=self.path)
        except (KeyError, TypeError, ValueError):
            return None  # an entry of another version: measured again and replaced

    def put(self, key: str, measurement: Measurement, record: dict[str, Any]) -> None:
        """Store ``measurement`` under ``key`` with ``record`` (what the key stands for, for a reader)."""
        self.put_entry(key, {**asdict(measurement), "source": None, **record})


def default_cache_dir() -> str:
    """``PET_CACHE_DIR``, else ``$XDG_CACHE_HOME/pet``, else ``~/.cache/pet``."""
    if os.environ.get("PET_CACHE_DIR"):
        return os.environ["PET_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pet")


def measured_speedup(probe: SpeedProbe, dtype: torch.dtype, cache: DecisionCache | None = None) -> Measurement:
    """``dtype`` autocast against float32 on the CPU for ``probe``: from ``cache`` when this machine measured this
    probe before, else timed (:func:`time_probe`) and stored."""
    cache = cache or DecisionCache()
    name = str(dtype).replace("torch.", "")
    machine = machine_fingerprint()
    key = hashlib.sha256(json.dumps([machine, probe.signature, name], sort_keys=True).encode()).hexdigest()[:32]
    cached = cache.get(key)
    if cached is not None:
        return cached
    measurement = time_probe(probe, dtype)
    cache.put(key, measurement, {"machine": machine, "signature": probe.signature})
    return measurement


def time_probe(probe: SpeedProbe, dtype: torch.dtype) -> Measurement:
    """Median seconds per step of ``probe`` in float32 and under ``dtype`` autocast, alternating (see the module
    docstring); the random generators are as they were before."""
    rng = get_rng_state()
    # A storage of its own: a model that logs (get_event_storage) works, and logs nothing into the run's.
    with EventStorage():
        try:
            timings = time_alternating({"float32": lambda: probe.step(contextlib.nullcontext()),
                                        "low": lambda: probe.step(torch.autocast("cpu", dtype=dtype))})
        finally:
            set_rng_state(rng)
    spread = max(timing.spread for timing in timings.values())
    return Measurement(str(dtype).replace("torch.", ""), timings["float32"].median_s, timings["low"].median_s,
                       timings["low"].rounds, spread)


@dataclass(frozen=True)
class Timing:
    """One step's timed rounds: their median in seconds, how many, and their median absolute deviation over the
    median (``spread``; a steady machine stays within :data:`MAX_SPREAD`)."""

    median_s: float
    rounds: int
    spread: float


def time_alternating(steps: dict[str, Callable[[], Any]], budget_s: float = BUDGET_S) -> dict[str, Timing]:
    """Each of ``steps`` timed: one warm-up call each (oneDNN and the runtimes create their kernels on first use),
    then rounds that call every step once in turn, at least :data:`MIN_ROUNDS` and until ``budget_s`` seconds are
    spent (at most :data:`MAX_ROUNDS`), so that a machine's drift falls on all of them alike."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    start = time.perf_counter()
    rounds = 0
    while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and time.perf_counter() - start < budget_s):
        for name, step in steps.items():
            begin = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - begin)
        rounds += 1
    timings = {}
    for name, values in times.items():
        median = statistics.median(values)
        spread = statistics.median(abs(t - median) for t in values) / max(median, 1e-9)
        timings[name] = Timing(median, len(values), spread)
    return timings


def model_probe(model: torch.nn.Module, batch: Any, *, training: bool) -> SpeedProbe:
    """A probe of ``model`` on ``batch``: a training step's forward and backward (the losses summed), or an
    inference forward without gradients, on a deep copy so the model itself is never touched."""
    probe_model = copy.deepcopy(unwrap_model(model)).train(training)

    def step(autocast: contextlib.AbstractContextManager) -> None:
        if training:
            with autocast:
                losses = call_model(probe_model, batch)
            sum(losses.values()).backward()
            probe_model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad(), autocast:
                call_model(probe_model, batch)

    return SpeedProbe(step, _signature(probe_model, batch, training))


def _signature(model: torch.nn.Module, batch: Any, training: bool) -> str:
    """What the step's time depends on besides the machine: each layer's type, each parameter's shape, dtype,
    memory format (and, in training, whether it gets a gradient), the batch's tensor shapes."""
    layers = [type(module).__name__ for module in model.modules()]
    params = [(name, list(p.shape), str(p.dtype), p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last),
               training and p.requires_grad) for name, p in model.named_parameters()]
    text = json.dumps({"training": training, "layers": layers, "params": params, "batch": _shapes(batch)})
    return f"{type(model).__name__}/{'train' if training else 'test'}/{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _shapes(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return list(obj.shape)
    if isinstance(obj, dict):
        return {str(k): _shapes(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_shapes(v) for v in obj]
    return None
