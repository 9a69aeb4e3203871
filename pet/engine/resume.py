"""Deprecated: what a checkpoint holds and how a run resumes moved to :mod:`pet.engine.checkpointer`
(:class:`~pet.engine.checkpointer.Checkpointer`, ``trainer.checkpointer``); this module name said
"resume" though it also saved."""
import warnings

from pet.engine.checkpointer import training_label_space  # noqa: F401

warnings.warn("pet.engine.resume is deprecated; use pet.engine.checkpointer (trainer.checkpointer)",
              DeprecationWarning, stacklevel=2)
