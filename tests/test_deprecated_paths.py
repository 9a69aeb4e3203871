"""What still works under an old name (CHANGELOG.md, Deprecated): each use warns, naming the new name and the
release that removes it, and the changelog lists every one. The module paths deprecated in 0.1.0 are gone."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest

import pet
import pet.evaluation
from pet.cli import default_argument_parser, init_distributed
from pet.config.defaults import RENAMED_KEYS
from pet.engine.hooks import HOOKS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_changelog_names_the_current_version_and_every_deprecation():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        changelog = f.read()
    releases = [name for name in re.findall(r"^## \[(.+?)\]", changelog, flags=re.M) if name != "Unreleased"]
    assert releases[0] == pet.__version__
    newest = changelog.split(f"## [{pet.__version__}]", 1)[1]
    deprecated = newest.split("### Deprecated", 1)[1].split("###", 1)[0]  # the newest release's list
    for old in (*RENAMED_KEYS, "json", "--local_rank", "DetectionVisualizer"):
        assert f"`{old}" in deprecated, old


def test_the_visualizer_hooks_old_name_warns_and_gives_the_renamed_class(caplog):
    """``DetectionVisualizer`` (before 0.2.0) is VisualizationHook until 0.3.0: imported, or named in TEST.HOOKS."""
    with pytest.warns(DeprecationWarning, match=r"pet\.evaluation\.VisualizationHook.*0\.3\.0"):
        old = pet.evaluation.DetectionVisualizer
    assert old is pet.evaluation.VisualizationHook
    with caplog.at_level("WARNING", logger="pet.utils.registry"):
        assert HOOKS.get("DetectionVisualizer") is pet.evaluation.VisualizationHook
    assert [r.getMessage() for r in caplog.records] == [
        "hook 'DetectionVisualizer' is now called 'VisualizationHook'; the old name goes in Pet 0.3.0."]
    with pytest.raises(AttributeError):
        pet.evaluation.NoSuchName  # noqa: B018 - the module's __getattr__ still refuses unknown names


def test_the_local_rank_flag_still_sets_local_rank_with_a_warning(monkeypatch, caplog):
    """torch.distributed.launch's ``--local-rank=N`` (before torchrun) until 0.3.0."""
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: init_distributed joins no group
    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.delenv("LOCAL_RANK")  # so that monkeypatch removes the value the flag sets
    args = default_argument_parser("test").parse_args(["--cfg", "a.yaml", "--local-rank=1"])
    with caplog.at_level("WARNING", logger="pet.cli"):
        init_distributed(args.local_rank, "cpu")
    assert os.environ["LOCAL_RANK"] == "1"
    assert [r.getMessage() for r in caplog.records] == [
        "--local_rank is deprecated and goes in Pet 0.3.0: launch with torchrun, which sets LOCAL_RANK"]


@pytest.fixture(scope="module")
def fresh_import() -> subprocess.CompletedProcess:
    """Every package of Pet imported in one fresh interpreter where a DeprecationWarning from Pet is an error; it
    prints the modules loaded. The tests of deprecated names and of deprecated paths share it: the imports are
    the slow part."""
    code = ("import sys, pet.cli, pet.config, pet.data, pet.engine, pet.engine.hooks, pet.engine.trackers, "
            "pet.evaluation, pet.modeling, pet.predict, pet.deploy, pet.checkpoint; "
            "print(' '.join(sorted(sys.modules)))")
    return subprocess.run([sys.executable, "-W", "error::DeprecationWarning:pet", "-c", code], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.slow
def test_pet_itself_uses_no_deprecated_name(fresh_import):
    assert fresh_import.returncode == 0, fresh_import.stderr[-3000:]


# Module paths moved in 0.2.0 (until 0.3.0): old module -> (new module, a name both offer).
MOVED = {
    "pet.engine.checkpointer": ("pet.checkpoint", "Checkpointer"),
    "pet.engine.checkpoint": ("pet.checkpoint", "read_last_checkpoint"),
    "pet.utils.weights": ("pet.checkpoint", "load_weights"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_module_path_warns_and_gives_the_same_objects(old, monkeypatch):
    new, name = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_the_changelog_lists_every_moved_module_path():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        deprecated = f.read().split("### Deprecated", 1)[1].split("###", 1)[0]
    for old in MOVED:
        assert f"`{old}`" in deprecated, old


def test_pet_itself_imports_no_deprecated_path(fresh_import):
    """None of the old paths is among the modules loaded."""
    assert fresh_import.returncode == 0, fresh_import.stderr[-3000:]
    assert not set(MOVED) & set(fresh_import.stdout.split())
