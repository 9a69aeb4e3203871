"""Deprecated: PeriodicWriter, IterationTimer and LRScheduler moved to
:mod:`pet.engine.hooks.per_step`, PreciseBN to :mod:`pet.engine.hooks.precise_bn`; ``from pet.engine.hooks import ...``
is the public path."""
import warnings

from pet.engine.hooks.per_step import IterationTimer, LRScheduler, PeriodicWriter  # noqa: F401
from pet.engine.hooks.precise_bn import PreciseBN  # noqa: F401

warnings.warn("pet.engine.hooks.common is deprecated; import from pet.engine.hooks",
              DeprecationWarning, stacklevel=2)
