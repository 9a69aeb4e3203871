"""Deprecated: moved to :mod:`pet.engine.checkpointer` (``trainer.checkpointer``); it also saved."""
import warnings

from pet.data.categories import dataset_label_space as training_label_space  # noqa: F401
from pet.engine.checkpointer import Checkpointer  # noqa: F401

warnings.warn("pet.engine.resume is deprecated; use pet.engine.checkpointer (trainer.checkpointer)",
              DeprecationWarning, stacklevel=2)
