"""Deprecated: moved to :mod:`pet.engine.hooks.system`."""
import warnings

from pet.engine.hooks.system import EmptyCacheHook, ProfilerHook, SyncBuffersHook  # noqa: F401
from pet.utils.comm import all_reduce_buffers  # noqa: F401

warnings.warn("pet.engine.hooks.misc is deprecated; import from pet.engine.hooks", DeprecationWarning, stacklevel=2)
