"""What a detector is lives in pet/modeling alone: outside it, code knows a detector only through the detector
contract (pet.modeling.Detector), never by class, architecture name or MODEL.META_ARCHITECTURE string.

The source is parsed, not imported, so an offence anywhere is named with its file and line. Docstrings and
comments may name architectures (as examples); code may not.
"""
from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest

import pet.modeling
from pet.modeling import Detector
from pet.modeling.build import META_ARCH_REGISTRY
from support.helpers import ROOT

# The packages that serve detectors without being one, and the command-line tools. tools/benchmarks is left out:
# each benchmark measures a named architecture against a named reference implementation (Pet's RT-DETR against
# transformers', its cascade heads against detectron2's), which is what it is for.
OUTSIDE_MODELING = ("pet/deploy", "pet/predict", "pet/data", "pet/engine", "pet/evaluation", "tools")
# What a two-stage detector is made of: code outside pet/modeling that reaches into them knows the architecture.
ARCHITECTURE_PARTS = {"roi_heads", "rpn"}


def _detector_classes() -> set[type]:
    found, stack = set(), [Detector]
    while stack:
        for cls in stack.pop().__subclasses__():
            if cls.__module__.startswith("pet.modeling."):
                found.add(cls)
            stack.append(cls)
    return found


DETECTORS = _detector_classes()
# Pet's detector classes and registered meta-architectures, by name, and the modules that define them.
ARCHITECTURE_NAMES = {cls.__name__ for cls in DETECTORS} | {name for name, _ in META_ARCH_REGISTRY}
FAMILY_MODULES = {cls.__module__ for cls in DETECTORS} - {"pet.modeling.detector"}


def _sources() -> Iterator[str]:
    for top in OUTSIDE_MODELING:
        folder = os.path.join(ROOT, top)
        if top == "tools":
            yield from (os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".py"))
            continue
        for directory, _, files in sorted(os.walk(folder)):
            yield from (os.path.join(directory, name) for name in sorted(files) if name.endswith(".py"))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def architecture_knowledge(source: str) -> list[tuple[int, str]]:
    """(line, what) of each place in ``source`` that knows a detector other than through the contract."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name) and node.id in ARCHITECTURE_NAMES:
            found.append((line, f"names the class {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr in ARCHITECTURE_NAMES | ARCHITECTURE_PARTS:
            found.append((line, f"reaches .{node.attr}"))
        elif isinstance(node, ast.alias) and node.name.rsplit(".", 1)[-1] in ARCHITECTURE_NAMES:
            found.append((line, f"imports {node.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level and (
                node.module in FAMILY_MODULES or node.module.startswith("pet.modeling.rtdetr")):
            found.append((line, f"imports from {node.module}"))
        elif isinstance(node, ast.Import) and any(a.name in FAMILY_MODULES for a in node.names):
            found.append((line, "imports a detector family's module"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and node.value in ARCHITECTURE_NAMES | ARCHITECTURE_PARTS):
            found.append((line, f"has the string {node.value!r}"))
        elif isinstance(node, ast.Compare) and any(
                isinstance(part, ast.Attribute) and part.attr == "META_ARCHITECTURE"
                for part in ast.walk(node)):
            found.append((line, "compares MODEL.META_ARCHITECTURE"))
    return sorted(found)


def test_the_contract_knows_every_builtin_detector():
    """The scan below is only as good as its list of names: every registered architecture is a Detector."""
    builtin = {"FasterRCNN", "MaskRCNN", "KeypointRCNN", "CascadeRCNN", "CascadeMaskRCNN", "RetinaNet", "FCOS",
               "RTDETR"}
    assert builtin <= ARCHITECTURE_NAMES
    for name in builtin:
        assert issubclass(META_ARCH_REGISTRY.get(name), Detector), name
    assert "pet.modeling.faster_rcnn" in FAMILY_MODULES and "pet.modeling.rtdetr.detector" in FAMILY_MODULES
    assert pet.modeling.Detector is Detector


def test_no_code_outside_pet_modeling_knows_an_architecture():
    offences = {}
    for path in _sources():
        with open(path, encoding="utf-8") as f:
            found = architecture_knowledge(f.read())
        if found:
            offences[os.path.relpath(path, ROOT)] = found
    assert offences == {}


@pytest.mark.parametrize("line, what", [
    ("from pet.modeling import RTDETR\nif isinstance(model, RTDETR):\n    pass\n", "names the class RTDETR"),
    ("from pet.modeling.fcos import FCOS\n", "imports from pet.modeling.fcos"),
    ("if cfg.MODEL.META_ARCHITECTURE == 'KeypointRCNN':\n    pass\n", "compares MODEL.META_ARCHITECTURE"),
    ("heads = getattr(model, 'roi_heads', model)\n", "has the string 'roi_heads'"),
    ("thresh = model.roi_heads.score_thresh\n", "reaches .roi_heads"),
    ("import pet.modeling\nok = isinstance(model, pet.modeling.RetinaNet)\n", "reaches .RetinaNet"),
])
def test_the_scan_catches_what_the_contract_replaced(line, what):
    """What pet/deploy, pet/predict and pet/data did before the contract: each is caught."""
    assert what in [w for _, w in architecture_knowledge(line)]


def test_docstrings_may_name_an_architecture():
    assert architecture_knowledge('"""Exports RTDETR and FasterRCNN."""\nx = 1  # roi_heads\n') == []
