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
from support.helpers import ROOT


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
    code = ("import sys, pet.cli, pet.config, pet.data, pet.engine, pet.engine.hooks, pet.engine.experiment_trackers, "
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


# Module paths renamed after 0.2.0 (until 0.4.0) because their names said something else: old module -> (new module,
# a name both offer). Experiment trackers are no object tracking; a test_*.py module reads as a pytest file; an
# export graph is what a detector is (the detector contract), not deployment's.
RENAMED = {
    "pet.engine.trackers": ("pet.engine.experiment_trackers", "WandbWriter"),
    "pet.engine.hooks.test_hook": ("pet.engine.hooks.inference_speed", "TestHook"),
    "pet.deploy.graph": ("pet.modeling.export_graph", "TwoStageGraph"),
}


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_renamed_module_path_warns_naming_the_new_path_and_the_release_that_removes_it(old, monkeypatch):
    new, name = RENAMED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} is now {re.escape(new)}\b.*Pet 0\.4\.0$"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def _deprecated_until(release: str) -> str:
    """The changelog's Deprecated sections of what goes in ``release`` (``### Deprecated (... removed in X)``)."""
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        sections = re.findall(r"^### Deprecated \(([^)]*)\)$(.*?)(?=^##)", f.read(), flags=re.M | re.S)
    return "".join(body for heading, body in sections if heading.endswith(f"removed in {release}"))


@pytest.mark.parametrize("paths, release", [(MOVED, "0.3.0"), (RENAMED, "0.4.0")], ids=["moved", "renamed"])
def test_the_changelog_lists_every_old_module_path_with_the_release_that_removes_it(paths, release):
    deprecated = _deprecated_until(release)
    for old, (new, _) in paths.items():
        assert f"`{old}`" in deprecated and f"`{new}" in deprecated, old


def test_pet_itself_imports_no_deprecated_path(fresh_import):
    """None of the old paths is among the modules loaded."""
    assert fresh_import.returncode == 0, fresh_import.stderr[-3000:]
    assert not (set(MOVED) | set(RENAMED)) & set(fresh_import.stdout.split())


def test_the_coco_librarys_old_resolver_name_warns_and_resolves_the_same():
    """``resolve_backend`` also named deploy's runtime choice; the COCO library's is ``resolve_coco_library``."""
    from pet.evaluation import backends

    with pytest.warns(DeprecationWarning, match=r"resolve_coco_library.*Pet 0\.4\.0"):
        assert backends.resolve_backend("pycocotools") == backends.resolve_coco_library("pycocotools")


def test_onnxruntimes_quantizers_old_name_warns_and_gives_the_renamed_class():
    """``pet.deploy.int8.Quantizer`` was onnxruntime's quantizer until OpenVINO's joined it."""
    pytest.importorskip("onnxruntime.quantization", reason='the export extra is not installed')
    from pet.deploy import int8

    with pytest.warns(DeprecationWarning, match=r"OnnxRuntimeQuantizer.*Pet 0\.4\.0"):
        assert int8.Quantizer is int8.OnnxRuntimeQuantizer
