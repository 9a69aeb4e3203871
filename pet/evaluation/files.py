"""Files the evaluation writes: JSON replaced atomically, so a reader never sees half a file."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

__all__ = ["write_json_atomic"]


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to a temporary file in the same folder, then rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
