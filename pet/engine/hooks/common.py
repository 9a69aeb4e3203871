"""Deprecated: moved to :mod:`pet.engine.hooks.per_step` and :mod:`pet.engine.hooks.precise_bn`."""
import warnings

from pet.engine.hooks.per_step import IterationTimer, LRScheduler, PeriodicWriter  # noqa: F401
from pet.engine.hooks.precise_bn import PreciseBN  # noqa: F401

warnings.warn("pet.engine.hooks.common is deprecated; import from pet.engine.hooks", DeprecationWarning, stacklevel=2)
