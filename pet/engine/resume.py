"""Deprecated: moved to :mod:`pet.engine.checkpointer` (``trainer.checkpointer``); it also saved."""
import warnings

from pet.engine.checkpointer import training_label_space  # noqa: F401

warnings.warn("pet.engine.resume is deprecated; use pet.engine.checkpointer (trainer.checkpointer)",
              DeprecationWarning, stacklevel=2)
