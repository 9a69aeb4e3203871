"""EventStorage collects the scalars of a run; EventWriters turn them into logs and files.

Anything in the process (hooks, the trainer, a model) can record a value with
``get_event_storage().put_scalar(name, value)``; a :class:`PeriodicWriter` hook then hands
the storage to every writer. Writers only read the storage, so adding one (a CSV file,
a web dashboard) never changes what the others see.

Iteration numbering: ``storage.iter`` is the trainer's one counter, ``trainer.iter``: the
1-based number of the iteration that is running, so a value put during iteration ``n`` is
recorded at ``n``, the number of iterations completed when that step ends. That is the
``iteration`` field of ``metrics.json``.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from fvcore.common.config import CfgNode
from fvcore.common.history_buffer import HistoryBuffer

from pet.utils.errors import ConfigError
from pet.utils.files import write_bytes_atomic
from pet.utils.registry import Registry, build_from_spec, resolve_spec
from pet.utils.visualization import plot_training_curves

__all__ = [
    "EventStorage",
    "get_event_storage",
    "EventWriter",
    "CommonMetricPrinter",
    "JSONWriter",
    "TensorboardXWriter",
    "TrainingCurvesWriter",
    "read_metrics",
    "WRITERS",
    "build_writers",
    "close_writers",
    "writer_class",
]

# History kept per scalar. Windows used for smoothing are far smaller; the global
# average covers the whole run anyway, so memory stays flat over long runs.
_HISTORY_LENGTH = 10000

logger = logging.getLogger(__name__)

_CURRENT_STORAGE_STACK: list[EventStorage] = []


def get_event_storage() -> EventStorage:
    """The innermost :class:`EventStorage` in use; an error when there is none."""
    if not _CURRENT_STORAGE_STACK:
        raise RuntimeError("get_event_storage() must be called inside a 'with EventStorage(...)' block")
    return _CURRENT_STORAGE_STACK[-1]


class EventStorage:
    """Scalar history per name, keyed by iteration, with smoothing hints for writers."""

    def __init__(self, start_iter: int = 0) -> None:
        self._history: dict[str, HistoryBuffer] = {}
        self._smoothing_hints: dict[str, bool] = {}
        self._latest: dict[str, tuple[float, int]] = {}
        self.iter = start_iter

    def put_scalar(self, name: str, value: Any, smoothing_hint: bool = True) -> None:
        """Record ``value`` (a number or a one-element tensor) for ``name`` at the current iteration.

        ``smoothing_hint`` tells writers whether a windowed median is meaningful (losses,
        times) or the raw value must be shown (learning rate, validation AP).
        """
        if isinstance(value, torch.Tensor):
            value = value.detach().item()
        value = float(value)
        history = self._history.get(name)
        if history is None:
            history = self._history[name] = HistoryBuffer(max_length=_HISTORY_LENGTH)
            self._smoothing_hints[name] = smoothing_hint
        elif self._smoothing_hints[name] != smoothing_hint:
            raise ValueError(f"Scalar '{name}' was put with a different smoothing_hint before")
        history.update(value, self.iter)
        self._latest[name] = (value, self.iter)

    def put_scalars(self, *, smoothing_hint: bool = True, **kwargs: Any) -> None:
        """``put_scalar`` for each keyword argument."""
        for name, value in kwargs.items():
            self.put_scalar(name, value, smoothing_hint=smoothing_hint)

    def history(self, name: str) -> HistoryBuffer:
        """The :class:`fvcore.common.history_buffer.HistoryBuffer` of ``name``."""
        if name not in self._history:
            raise KeyError(f"No history for '{name}'; recorded: {sorted(self._history)}")
        return self._history[name]

    def histories(self) -> dict[str, HistoryBuffer]:
        return self._history

    def latest(self) -> dict[str, tuple[float, int]]:
        """``{name: (latest value, iteration it was put at)}``."""
        return self._latest

    def latest_with_smoothing_hint(self, window_size: int = 20) -> dict[str, tuple[float, int]]:
        """Like :meth:`latest`, but the median over ``window_size`` values for smoothed scalars."""
        result = {}
        for name, (value, iteration) in self._latest.items():
            if self._smoothing_hints[name]:
                value = float(self._history[name].median(window_size))
            result[name] = (value, iteration)
        return result

    def smoothing_hints(self) -> dict[str, bool]:
        return self._smoothing_hints

    def scalars_since(self, after: int, window_size: int = 20) -> dict[int, dict[str, float]]:
        """``{iteration: {name: value}}`` of the latest scalars put after iteration ``after``, by iteration,
        valued as :meth:`latest_with_smoothing_hint` values them: what a writer that continues from
        ``after`` writes next (metrics.json, TensorBoard, a tracker)."""
        by_iter: dict[int, dict[str, float]] = defaultdict(dict)
        for name, (value, iteration) in self.latest_with_smoothing_hint(window_size).items():
            if iteration > after:
                by_iter[iteration][name] = value
        return dict(sorted(by_iter.items()))

    def __enter__(self) -> EventStorage:
        _CURRENT_STORAGE_STACK.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert _CURRENT_STORAGE_STACK[-1] is self
        _CURRENT_STORAGE_STACK.pop()


class EventWriter:
    """Base class of writers: ``write()`` reads the current storage, ``close()`` releases files.

    Subclasses receive ``storage`` as a keyword argument (and may ignore the rest), so
    a writer can also be driven outside the trainer: ``writer.write(storage=storage)``.

    ``close_order`` says when :func:`close_writers` closes it among a run's writers (lower first,
    equal values in list order): a writer that reads on closing what another finishes on closing
    comes after it. ``metrics.json`` (JSONWriter, 0) is complete before ``curves.png`` is drawn
    from it (TrainingCurvesWriter, 1), and both before the other writers (default 2: experiment
    trackers upload them).
    """

    close_order: int = 2

    def write(self, **kwargs: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _storage_from(kwargs: dict[str, Any]) -> EventStorage:
    storage = kwargs.get("storage")
    return storage if storage is not None else get_event_storage()


def _format_seconds(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


class CommonMetricPrinter(EventWriter):
    """One terminal line per write: iteration, ETA, losses, lr, time, data_time, memory."""

    def __init__(self, max_iter: int, window_size: int = 20, logger_name: str = "pet.train") -> None:
        self.max_iter = max_iter
        self.window_size = window_size
        self._logger = logging.getLogger(logger_name)

    def write(self, **kwargs: Any) -> None:
        storage = _storage_from(kwargs)
        iteration = storage.iter
        histories = storage.histories()
        parts = [f"[Training][iter: {iteration}/{self.max_iter}]"]
        if "time" in histories and iteration < self.max_iter:
            eta = histories["time"].median(1000) * (self.max_iter - iteration)
            parts.append(f"[eta: {_format_seconds(eta)}]")
        fields = []
        for name, history in histories.items():
            if "loss" in name and storage.latest()[name][1] == iteration:
                fields.append(f"{name}: {history.median(self.window_size):.4g}")
        if "lr" in histories:
            fields.append(f"lr: {histories['lr'].latest():.4g}")
        for name in ("time", "data_time"):
            if name in histories:
                fields.append(f"{name}: {histories[name].median(self.window_size):.4f}")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            fields.append(f"max_mem: {torch.cuda.max_memory_allocated() / 2**20:.0f}M")
        self._logger.info("".join(parts) + " " + "  ".join(fields))


class JSONWriter(EventWriter):
    """Appends one JSON object per iteration that has new scalars to ``json_file``.

    Each object has ``iteration`` (iterations completed) and every scalar put at that
    iteration (smoothed scalars as the median over ``window_size``). When a run resumes
    from iteration ``start_iter``, lines past it (written after the checkpoint the run
    resumes from) are dropped so the file tells one consistent history; a run that starts
    at 0 (killed before its first checkpoint, then restarted) drops them all.
    """

    close_order = 0

    def __init__(self, json_file: str, window_size: int = 20, start_iter: int = 0) -> None:
        self.json_file = json_file
        self.window_size = window_size
        if os.path.exists(json_file):
            _truncate_metrics(json_file, start_iter)
        self._file = open(json_file, "a", encoding="utf-8")
        self._last_write = start_iter

    def write(self, **kwargs: Any) -> None:
        per_iter = _storage_from(kwargs).scalars_since(self._last_write, self.window_size)
        for iteration, scalars in per_iter.items():
            self._file.write(json.dumps({"iteration": iteration, **scalars}, sort_keys=False) + "\n")
        self._file.flush()
        if per_iter:
            self._last_write = max(per_iter)

    def close(self) -> None:
        self._file.close()


class TensorboardXWriter(EventWriter):
    """Writes every scalar with new values to TensorBoard event files under ``log_dir``."""

    def __init__(self, log_dir: str, window_size: int = 20, start_iter: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: only this writer does

        self.window_size = window_size
        self._writer = SummaryWriter(log_dir, purge_step=start_iter + 1 if start_iter else None)
        self._last_write = start_iter

    def write(self, **kwargs: Any) -> None:
        for iteration, scalars in _storage_from(kwargs).scalars_since(self._last_write, self.window_size).items():
            for name, value in scalars.items():
                self._writer.add_scalar(name, value, iteration)
            self._last_write = iteration
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class TrainingCurvesWriter(EventWriter):
    """Draws ``curves.png`` (losses, lr, validation AP against iteration) from ``metrics.json`` when closed.

    Writers are closed after the last write of a run, also a failed or stopped one, so the
    picture shows how far it got; it closes after the JSONWriter and before the writers of the
    default ``close_order`` (``TRAIN.WRITERS``, e.g. an experiment tracker), which find the
    picture there when they close. ``tools/plot_metrics.py`` redraws it any time.
    """

    close_order = 1

    def __init__(self, output_dir: str, filename: str = "curves.png") -> None:
        self.output_dir = output_dir
        self.filename = filename

    def write(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        metrics = os.path.join(self.output_dir, "metrics.json")
        records = read_metrics(metrics) if os.path.isfile(metrics) else []
        if records:
            out = plot_training_curves([records], os.path.join(self.output_dir, self.filename),
                                       [os.path.basename(os.path.normpath(self.output_dir))])
            logger.info(f"Training curves: {out}")


WRITERS = Registry("event writer")  # pet.engine.experiment_trackers registers WandbWriter and MLflowWriter
WRITERS.__doc__ = "EventWriter classes by name, for TRAIN.WRITERS entries in YAML."
for _writer in (CommonMetricPrinter, JSONWriter, TensorboardXWriter, TrainingCurvesWriter):
    WRITERS.register(_writer)


def build_writers(cfg: CfgNode, max_iter: int, start_iter: int = 0) -> list[EventWriter]:
    """Terminal printer, metrics.json and curves.png, TensorBoard (as configured), then ``TRAIN.WRITERS`` entries.

    Close them with :func:`close_writers` (their ``close_order``: metrics.json, then the curves drawn
    from it, then the others).
    """
    writers: list[EventWriter] = [CommonMetricPrinter(max_iter)]
    if cfg.TRAIN.SAVE_AS_JSON:
        writers.append(JSONWriter(os.path.join(cfg.CKPT, "metrics.json"), start_iter=start_iter))
        writers.append(TrainingCurvesWriter(cfg.CKPT))
    if cfg.TRAIN.USE_TENSORBOARD:
        writers.append(TensorboardXWriter(cfg.CKPT, start_iter=start_iter))
    for spec in cfg.TRAIN.WRITERS:
        writer_class(spec)
        writers.append(build_from_spec(WRITERS, spec, output_dir=cfg.CKPT))
    return writers


def close_writers(writers: Iterable[EventWriter]) -> None:
    """Close every writer by its ``close_order`` (ties in list order), even when one fails (a tracker after it
    still ends its run); then raise the first failure."""
    failures = []
    for writer in sorted(writers, key=lambda w: w.close_order):
        try:
            writer.close()
        except Exception as exc:  # noqa: BLE001 - reported below, after the other writers closed
            logger.error(f"Closing {type(writer).__name__} failed: {type(exc).__name__}: {exc}")
            failures.append(exc)
    if failures:
        raise failures[0]


def writer_class(spec: Mapping[str, Any]) -> type[EventWriter]:
    """The EventWriter subclass a ``TRAIN.WRITERS`` entry names, imported but not built.

    Writers open their files when built, at the start of training; resolving the names
    first turns a typo or a dotted path that does not import into a ConfigError before
    anything is written.
    """
    cls = resolve_spec(WRITERS, spec)
    if not (isinstance(cls, type) and issubclass(cls, EventWriter)):
        raise ConfigError(f"TRAIN.WRITERS entry {dict(spec)} names {cls!r}, which is not an EventWriter subclass")
    return cls


def read_metrics(json_file: str) -> list[dict[str, float]]:
    """The objects of a ``metrics.json`` file, in order (blank or torn last lines skipped)."""
    records = []
    with open(json_file, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a crash
    return records


def _truncate_metrics(json_file: str, last_iter: int) -> None:
    kept: Iterable[dict] = (r for r in read_metrics(json_file) if r.get("iteration", 0) <= last_iter)
    write_bytes_atomic(json_file, "".join(json.dumps(record) + "\n" for record in kept).encode("utf-8"), fsync=True)
