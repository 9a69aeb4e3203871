"""Deprecated: the atomic-write helpers moved to :mod:`pet.utils.files`, the one place for them.

Kept so ``from pet.evaluation.files import write_json_atomic`` (and the others) still works, with a
DeprecationWarning. Files are now staged as ``name.tmp<pid>`` (see :mod:`pet.utils.files`).
"""
import warnings

from pet.utils.files import atomic_open, atomic_path, write_bytes_atomic, write_json_atomic  # noqa: F401

warnings.warn("pet.evaluation.files is deprecated; import from pet.utils.files",
              DeprecationWarning, stacklevel=2)
