"""Checkpoints: what one holds, writing it atomically, reading it, loading weights, resuming a run.

- :mod:`pet.checkpoint.checkpointer`: :class:`Checkpointer`, every checkpoint a training run writes or
  reads (``trainer.checkpointer``): the state it holds, saving, pruning, ``model_final.pth``, resuming.
- :mod:`pet.checkpoint.files`: atomic ``torch.save`` and the ``last_checkpoint`` pointer.
- :mod:`pet.checkpoint.loading`: :func:`load_checkpoint` (the one ``torch.load``, ``weights_only=True``
  unless the caller opts in to ``unsafe``) and :func:`load_weights` (weights into a model to fine-tune or test).

The package sits below the engine and imports only :mod:`pet.utils` and :mod:`pet.data`: the trainer, the
hooks (which only decide *when* to save), predict, deploy and tools all import it.
"""
from pet.checkpoint.checkpointer import Checkpointer, run_schedule
from pet.checkpoint.files import LAST_CHECKPOINT, atomic_save, read_last_checkpoint, write_last_checkpoint
from pet.checkpoint.loading import load_checkpoint, load_weights

__all__ = [
    "Checkpointer",
    "run_schedule",
    "LAST_CHECKPOINT",
    "atomic_save",
    "read_last_checkpoint",
    "write_last_checkpoint",
    "load_checkpoint",
    "load_weights",
]
