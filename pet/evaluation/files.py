"""Deprecated: moved to :mod:`pet.utils.files`, the one atomic-write helper (staged as ``name.tmp<pid>``)."""
import warnings

from pet.utils.files import atomic_open, atomic_path, write_bytes_atomic, write_json_atomic  # noqa: F401

warnings.warn("pet.evaluation.files is deprecated; import from pet.utils.files", DeprecationWarning, stacklevel=2)
