"""Old import paths keep working for one release, each with a DeprecationWarning naming the new one."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# old module -> (new module, a name both offer)
MOVED = {
    "pet.evaluation.files": ("pet.utils.files", "write_json_atomic"),
    "pet.engine.resume": ("pet.checkpoint", "Checkpointer"),
    "pet.engine.checkpointer": ("pet.checkpoint", "Checkpointer"),
    "pet.engine.checkpoint": ("pet.checkpoint", "read_last_checkpoint"),
    "pet.utils.weights": ("pet.checkpoint", "load_weights"),
    "pet.engine.common": ("pet.engine.models", "unwrap_model"),
    "pet.engine.timing": ("pet.engine.inference_timer", "InferenceTimer"),
    "pet.engine.defaults": ("pet.cli", "build_trainer"),
    "pet.engine.hooks.test_hook": ("pet.engine.hooks", "TestHook"),
    "pet.engine.hooks.misc": ("pet.engine.hooks", "ProfilerHook"),
    "pet.engine.hooks.common": ("pet.engine.hooks", "PreciseBN"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_warns_and_gives_the_same_objects(old, monkeypatch):
    new, name = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_pet_itself_imports_no_deprecated_path():
    """Every package of Pet imported in a fresh interpreter: none of the old paths is among the modules loaded."""
    code = ("import sys, pet.config, pet.data, pet.engine, pet.engine.hooks, pet.engine.trackers, pet.evaluation, "
            "pet.modeling, pet.predict; print(' '.join(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:pet", "-c", code], capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert not set(MOVED) & set(proc.stdout.split())
