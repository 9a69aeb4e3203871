"""Config loading: defaults <- YAML file (with ``_BASE_``) <- command-line ``KEY VALUE`` pairs.

``load_cfg`` is the single entry point the tools use. Every mistake (missing file, YAML
syntax error, unknown key, wrong type, invalid value) is a :class:`ConfigError` whose
message names the file or key and what to do.

Plugins: a model part named by dotted path in a ``MODEL.*`` name key (``META_ARCHITECTURE``,
``TYPE``, ``NAME``, ``HEAD_NAME``), e.g. ``MODEL.ROI_BOX_HEAD.NAME: my_pkg.heads.MyHead``,
is imported before the YAML is merged; when its module defines ``add_config(cfg)``, that
function adds the part's own keys to the defaults. A new head thus needs only its own
files and YAML, never an edit of pet/config.
"""
from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import logging
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import yaml
from fvcore.common.config import CfgNode

from pet.config.defaults import AUTO_OR_BOOL_KEYS, RENAMED_KEYS, get_default_cfg
from pet.utils.errors import ConfigError

__all__ = ["CfgNode", "get_default_cfg", "load_cfg", "default_output_dir", "default_weights"]

logger = logging.getLogger(__name__)

# MODEL.* keys that name a registered part, which may instead be a dotted path to a plugin.
_PLUGIN_KEY = re.compile(r"MODEL\.(.+\.)?(META_ARCHITECTURE|TYPE|NAME|HEAD_NAME)")
_DOTTED_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def load_cfg(cfg_file: str | None, opts: Sequence[str] = (), *, freeze: bool = True) -> CfgNode:
    """Build the run's config from the defaults, ``cfg_file`` and ``opts`` (``KEY VALUE ...``)."""
    cfg = get_default_cfg()
    from_file = _read_yaml(cfg_file) if cfg_file else {}
    from_opts = _with_new_names(_opts_as_dict(opts), "command line")
    add_plugin_config(cfg, from_file, from_opts)
    explicit = _merge_dict(cfg, from_file, source=cfg_file or "") | _merge_dict(cfg, from_opts, source="command line")
    if not cfg.CKPT:
        cfg.CKPT = default_output_dir(cfg_file)
    validate_cfg(cfg)
    if cfg.SOLVER.MAX_EPOCHS > 0 and cfg.SOLVER.MAX_ITER > 0 and "SOLVER.MAX_ITER" in explicit:
        raise ConfigError(
            f"Both SOLVER.MAX_ITER ({cfg.SOLVER.MAX_ITER}) and SOLVER.MAX_EPOCHS ({cfg.SOLVER.MAX_EPOCHS}) are set; "
            "train by iterations (SOLVER.MAX_EPOCHS 0) or by epochs (SOLVER.MAX_ITER 0), not both."
        )
    if freeze:
        cfg.freeze()
    return cfg


def add_plugin_config(cfg: CfgNode, *values: dict) -> None:
    """Import the plugins the ``MODEL.*`` name keys of ``values`` point at; let each add its keys to ``cfg``.

    ``values`` are the nested dicts about to be merged (the YAML file's, the command line's).
    A plugin module's ``add_config(cfg)`` runs once per config, before those values are
    merged, so they may set the plugin's keys.
    """
    called = set()
    for tree in values:
        for full_key, value in _leaves(tree):
            if not (_PLUGIN_KEY.fullmatch(full_key) and isinstance(value, str) and _DOTTED_PATH.fullmatch(value)):
                continue
            module_name = value.rpartition(".")[0]
            try:
                module = importlib.import_module(module_name)
            except ImportError as exc:
                raise ConfigError(f"{full_key} names '{value}', but module '{module_name}' cannot be imported: "
                                  f"{exc}. Check the path and that its package is on PYTHONPATH.") from exc
            add_config = getattr(module, "add_config", None)
            if callable(add_config) and module_name not in called:
                called.add(module_name)
                add_config(cfg)
                logger.debug(f"Config keys added by {module_name}.add_config")


def _opts_as_dict(opts: Sequence[str]) -> dict[str, Any]:
    """``["SOLVER.BASE_LR", "0.01", ...]`` as a nested dict of parsed literals."""
    opts = list(opts)
    if len(opts) % 2:
        raise ConfigError(f"Command-line overrides must be KEY VALUE pairs; got an odd list: {opts}")
    nested: dict[str, Any] = {}
    for key, raw in zip(opts[0::2], opts[1::2]):
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _parse_literal(raw)
    return nested


def _with_new_names(tree: dict, source: str) -> dict:
    """``tree`` with each old key of ``RENAMED_KEYS`` moved to its new name, one warning per old key.

    A renamed section moves whole (``TEST.PRECISE_BN`` -> ``HOOKS.PRECISE_BN``). Renaming happens per
    file, before a file is merged over its ``_BASE_``, so an old key in a user's file still overrides
    the new key of a shipped base it inherits.
    """
    for old, new in RENAMED_KEYS.items():
        *old_parents, old_leaf = old.split(".")
        node = tree
        for part in old_parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old_leaf not in node:
            continue
        value = node.pop(old_leaf)
        logger.warning(f"Config key '{old}' in {source} is now called '{new}'; please rename it.")
        *new_parents, new_leaf = new.split(".")
        node = tree
        for part in new_parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"Config key '{part}' in {source} is a section; give a mapping, got {node!r}")
        if new_leaf in node:
            raise ConfigError(f"{source} sets both '{old}' and its new name '{new}'; keep only '{new}'")
        node[new_leaf] = value
    return tree


def _leaves(tree: dict, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def default_weights(cfg: CfgNode) -> str:
    """The weights tools/test_net.py, tools/export.py, tools/predict.py and ``--backend auto`` take by default:
    ``TEST.WEIGHTS``, else the ``model_final.pth`` training wrote, in ``HOOKS.CHECKPOINT.OUT_DIR`` when that is
    set (where the checkpoints go), else in ``CKPT``."""
    return cfg.TEST.WEIGHTS or os.path.join(cfg.HOOKS.CHECKPOINT.OUT_DIR or cfg.CKPT, "model_final.pth")


def default_output_dir(cfg_file: str | None) -> str:
    """``ckpts/<path of cfg_file under cfgs/, without .yaml>`` (the file stem outside cfgs/)."""
    if not cfg_file:
        return os.path.join("ckpts", "default")
    parts = os.path.normpath(os.path.abspath(cfg_file)).split(os.sep)
    if "cfgs" in parts:
        idx = len(parts) - 1 - parts[::-1].index("cfgs")
        rel = os.path.join(*parts[idx + 1 :])
    else:
        rel = os.path.basename(cfg_file)
    return os.path.join("ckpts", os.path.splitext(rel)[0])


def validate_cfg(cfg: CfgNode) -> None:
    """Reject values that would only fail later, deep inside training."""
    solver = cfg.SOLVER
    checks = [
        (solver.BASE_LR > 0, f"SOLVER.BASE_LR must be > 0, got {solver.BASE_LR}"),
        (solver.IMS_PER_BATCH > 0, f"SOLVER.IMS_PER_BATCH must be > 0, got {solver.IMS_PER_BATCH}"),
        (solver.ACCUM_STEPS >= 1, f"SOLVER.ACCUM_STEPS must be >= 1, got {solver.ACCUM_STEPS}"),
        (cfg.TEST.IMS_PER_BATCH > 0, f"TEST.IMS_PER_BATCH must be > 0, got {cfg.TEST.IMS_PER_BATCH}"),
        (solver.MAX_ITER > 0 or solver.MAX_EPOCHS > 0,
         "Set SOLVER.MAX_ITER (iteration mode) or SOLVER.MAX_EPOCHS (epoch mode) to a positive value"),
        (solver.MAX_EPOCHS >= 0, f"SOLVER.MAX_EPOCHS must be >= 0, got {solver.MAX_EPOCHS}"),
        (solver.WARMUP_ITERS >= 0, f"SOLVER.WARMUP_ITERS must be >= 0, got {solver.WARMUP_ITERS}"),
        (solver.OPTIMIZER in ("SGD", "AdamW"), f"SOLVER.OPTIMIZER must be SGD or AdamW, got '{solver.OPTIMIZER}'"),
        (solver.LR_POLICY in ("step", "cosine", "flat_cosine"),
         f"SOLVER.LR_POLICY must be step, cosine or flat_cosine, got '{solver.LR_POLICY}'"),
        (solver.FLAT_ITERS >= 0, f"SOLVER.FLAT_ITERS must be >= 0, got {solver.FLAT_ITERS}"),
        (0.0 <= solver.COSINE_END_FACTOR <= 1.0,
         f"SOLVER.COSINE_END_FACTOR must be in [0, 1], got {solver.COSINE_END_FACTOR}"),
        *[(amp.ENABLED in ("auto", True, False), f"{key}.ENABLED must be auto, True or False, got {amp.ENABLED!r}")
          for key, amp in (("SOLVER.AMP", solver.AMP), ("TEST.AMP", cfg.TEST.AMP))],
        *[(amp.DTYPE in ("auto", "bfloat16", "float16"),
           f"{key}.DTYPE must be auto, bfloat16 or float16, got '{amp.DTYPE}'")
          for key, amp in (("SOLVER.AMP", solver.AMP), ("TEST.AMP", cfg.TEST.AMP))],
        (cfg.DEVICE in ("auto", "cpu", "cuda"), f"DEVICE must be auto, cpu or cuda, got '{cfg.DEVICE}'"),
        (cfg.MODEL.NUM_CLASSES > 0, f"MODEL.NUM_CLASSES must be > 0, got {cfg.MODEL.NUM_CLASSES}"),
        (cfg.MODEL.LABEL_SPACE in ("contiguous", "category_id"),  # pet.data.categories.LABEL_SPACES
         f"MODEL.LABEL_SPACE must be contiguous or category_id, got '{cfg.MODEL.LABEL_SPACE}'"),
        (cfg.DISPLAY_ITER > 0, f"DISPLAY_ITER must be > 0, got {cfg.DISPLAY_ITER}"),
        (cfg.DATA.ON_BAD_IMAGE in ("error", "skip"),
         f"DATA.ON_BAD_IMAGE must be error or skip, got '{cfg.DATA.ON_BAD_IMAGE}'"),
        (cfg.TEST.COCO_BACKEND in ("auto", "pycocotools", "faster"),
         f"TEST.COCO_BACKEND must be auto, pycocotools or faster, got '{cfg.TEST.COCO_BACKEND}'"),
        (cfg.TEST.COCO_BACKEND != "faster" or importlib.util.find_spec("faster_coco_eval") is not None,
         "TEST.COCO_BACKEND faster needs faster-coco-eval: pip install faster-coco-eval, or set auto / pycocotools"),
        (0 < cfg.TEST.DIAGNOSTICS.IOU <= 1, f"TEST.DIAGNOSTICS.IOU must be in (0, 1], got {cfg.TEST.DIAGNOSTICS.IOU}"),
        (0 <= cfg.TEST.DIAGNOSTICS.SCORE <= 1,
         f"TEST.DIAGNOSTICS.SCORE must be in [0, 1], got {cfg.TEST.DIAGNOSTICS.SCORE}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"Config file not found: {path} (pass an existing YAML file to --cfg)")
    try:
        return _load_with_base(path)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else path
        # yaml.safe_load refuses tags that would build Python objects or run code (!!python/object/apply:...):
        # that is a refused tag, not a syntax error, and nothing was executed.
        problem = exc.problem or ""
        if isinstance(exc, yaml.constructor.ConstructorError) and problem.startswith(
                "could not determine a constructor for the tag '"):
            name = problem.split("'")[1].replace("tag:yaml.org,2002:", "!!")
            raise ConfigError(
                f"Unsafe YAML tag {name} in {where}: configs are read with yaml.safe_load, which never builds "
                "Python objects or runs code; write a plain value (number, string, list or mapping) instead"
            ) from exc
        raise ConfigError(f"YAML syntax error in {where}: {exc.problem}") from exc
    except FileNotFoundError as exc:
        raise ConfigError(f"_BASE_ of {path} not found: {exc.filename}") from exc


def _load_with_base(path: str) -> dict:
    """The YAML file at ``path`` (``yaml.safe_load``) merged over its ``_BASE_`` file or list of files.

    As fvcore's ``CfgNode.load_yaml_with_base``, a base path is relative to the file naming it, and a later
    file's values replace an earlier one's; in addition each file's old key names become the new ones
    before it is merged (:func:`_with_new_names`).
    """
    with open(path, encoding="utf-8") as f:
        loaded = yaml.safe_load(f)
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(loaded).__name__}")
    bases = loaded.pop("_BASE_", [])
    merged: dict = {}
    for base in [bases] if isinstance(bases, str) else bases:
        _merge_tree(_load_with_base(os.path.join(os.path.dirname(path), os.path.expanduser(base))), merged, path)
    _merge_tree(_with_new_names(loaded, path), merged, path)
    return merged


def _merge_tree(values: dict, into: dict, path: str) -> None:
    """Merge the nested dict ``values`` into ``into``; ``values`` wins."""
    for key, value in values.items():
        if isinstance(value, dict) and key in into:
            if not isinstance(into[key], dict):
                raise ConfigError(f"{path} gives a mapping for '{key}', which its _BASE_ sets to {into[key]!r}")
            _merge_tree(value, into[key], path)
        else:
            into[key] = value


def _merge_dict(cfg: CfgNode, values: dict, source: str, prefix: str = "") -> set[str]:
    """Merge ``values`` into ``cfg`` with checks; returns the full names of the keys set."""
    merged = set()
    for key, value in values.items():
        full_key = prefix + key
        if key not in cfg:
            raise ConfigError(f"Unknown config key '{full_key}' in {source}.{_did_you_mean(full_key)}")
        default = cfg[key]
        if isinstance(default, CfgNode):
            if not isinstance(value, dict):
                raise ConfigError(f"Config key '{full_key}' in {source} is a section; give a mapping, got {value!r}")
            merged |= _merge_dict(default, value, source, prefix=full_key + ".")
        else:
            cfg[key] = _coerce(value, default, full_key, source)
            merged.add(full_key)
    return merged


def _coerce(value: Any, default: Any, full_key: str, source: str) -> Any:
    if isinstance(value, str) and not isinstance(default, str):
        value = _parse_literal(value)  # YAML leaves "(1, 2)" or "[a]" a string; so does yacs' decoder
    if default is None or value is None or type(value) is type(default):
        return value
    if full_key in AUTO_OR_BOOL_KEYS and (isinstance(value, bool) or value == "auto"):
        return value
    if isinstance(default, float) and not isinstance(value, bool):
        # YAML 1.1 reads "1e-3" as a string and "1" as an int; both mean a float here.
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(default)(value)
    if isinstance(default, (list, tuple)) and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return type(default)([value])
    raise ConfigError(
        f"Config key '{full_key}' in {source} expects {type(default).__name__} "
        f"(default {default!r}), got {type(value).__name__} {value!r}"
    )


def _parse_literal(raw: Any) -> Any:
    """A Python literal; else a YAML flow list or mapping (``[{type: Resize, size: [640, 640]}]``, as in a config
    file); else the string itself."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        pass
    if isinstance(raw, str) and raw.lstrip().startswith(("[", "{")):
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw
        if isinstance(value, (list, dict)):
            return value
    return raw


def _all_keys(cfg: CfgNode, prefix: str = "") -> Iterable[str]:
    for key, value in cfg.items():
        yield prefix + key
        if isinstance(value, CfgNode):
            yield from _all_keys(value, prefix + key + ".")


def _did_you_mean(full_key: str) -> str:
    close = difflib.get_close_matches(full_key, _ALL_KEYS, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else " See pet/config/defaults.py for every key."


_ALL_KEYS = list(_all_keys(get_default_cfg()))
