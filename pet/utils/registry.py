"""The generic registry that builds objects from config entries.

A config entry names a class either by its registry name (``PeriodicWriter``) or by a
dotted import path (``my_project.writers.CSVWriter``), so user code plugs in without
editing Pet. The registries themselves live with what they hold: the detectors' in
:mod:`pet.modeling.build` and :mod:`pet.modeling.registry`, the evaluators' in
:mod:`pet.evaluation.build`, the hooks' and writers' in :mod:`pet.engine`.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

from fvcore.common.registry import Registry as _FvcoreRegistry

from pet.utils.errors import ConfigError

__all__ = [
    "Registry",
    "locate",
    "resolve_spec",
    "build_from_spec",
]

logger = logging.getLogger(__name__)


class Registry(_FvcoreRegistry):
    """fvcore's registry, plus dotted-path lookup (a user's own class) and a did-you-mean error.

    A class renamed in a release keeps its old name through :meth:`register_renamed` until the
    release that removes it (CHANGELOG.md lists them).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._renamed: dict[str, tuple[str, str]] = {}

    def register_renamed(self, old: str, new: str, removed_in: str) -> None:
        """Let configs still name ``new`` by ``old``, with one warning per lookup, until version ``removed_in``."""
        self._renamed[old] = (new, removed_in)

    def get(self, name: str) -> Any:
        if name in self._renamed:
            new, removed_in = self._renamed[name]
            logger.warning(f"{self._name} '{name}' is now called '{new}'; the old name goes in Pet {removed_in}.")
            name = new
        if name in self:
            return super().get(name)
        if "." in name:
            return locate(name)
        close = difflib.get_close_matches(name, [k for k, _ in self], n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        known = ", ".join(sorted(k for k, _ in self))
        raise ConfigError(
            f"Unknown {self._name} '{name}'.{hint} Registered: {known}; "
            "or give a dotted import path such as 'my_package.module.ClassName'."
        )


def locate(path: str) -> Any:
    """Import ``package.module.Name`` and return ``Name``; a clear error if it fails."""
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported the same way
        raise ConfigError(f"Cannot import '{path}': {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, attr):
        raise ConfigError(f"Cannot import '{path}': module '{module_name}' has no '{attr}'")
    return getattr(module, attr)


def resolve_spec(registry: Registry, spec: Mapping[str, Any]) -> Any:
    """What ``spec['type']`` names in ``registry`` (a registered name or a dotted path), imported but not built."""
    if "type" not in spec and "TYPE" not in spec:
        raise ConfigError(f"Entry {dict(spec)} has no 'type': name a registered class or a dotted path")
    return registry.get(spec.get("type", spec.get("TYPE")))


def build_from_spec(registry: Registry, spec: Mapping[str, Any], **optional: Any) -> Any:
    """Build ``registry.get(spec['type'])(**rest_of_spec)``.

    Keys are lower-cased (YAML keys may be upper-case, constructor arguments are not).
    Each ``optional`` keyword (e.g. ``output_dir``) is passed only when the constructor
    accepts it and the spec does not set it.
    """
    cls = resolve_spec(registry, spec)
    kwargs = {str(k).lower(): v for k, v in spec.items() if str(k).lower() != "type"}
    accepted = _accepted_kwargs(cls)
    for key, value in optional.items():
        if key not in kwargs and (accepted is None or key in accepted):
            kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"Cannot build {getattr(cls, '__name__', cls)} from {dict(spec)}: {exc}") from exc


def _accepted_kwargs(cls: Any) -> set[str] | None:
    """Names ``cls(...)`` accepts, or None when it takes ``**kwargs``."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}
