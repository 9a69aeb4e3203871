"""Deprecated (removed in 0.3.0): moved to :mod:`pet.checkpoint.checkpointer`, with every other checkpoint module."""
import warnings

from pet.checkpoint.checkpointer import Checkpointer  # noqa: F401

warnings.warn("pet.engine.checkpointer is deprecated; import from pet.checkpoint", DeprecationWarning, stacklevel=2)
