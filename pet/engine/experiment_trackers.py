"""Experiment-tracker writers: a Weights & Biases or MLflow run fed from the event storage.

Chosen in ``TRAIN.WRITERS`` by registry name (``{type: WandbWriter}``, ``{type: MLflowWriter}``);
the trackers are optional extras (``pip install -e ".[wandb]"`` / ``".[mlflow]"``), imported
when a writer is built, so a missing one is a ConfigError before training starts. What every
tracker writer does (:class:`TrackerWriter`):

- opens its run at its first write and logs the resolved config there, once;
- logs the scalars that are new since its last write at the iteration they were put at,
  valued as in ``metrics.json`` (smoothed scalars as the median over ``window_size``): the
  tracker's step is the ``iteration`` of ``metrics.json``, and so are the values;
- so the last value of every scalar, the last validation metrics (``bbox/AP``, ...) included,
  is the run's final one: the summary of a W&B run, the metrics of an MLflow run;
- when closed, logs ``curves.png`` (drawn by the curves writer, which closes before it: see
  :attr:`pet.engine.events.EventWriter.close_order`) and ends the run,
  marked failed when training failed.

A tracker that fails (unreachable, a full disk, a bug in its client) is logged once with its
cause and switched off for the rest of the run; training never stops because of it.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import netrc
import os
import pathlib
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import yaml

from pet.engine.events import WRITERS, EventWriter, get_event_storage
from pet.utils.errors import ConfigError

__all__ = ["TrackerWriter", "WandbWriter", "MLflowWriter"]

logger = logging.getLogger(__name__)


class TrackerWriter(EventWriter):
    """What every experiment-tracker writer does; a subclass only talks to its tracker.

    Subclasses implement :meth:`start_run`, :meth:`log_scalars`, :meth:`log_file` and
    :meth:`end_run`. Each call into them is guarded: the first exception is logged with its
    traceback and switches the writer off (later writes do nothing; closing still tries to
    end the run, quietly), so a tracker can lose data but never stops training.

    ``final_files`` (relative to ``output_dir``) are logged when the writer is closed, those
    that exist then: ``curves.png`` by default, which the curves writer draws when it is
    closed, before any writer of the default ``close_order``.
    """

    def __init__(self, output_dir: str, window_size: int = 20, final_files: Sequence[str] = ("curves.png",)) -> None:
        self.output_dir = output_dir
        self.window_size = window_size
        self.final_files = tuple(final_files)
        self._last_step = -1
        self._running = False  # start_run was called (it may have failed partway) and end_run not yet
        self._broken = False  # a call into the tracker failed: do nothing more

    def start_run(self, config: dict[str, Any]) -> None:
        """Open the run and log ``config`` (the resolved config as a nested dict; empty without a trainer)."""
        raise NotImplementedError

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Log ``{name: value}`` at ``step`` (iterations completed); steps only grow."""
        raise NotImplementedError

    def log_file(self, path: str) -> None:
        """Attach the file at ``path`` to the run."""
        raise NotImplementedError

    def end_run(self, failed: bool) -> None:
        """End what :meth:`start_run` opened, also when it failed partway; marked failed when ``failed``."""
        raise NotImplementedError

    def write(self, **kwargs: Any) -> None:
        if self._broken:
            return
        storage = kwargs.get("storage")
        new = (storage if storage is not None else get_event_storage()).scalars_since(self._last_step, self.window_size)
        with self._failsafe("logging"):
            if not self._running:
                self._running = True  # from here on, close() ends what start_run opened
                self.start_run(_config_dict(kwargs.get("trainer")))
            for step, scalars in new.items():
                self.log_scalars(scalars, step)
                self._last_step = step

    def close(self) -> None:
        """Log the final files and end the run; failed when called while an exception is handled.

        The trainer runs ``after_train`` (where writers are closed) inside its exception
        handler when training fails, which is how the run learns that it failed.
        """
        if not self._running:
            return
        self._running = False
        failed = sys.exc_info()[0] is not None
        if not self._broken:
            with self._failsafe("logging the final files"):
                for name in self.final_files:
                    path = os.path.join(self.output_dir, name)
                    if os.path.isfile(path):
                        self.log_file(path)
        with self._failsafe("ending the run"):
            self.end_run(failed)

    @contextlib.contextmanager
    def _failsafe(self, action: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            if not self._broken:
                logger.exception(f"{type(self).__name__} failed while {action} ({type(exc).__name__}: {exc}); "
                                 "it is switched off and training goes on without it")
            self._broken = True


@WRITERS.register()
class WandbWriter(TrackerWriter):
    """Logs to a Weights & Biases run whose files are under ``CKPT/wandb``.

    The run is offline unless W&B can log in without asking: a mode is chosen (``mode``, or
    the ``WANDB_MODE`` variable) or credentials are found (``WANDB_API_KEY``, or the netrc
    entry ``wandb login`` writes). Upload an offline run later with
    ``wandb sync CKPT/wandb/offline-run-*``. ``name`` defaults to the last part of ``CKPT``;
    ``init_kwargs`` (``entity``, ``group``, ``notes``, ``id``, ``resume``, ...) go to
    ``wandb.init`` as they are. ``curves.png`` is saved with the run's files.
    """

    def __init__(
        self,
        output_dir: str,
        project: str = "pet",
        name: str | None = None,
        tags: Sequence[str] = (),
        mode: str | None = None,
        window_size: int = 20,
        final_files: Sequence[str] = ("curves.png",),
        **init_kwargs: Any,
    ) -> None:
        self._wandb = _import_extra("WandbWriter", "wandb", "wandb")
        super().__init__(output_dir, window_size, final_files)
        self.init_kwargs = {"project": project, "name": name or _last_part(output_dir),
                            "tags": [tags] if isinstance(tags, str) else list(tags),
                            "mode": mode or _default_wandb_mode(), **init_kwargs}
        self._run: Any = None

    def start_run(self, config: dict[str, Any]) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        if self.init_kwargs["mode"] == "offline":
            logger.info(f"W&B logs offline under {os.path.join(self.output_dir, 'wandb')} (no W&B credentials or "
                        "mode set); upload the run later with `wandb sync`")
        self._run = self._wandb.init(dir=self.output_dir, config=config, **self.init_kwargs)

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def log_file(self, path: str) -> None:
        self._run.save(path, base_path=os.path.dirname(path), policy="now")

    def end_run(self, failed: bool) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)


@WRITERS.register()
class MLflowWriter(TrackerWriter):
    """Logs to an MLflow run, by default in a local store under ``CKPT``.

    The tracking URI is ``tracking_uri``, else the ``MLFLOW_TRACKING_URI`` variable, else
    ``sqlite:///<CKPT>/mlflow.db`` with artifacts under ``CKPT/mlartifacts``: MLflow's
    ``./mlruns`` file store is in maintenance mode (MLflow 3.17 refuses it unless
    ``MLFLOW_ALLOW_FILE_STORE=true``). Any URI MLflow accepts may be given; a new experiment
    then keeps its artifacts where MLflow puts them (``artifact_location`` to choose). The experiment
    defaults to the last part of ``CKPT`` (the config file's name when ``CKPT`` is left at its
    default); the run name, when not given, is MLflow's.

    Logged: the config flattened to params (``SOLVER.BASE_LR``; values longer than 500
    characters, the limit of older servers, are cut and end in "...") and in full as the
    artifact ``config.yaml``; scalars as metrics, names with characters MLflow refuses
    (anything but letters, digits, ``_ - . /`` and spaces) written with "_" instead; the
    final files as artifacts.
    """

    def __init__(
        self,
        output_dir: str,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, Any] | None = None,
        artifact_location: str | None = None,
        window_size: int = 20,
        final_files: Sequence[str] = ("curves.png",),
    ) -> None:
        entities = _import_extra("MLflowWriter", "mlflow", "mlflow.entities")
        client = _import_extra("MLflowWriter", "mlflow", "mlflow.tracking")
        super().__init__(output_dir, window_size, final_files)
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:  # the local store
            tracking_uri = "sqlite:///" + os.path.abspath(os.path.join(output_dir, "mlflow.db"))
            artifact_location = artifact_location or pathlib.Path(output_dir, "mlartifacts").resolve().as_uri()
        self.tracking_uri = tracking_uri
        _check_database_drivers(self.tracking_uri)
        self.experiment_name = experiment_name or _last_part(output_dir)
        self.run_name = run_name
        self.tags = {str(key): str(value) for key, value in (tags or {}).items()}
        self.artifact_location = artifact_location
        self._client_class, self._metric, self._param = client.MlflowClient, entities.Metric, entities.Param
        self._client: Any = None
        self._run_id = ""

    def start_run(self, config: dict[str, Any]) -> None:
        client = self._client_class(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(self.experiment_name, artifact_location=self.artifact_location))
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self._client, self._run_id = client, run.info.run_id
        client.log_batch(self._run_id, params=[self._param(key, value) for key, value in _flat_params(config).items()])
        client.log_text(self._run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self._metric(_mlflow_name(name), value, now_ms, step) for name, value in scalars.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def log_file(self, path: str) -> None:
        self._client.log_artifact(self._run_id, path)

    def end_run(self, failed: bool) -> None:
        if self._run_id:
            self._client.set_terminated(self._run_id, "FAILED" if failed else "FINISHED")


def _mlflow_name(name: str) -> str:
    """``name`` as MLflow accepts it on any platform: other characters and empty, ``.`` or ``..`` parts become "_"."""
    parts = re.sub(r"[^\w.\- /]", "_", name).split("/")
    return "/".join("_" if part in ("", ".", "..") else part for part in parts)


# Parameter values longer than this are cut: older MLflow servers refuse more than 500 characters.
_MAX_PARAM_CHARS = 500


def _flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"SOLVER.BASE_LR": "0.01", ...}``: nested keys joined with ".", values as text (JSON unless a string)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            params.update(_flat_params(value, name + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > _MAX_PARAM_CHARS:
            text = text[: _MAX_PARAM_CHARS - 3] + "..."
        params[_mlflow_name(name)] = text
    return params


def _config_dict(trainer: Any) -> dict[str, Any]:
    """The trainer's config as plain nested dicts and lists (what trackers store); empty without one."""
    cfg = getattr(trainer, "cfg", None)
    return yaml.safe_load(cfg.dump()) if cfg is not None else {}


def _last_part(path: str) -> str:
    return os.path.basename(os.path.normpath(os.path.abspath(path)))


def _import_extra(writer: str, extra: str, module: str) -> Any:
    """``module`` of the optional extra ``extra``, imported when ``writer`` is built (only that writer needs it);
    a ConfigError saying how to install it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{writer} needs the optional '{extra}' packages ({exc}): "
                          f"pip install -e \".[{extra}]\" in a Pet checkout, or pip install {extra}") from exc


def _default_wandb_mode() -> str | None:
    """``"offline"`` when W&B would have to ask for credentials; None leaves the choice to W&B."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return None if os.path.isfile(path) and netrc.netrc(path).authenticators(host or "") else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


def _check_database_drivers(tracking_uri: str) -> None:
    """MLflow's database stores need SQLAlchemy and Alembic, which ``mlflow-skinny`` leaves out."""
    if urlparse(tracking_uri).scheme.split("+")[0] not in ("sqlite", "postgresql", "mysql", "mssql"):
        return
    missing = [module for module in ("sqlalchemy", "alembic") if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"MLflowWriter's store {tracking_uri} needs {' and '.join(missing)}: "
                          "pip install -e \".[mlflow]\" in a Pet checkout, or pip install mlflow")
