"""Named timers that model code can open without knowing about the engine.

During testing the active :class:`pet.engine.inference_timer.InferenceTimer` (or TestHook) is registered here, so a
model can time a part of itself by name::

    from pet.utils.timers import timed

    with timed("rpn"):
        proposals = self.rpn(features)

and the figure shows up in the test speed summary. Outside testing ``timed`` costs a
function call and does nothing.

On GPU, kernels run asynchronously: ``timed`` calls the owner's ``wait()`` before it
starts and before it stops the timer, so the figure covers the block's own GPU work
(not work queued before it, nor only the kernel launches). ``InferenceTimer.wait`` synchronises
only when the model is on CUDA, so on CPU this costs nothing.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol


class _TimerOwner(Protocol):
    def wait(self) -> None: ...

    def tic(self, name: str) -> None: ...

    def toc(self, name: str) -> None: ...


_ACTIVE: list[_TimerOwner] = []


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Time the block under ``name`` in the active test hook, if there is one."""
    if not _ACTIVE:
        yield
        return
    owner = _ACTIVE[-1]
    owner.wait()
    owner.tic(name)
    try:
        yield
    finally:
        owner.wait()
        owner.toc(name)


@contextlib.contextmanager
def activate(owner: _TimerOwner) -> Iterator[None]:
    """Make ``owner`` the target of :func:`timed` inside the block."""
    _ACTIVE.append(owner)
    try:
        yield
    finally:
        _ACTIVE.remove(owner)
