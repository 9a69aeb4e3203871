"""The dependency rules of docs/design.md, read from the source: pet/engine is acyclic and imports at module level.

Every module under pet/ is parsed (nothing is imported), so a rule broken anywhere fails
here with the modules named, not as an ImportError on some other path.
"""
from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Iterator

import pytest

from support.helpers import ROOT

PET_ROOT = os.path.join(ROOT, "pet")


def _module_files() -> dict[str, str]:
    """``{"pet.engine.trainer": path, "pet.engine": path of its __init__.py, ...}``."""
    modules = {}
    for directory, _, files in os.walk(PET_ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, os.path.dirname(PET_ROOT))[:-3].split(os.sep)
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _module_files()


def _imported_names(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        for alias in node.names:  # "from pet.engine import trainer" imports the module pet.engine.trainer
            submodule = f"{node.module}.{alias.name}"
            yield submodule if submodule in MODULES else node.module


def _imports(module: str) -> tuple[set[str], list[tuple[int, str]]]:
    """(pet modules imported when ``module`` is imported, [(line, module) imported inside a function or class])."""
    with open(MODULES[module], encoding="utf-8") as f:
        tree = ast.parse(f.read())
    at_import: set[str] = set()
    deferred: list[tuple[int, str]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))
            for name in _imported_names(child):
                if name == "pet" or name.startswith("pet."):
                    (deferred.append((child.lineno, name)) if inner else at_import.add(name))
            visit(child, inner)

    visit(tree, False)
    return at_import, deferred


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _edges(module: str) -> set[str]:
    """What importing ``module`` runs: each imported module and its packages' ``__init__``, except the
    packages ``module`` itself lives in (those are initialising already, as in any package)."""
    own = set(_ancestors(module))
    targets = set()
    for name in _imports(module)[0]:
        targets.update(m for m in (*_ancestors(name), name) if m in MODULES and m not in own and m != module)
    return targets


def _cycles(nodes: list[str]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), among ``nodes``."""
    graph = {n: sorted(_edges(n) & set(nodes)) for n in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in nodes:
        if node not in index:
            connect(node)
    return found


def _package(name: str) -> list[str]:
    return sorted(m for m in MODULES if m == name or m.startswith(name + "."))


ENGINE = _package("pet.engine")


def test_pet_engine_and_checkpoint_modules_form_no_import_cycle():
    """pet.checkpoint sits below the engine, which imports it (the trainer, the hooks' view of the trainer)."""
    assert _cycles(ENGINE + _package("pet.checkpoint")) == []


def test_nothing_inside_pet_imports_pet_at_function_level():
    deferred = {m: _imports(m)[1] for m in MODULES}
    assert {m: lines for m, lines in deferred.items() if lines} == {}


def _third_party_imports_in_functions(path: str) -> list[tuple[int, str]]:
    """(line, source) of each import inside a function that is not of a pet module."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    found = []
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not any(
                        n == "pet" or n.startswith("pet.") for n in _imported_names(node)):
                    found.append((node.lineno, source.splitlines()[node.lineno - 1]))
    return found


def test_every_import_inside_a_function_says_why():
    """An optional package imported where it is needed carries a one-line reason as a comment."""
    unexplained = {module: [line for line in _third_party_imports_in_functions(path) if "#" not in line[1]]
                   for module, path in MODULES.items()}
    assert {m: lines for m, lines in unexplained.items() if lines} == {}


@pytest.mark.slow
@pytest.mark.parametrize("importer, forbidden", [
    ("pet.engine", "pet.evaluation"),  # evaluation may use the engine's callbacks: one way only
    ("pet.engine", "pet.modeling"),  # the engine builds models through the registry
    ("pet.data", "pet.engine"),
    ("pet.data", "pet.checkpoint"),
    ("pet.checkpoint", "pet.engine"),  # the trainer, predict, deploy and tools all import checkpoints
    ("pet.checkpoint", "pet.modeling"),
    ("pet.checkpoint", "pet.evaluation"),
    ("pet.checkpoint", "pet.predict"),
    ("pet.checkpoint", "pet.cli"),
    ("pet.utils", "pet.engine"),  # the ground floor names nothing above it
    ("pet.utils", "pet.modeling"),
    ("pet.utils", "pet.evaluation"),
    ("pet.utils", "pet.data"),
])
def test_dependencies_point_one_way(importer, forbidden):
    offenders = {
        module: sorted(name for name in (*_imports(module)[0], *(n for _, n in _imports(module)[1]))
                       if name == forbidden or name.startswith(forbidden + "."))
        for module in MODULES if module == importer or module.startswith(importer + ".")
    }
    assert {m: names for m, names in offenders.items() if names} == {}


# The command-line module sets up a process for tools/; a library module that imported it would depend on
# every layer at once.
def test_no_library_module_imports_the_command_line_module():
    importers = {module for module in MODULES if module != "pet.cli"
                 and "pet.cli" in {*_imports(module)[0], *(name for _, name in _imports(module)[1])}}
    assert importers == set()


# Import by a name computed at run time: where the name comes from the user's config (a dotted path to their
# own class or plugin) or is an optional third-party extra. Pet's own modules are imported by import statements.
IMPORTERS_BY_NAME = {"locate", "import_module", "__import__"}
IMPORTS_BY_NAME_FOR_USERS = {"pet.utils.registry", "pet.config", "pet.engine.experiment_trackers"}


def _lookups_by_name(source: str) -> tuple[list[int], list[tuple[int, str]]]:
    """([line of each call to an importer by name], [(line, string) naming a pet module or an object in one]).

    The strings that count are a module that is not a package (``"pet.engine.experiment_trackers"``) and a module's
    attribute (``"pet.modeling.build.build_model"``): what an import by name is handed. A package's name
    alone is also a logger's (``"pet.engine"``) and is left alone, as are docstrings.
    """
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    calls, names = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in IMPORTERS_BY_NAME:
                calls.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            module, _, attr = node.value.rpartition(".")
            leaf = node.value in MODULES and not MODULES[node.value].endswith("__init__.py")
            if leaf or (module in MODULES and attr.isidentifier() and not attr.startswith("__")
                        and re.search(rf"^(def |class )?{attr}\b", _source(module), re.M)):
                names.append((node.lineno, node.value))
    return calls, names


def _source(module: str) -> str:
    with open(MODULES[module], encoding="utf-8") as f:
        return f.read()


def test_pet_imports_its_own_modules_by_import_statements_not_by_name():
    """The import graph shows every real dependency: no builder, writer or module of Pet is found by its name."""
    found = {module: _lookups_by_name(_source(module)) for module in MODULES}
    assert {m for m, (calls, _) in found.items() if calls} == IMPORTS_BY_NAME_FOR_USERS
    assert {m: names for m, (_, names) in found.items() if names} == {}


def test_the_checker_sees_a_lookup_by_name():
    calls, names = _lookups_by_name(
        'LOGGER = "pet.engine"\nBUILDER = "pet.modeling.build.build_model"\n'
        'WRITERS = "pet.engine.experiment_trackers"\n'
        'def build(cfg):\n    return locate(BUILDER)(cfg)\n')
    assert calls == [5] and names == [(2, "pet.modeling.build.build_model"), (3, "pet.engine.experiment_trackers")]


def test_the_checker_sees_a_cycle_and_a_deferred_import(tmp_path, monkeypatch):
    """The rules above are only worth something if the parser finds what they forbid."""
    package = tmp_path / "pet" / "engine"
    package.mkdir(parents=True)
    (tmp_path / "pet" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pet.engine.b import g\n\ndef f():\n    from pet.engine import c\n")
    (package / "b.py").write_text("import pet.engine.a\n\ng = 1\n")
    (package / "c.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {
        "pet": str(tmp_path / "pet" / "__init__.py"), "pet.engine": str(package / "__init__.py"),
        **{f"pet.engine.{n}": str(package / f"{n}.py") for n in "abc"}})
    assert _cycles(["pet.engine", "pet.engine.a", "pet.engine.b", "pet.engine.c"]) == [["pet.engine.a", "pet.engine.b"]]
    assert _imports("pet.engine.a")[1] == [(4, "pet.engine.c")]
