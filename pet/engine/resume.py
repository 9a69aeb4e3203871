"""Deprecated: moved to :mod:`pet.checkpoint.checkpointer` (``trainer.checkpointer``); it also saved."""
import warnings

from pet.checkpoint.checkpointer import Checkpointer  # noqa: F401
from pet.data.categories import dataset_label_space as training_label_space  # noqa: F401

warnings.warn("pet.engine.resume is deprecated; use pet.checkpoint (trainer.checkpointer)",
              DeprecationWarning, stacklevel=2)
