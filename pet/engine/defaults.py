"""Deprecated: the command-line set-up moved to :mod:`pet.cli`, outside the engine (this name was pet.config's)."""
import warnings

from pet.cli import *  # noqa: F403 - its public names, as this module had them

warnings.warn("pet.engine.defaults is deprecated; import from pet.cli", DeprecationWarning, stacklevel=2)
