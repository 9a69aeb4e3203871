"""TestHook: Pet's test-time hook, an inference timer that also receives the test callbacks.

The two jobs live apart: :class:`pet.engine.timing.InferenceTimer` times the stages,
:class:`pet.engine.inference.TestCallback` is the callback contract. TestHook joins them
because that is the hook Pet users know (``TestHook(cfg_filename, logperiod, num_warmup)``);
a hook that only acts on results (a visualiser, a results dumper) subclasses TestCallback.
"""
from __future__ import annotations

from pet.engine.inference import TestCallback
from pet.engine.timing import InferenceTimer, StageTimer

__all__ = ["TestHook", "TestCallback", "StageTimer"]


class TestHook(InferenceTimer, TestCallback):
    """The inference-speed tracker (tic/toc, ``wait``, ``log_stats``) with no-op test callbacks."""

    __test__ = False  # not a pytest test class, despite the name
