"""Deprecated: the command-line set-up moved to :mod:`pet.engine.cli` (this name was
also that of pet.config.defaults)."""
import warnings

from pet.engine.cli import (  # noqa: F401
    build_test_model,
    build_trainer,
    default_argument_parser,
    default_setup,
    distributed_backend,
    init_distributed,
    launch_cli,
    seed_everything,
)

warnings.warn("pet.engine.defaults is deprecated; import from pet.engine.cli",
              DeprecationWarning, stacklevel=2)
