"""The hook contract: TrainHook, Priority and the HookList that orders, calls, keys and times hooks.

A hook overrides any of the mount points below. The train loop (:mod:`pet.engine.loops`) calls every point with
keyword arguments only (always ``trainer=`` and ``storage=``, plus ``epoch=``/``max_epochs=``
in epoch mode, ``metrics=`` for ``after_val`` and ``checkpoint=`` for the checkpoint
points), so a hook declares just what it needs and swallows the rest with ``**kwargs``::

    class GradNorm(TrainHook):
        def after_step(self, storage, **kwargs):
            ...
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from enum import IntEnum
from typing import Any

from pet.engine.loops import TrainerLike
from pet.utils.errors import ConfigError
from pet.utils.registry import Registry
from pet.utils.table import format_table

__all__ = ["Priority", "get_priority", "TrainHook", "TrainerLike", "HOOKS", "HookList",
           "MOUNT_POINTS"]

HOOKS = Registry("hook")
HOOKS.__doc__ = "Hook classes by name, for HOOKS.CUSTOM / TEST.HOOKS entries in YAML."


class Priority(IntEnum):
    """MMEngine's priority levels: a lower value runs earlier."""

    HIGHEST = 0
    VERY_HIGH = 10
    HIGH = 30
    ABOVE_NORMAL = 40
    NORMAL = 50
    BELOW_NORMAL = 60
    LOW = 70
    VERY_LOW = 90
    LOWEST = 100


def get_priority(priority: int | str | Priority) -> int:
    """An int in [0, 100] from an int, a level name (``"HIGH"``, case-insensitive) or a Priority."""
    if isinstance(priority, bool):
        raise ConfigError(f"Hook priority must be an int, a Priority or a level name, got {priority!r}")
    if isinstance(priority, int):
        if not 0 <= priority <= 100:
            raise ConfigError(f"Hook priority must be between 0 and 100, got {priority}")
        return int(priority)
    if isinstance(priority, str) and priority.upper() in Priority.__members__:
        return int(Priority[priority.upper()])
    raise ConfigError(
        f"Unknown hook priority {priority!r}; use 0-100 or one of {', '.join(Priority.__members__)}"
    )


MOUNT_POINTS = (
    "before_train",
    "after_train",
    "before_epoch",
    "after_epoch",
    "before_step",
    "after_step",
    "before_val",
    "after_val",
    "before_save_checkpoint",
    "after_load_checkpoint",
    "before_stop",
)


class TrainHook:
    """Base class of training hooks. Every mount point is a no-op by default.

    ``priority`` (class attribute, default NORMAL) orders hooks; it can be overridden
    per instance at registration. A hook with state that must survive a resume
    implements ``state_dict()`` / ``load_state_dict(state)``; the checkpoint stores it
    under the hook's class name, and under ``Name.1``, ``Name.2``, ... for further hooks
    of the same class, in registration order (register them in the same order to resume).
    """

    priority: int | str | Priority = Priority.NORMAL

    def before_train(self, **kwargs: Any) -> None:
        """Once, before the first iteration (after resuming)."""

    def after_train(self, **kwargs: Any) -> None:
        """Once, after the last iteration; also when training fails (called in a ``finally``)."""

    def before_epoch(self, **kwargs: Any) -> None:
        """Before each epoch (once, before the first iteration, in iteration mode)."""

    def after_epoch(self, **kwargs: Any) -> None:
        """After each epoch (once, after the last iteration, in iteration mode)."""

    def before_step(self, **kwargs: Any) -> None:
        """Before each iteration; ``trainer.iter`` is its 1-based number."""

    def after_step(self, **kwargs: Any) -> None:
        """After each iteration; ``trainer.iter`` (= ``storage.iter``) is now the number of iterations completed."""

    def before_val(self, **kwargs: Any) -> None:
        """Before each validation run."""

    def after_val(self, **kwargs: Any) -> None:
        """After each validation run, with ``metrics`` (a flat ``{"bbox/AP": ...}`` dict)."""

    def before_save_checkpoint(self, **kwargs: Any) -> None:
        """With the ``checkpoint`` dict about to be written; may add keys."""

    def after_load_checkpoint(self, **kwargs: Any) -> None:
        """With the ``checkpoint`` dict just loaded for a resume; may read keys."""

    def before_stop(self, **kwargs: Any) -> None:
        """When training stops outside the schedule (SIGTERM / SIGINT, a dead data-loading worker), after the last
        completed iteration and before ``after_train``: CheckpointHook saves that iteration here (the loop saves
        ``model_iter{N}.pth`` itself when no hook did)."""

    def __repr__(self) -> str:
        return type(self).__name__

    # Whether a period ended is the loop's rule, in either unit: ``trainer.loop.ends_period(trainer.iter, n)``.
    @staticmethod
    def is_last_iter(trainer: TrainerLike) -> bool:
        return trainer.iter >= trainer.max_iter

    @staticmethod
    def finished(trainer: TrainerLike) -> bool:
        """In ``after_train``: the run ended as planned (all iterations, or a hook's ``stop_training``),
        not by an error or a signal."""
        return trainer.stop_training or trainer.iter >= trainer.max_iter


class HookList:
    """The trainer's hooks (``trainer.hooks``), and everything about them as a set, in one place.

    - **Order**: :meth:`add` inserts a hook by its ``priority`` (the hook's attribute, the one place a
      priority lives; ``add(hook, priority)`` overrides it on that hook), lower first, equal ones in
      registration order. Iterating, indexing and ``len`` follow this call order.
    - **Dispatch**: calling the list, ``hooks("after_step", trainer=..., storage=...)``, calls that
      mount point on every hook that overrides it, in order; hooks that keep a point's no-op are
      skipped, so an idle mount point costs nothing.
    - **State keys**: :meth:`state_dict` / :meth:`load_state_dict` key each stateful hook by its
      class name, then ``Name.1``, ``Name.2``, ... in *registration* order, so changing one hook's
      priority does not swap the states of two hooks of the same class, and the first hook of a
      class keeps the plain name (checkpoints from before repeats were keyed load).
    - **Time**: each (hook, point) accumulates its own time for :meth:`cost_table`. A hook that
      dispatches again through the same list (EvalHook calling ``before_val`` / ``after_val`` on
      every hook, a checkpoint write calling ``before_save_checkpoint``) is not charged for the hooks
      it triggers, so the table's totals add up to the time spent in hooks, each counted once.
    """

    def __init__(self, hooks: Iterable[TrainHook] = ()) -> None:
        self._hooks: list[TrainHook] = []  # call order
        self._registered: list[TrainHook] = []
        self._calls: dict[str, list[tuple[TrainHook, Any]]] = {point: [] for point in MOUNT_POINTS}
        self._point_index = {point: i for i, point in enumerate(MOUNT_POINTS)}
        self._seconds: dict[int, list[float]] = {}  # id(hook) -> seconds per mount point
        self._counts: dict[int, list[int]] = {}
        self._charged = 0.0  # every second charged so far, nested calls included
        for hook in hooks:
            self.add(hook)

    def add(self, hook: TrainHook, priority: int | str | Priority | None = None) -> None:
        """Insert ``hook`` by its priority (``priority`` given: set on the hook first)."""
        if priority is not None:
            hook.priority = get_priority(priority)
        value = get_priority(hook.priority)
        position = sum(1 for other in self._hooks if get_priority(other.priority) <= value)
        self._hooks.insert(position, hook)
        self._registered.append(hook)
        self._seconds[id(hook)] = [0.0] * len(MOUNT_POINTS)
        self._counts[id(hook)] = [0] * len(MOUNT_POINTS)
        for point in MOUNT_POINTS:
            self._calls[point] = [(h, getattr(h, point)) for h in self._hooks if _overrides(h, point)]

    def __iter__(self) -> Iterator[TrainHook]:
        return iter(self._hooks)

    def __len__(self) -> int:
        return len(self._hooks)

    def __getitem__(self, index: int) -> TrainHook:
        return self._hooks[index]

    def __call__(self, point: str, **kwargs: Any) -> None:
        column = self._point_index[point]
        clock = time.perf_counter
        for hook, method in self._calls[point]:
            # What nested dispatches charge during this call is their hooks' time, not this one's.
            charged_before = self._charged
            start = clock()
            method(**kwargs)
            own = clock() - start - (self._charged - charged_before)
            self._seconds[id(hook)][column] += own
            self._charged += own
            self._counts[id(hook)][column] += 1

    # ------------------------------------------------------------------ state
    def _stateful(self) -> list[tuple[str, TrainHook]]:
        seen: dict[str, int] = {}
        keyed = []
        for hook in self._registered:
            if hasattr(hook, "state_dict"):
                name = type(hook).__name__
                repeat = seen.get(name, 0)
                seen[name] = repeat + 1
                keyed.append((f"{name}.{repeat}" if repeat else name, hook))
        return keyed

    def state_dict(self) -> dict[str, Any]:
        """``{key: hook.state_dict()}`` for every hook with a ``state_dict`` (keys: see the class docstring)."""
        return {key: hook.state_dict() for key, hook in self._stateful()}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Give each stateful hook its entry of ``states`` (as :meth:`state_dict` keyed it), when there is one."""
        for key, hook in self._stateful():
            if states.get(key) is not None and hasattr(hook, "load_state_dict"):
                hook.load_state_dict(states[key])

    # ------------------------------------------------------------------ reports
    def order_table(self) -> str:
        """A table of priority and hook, in call order."""
        return format_table(("priority", "hook"), [(get_priority(h.priority), repr(h)) for h in self._hooks])

    def total_seconds(self) -> float:
        """Seconds spent in hooks, each counted once."""
        return self._charged

    def costs(self) -> list[tuple[TrainHook, str, int, float]]:
        """``(hook, point, calls, own seconds)`` for every (hook, point) that ran, in hook order."""
        return [
            (hook, point, self._counts[id(hook)][column], self._seconds[id(hook)][column])
            for hook in self._hooks
            for column, point in enumerate(MOUNT_POINTS)
            if self._counts[id(hook)][column]
        ]

    def cost_table(self) -> str:
        """A table of hook, point, calls, total ms and ms/call (own time) for every point that ran."""
        rows = [
            (repr(hook), point, str(calls), f"{seconds * 1000:.1f}", f"{seconds * 1000 / calls:.3f}")
            for hook, point, calls, seconds in self.costs()
        ]
        return format_table(("hook", "point", "calls", "total ms", "ms/call"), rows)


def _overrides(hook: TrainHook, point: str) -> bool:
    method = getattr(type(hook), point, None)
    return method is not None and method is not getattr(TrainHook, point)
