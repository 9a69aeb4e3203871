"""WandbWriter and MLflowWriter, for real: a tiny Trainer logs to an offline W&B run and a local MLflow store.

What the trackers hold is read back through their own tools (``wandb leet inspect`` on the
run's ``.wandb`` file; ``MlflowClient``) and compared with ``metrics.json``: the same values
at the same iterations. The trackers are selected by registry name in ``TRAIN.WRITERS``, as
users do, so this module never imports ``pet.engine.experiment_trackers`` itself.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from pet.engine.events import build_writers, read_metrics
from pet.engine.hooks import EvalHook
from pet.engine.trainer import Trainer
from pet.utils.errors import ConfigError
from support.toys import InfiniteToyLoader, ToyModel

# MLflow 3.17's SQL store still uses a loader strategy SQLAlchemy 2.1 deprecates; nothing Pet can change.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning")

# A per-category AP whose name MLflow refuses as it is: parentheses become "_".
ODD_METRIC, ODD_METRIC_IN_MLFLOW = "bbox/AP-traffic light(9)", "bbox/AP-traffic light_9_"


@pytest.fixture(autouse=True)
def offline_trackers(tmp_path, monkeypatch):
    """No W&B credentials, mode or shared directories, and no MLflow URI from the environment."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))


def _validation(trainer) -> dict:
    return {"bbox": {"AP": trainer.iter / 100, "AP-traffic light(9)": trainer.iter / 200}}


class FailingModel(ToyModel):
    """Raises in its ``fail_at``-th training step."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, x, y):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("step failed")
        return super().forward(x, y)


def _cfg(make_cfg, writer: dict):
    """10 iterations, written at 4, 8 and 10, with ``writer`` in TRAIN.WRITERS (unfrozen: tests may change it)."""
    cfg = make_cfg("SOLVER.MAX_ITER", 10, "DISPLAY_ITER", 4, freeze=False)
    cfg.TRAIN.WRITERS = [writer]
    return cfg


def _train(cfg, model: torch.nn.Module | None = None) -> Trainer:
    """Train with validation at iterations 5 and 10."""
    cfg.freeze()
    trainer = Trainer(cfg, model=model or ToyModel(), data_loader=InfiniteToyLoader())
    trainer.register_hooks([EvalHook(5, _validation)])
    trainer.train()
    return trainer


def _metrics_json(output_dir: str) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(iteration, value), ...]}`` from the run's metrics.json."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(os.path.join(output_dir, "metrics.json")):
        for name, value in record.items():
            if name != "iteration":
                series.setdefault(name, []).append((record["iteration"], value))
    return series


def _wandb_file(output_dir: str) -> str:
    """The one offline run's transaction log, which must be under CKPT/wandb."""
    (path,) = glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "run-*.wandb"))
    return path


def _wandb_inspect(path: str, *flags: str) -> str:
    command = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, path]
    return subprocess.run(command, capture_output=True, text=True, check=True,
                          env={**os.environ, "WANDB_MODE": "offline"}).stdout


def _wandb_records(path: str) -> list[dict]:
    return [json.loads(line) for line in _wandb_inspect(path).splitlines()]


def _wandb_history(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` from the history records of a ``.wandb`` file."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record["type"] == "history":
            step = record["history"]["step"]["num"]
            for name, value in record["history"]["item"].items():
                if not name.startswith("_"):
                    series.setdefault(name, []).append((step, value))
    return series


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory) -> str:
    """An MLflow SQLite store with its tables made: creating them takes seconds, copying the file does not."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "empty.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return str(path)


@pytest.fixture
def mlflow_spec(empty_mlflow_db, tmp_path) -> dict:
    """An MLflowWriter entry with a store of this test's own outside CKPT, as a user gives a ``tracking_uri``."""
    shutil.copy(empty_mlflow_db, tmp_path / "tracking.db")
    return {"type": "MLflowWriter", "tracking_uri": f"sqlite:///{tmp_path / 'tracking.db'}",
            "artifact_location": str(tmp_path / "artifacts")}


def _mlflow_run(output_dir: str, tracking_uri: str | None = None):
    """The client and the one run of the experiment named after CKPT (in the local store under CKPT by default)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri or f"sqlite:///{output_dir}/mlflow.db")
    experiment = client.get_experiment_by_name(os.path.basename(output_dir))
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def _mlflow_history(client, run, names) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` for those of ``names`` the run has (MLflow's names)."""
    series = {name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)] for name in names}
    return {name: sorted(points) for name, points in series.items() if points}


def _in_mlflow_names(series: dict) -> dict:
    return {ODD_METRIC_IN_MLFLOW if name == ODD_METRIC else name: points for name, points in series.items()}


def _tracker_errors(caplog) -> list:
    return [r for r in caplog.records if r.name == "pet.engine.experiment_trackers" and r.levelname == "ERROR"]


def test_wandb_offline_run_holds_the_config_and_the_metrics_json_values_at_their_steps(make_cfg):
    trainer = _train(_cfg(make_cfg, {"type": "WandbWriter", "project": "pet-tests", "tags": ["toy"]}))
    expected = _metrics_json(trainer.output_dir)
    assert expected["bbox/AP"] == [(5, 0.05), (10, 0.1)] and [i for i, _ in expected["total_loss"]] == [4, 8, 10]

    path = _wandb_file(trainer.output_dir)
    records = _wandb_records(path)
    assert _wandb_history(records) == expected
    run = json.loads(_wandb_inspect(path, "--summary"))
    assert run["state"] == "finished" and run["project"] == "pet-tests" and run["tags"] == ["toy"]
    assert run["name"] == "run"  # the last part of CKPT
    assert run["config"]["SOLVER"]["MAX_ITER"] == 10 and run["config"]["CKPT"] == trainer.output_dir
    assert run["summary"]["bbox/AP"] == 0.1 and run["summary"][ODD_METRIC] == 0.05  # the final metrics
    saved = [f["path"] for record in records if record["type"] == "files" for f in record["files"]["files"]]
    assert "curves.png" in saved and os.path.isfile(os.path.join(os.path.dirname(path), "files", "curves.png"))


def test_mlflow_local_store_holds_the_config_and_the_metrics_json_values_at_their_steps(make_cfg, tmp_path,
                                                                                        empty_mlflow_db):
    os.makedirs(tmp_path / "run")
    shutil.copy(empty_mlflow_db, tmp_path / "run" / "mlflow.db")  # skips making the tables; changes nothing else
    cfg = _cfg(make_cfg, {"type": "MLflowWriter", "tags": {"team": "vision"}})
    cfg.TRAIN.DATASETS = tuple(f"long_dataset_name_{i:03d}" for i in range(40))  # 1000+ characters; unused here
    trainer = _train(cfg)
    expected = _in_mlflow_names(_metrics_json(trainer.output_dir))

    client, run = _mlflow_run(trainer.output_dir)
    assert _mlflow_history(client, run, expected) == expected
    assert run.info.status == "FINISHED" and run.data.tags["team"] == "vision"
    assert run.data.metrics["bbox/AP"] == 0.1 and run.data.metrics[ODD_METRIC_IN_MLFLOW] == 0.05  # the final metrics
    params = run.data.params
    assert params["SOLVER.MAX_ITER"] == "10" and params["SOLVER.BASE_LR"] == "0.01"
    assert len(params["TRAIN.DATASETS"]) == 500 and params["TRAIN.DATASETS"].endswith("...")
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.yaml", "curves.png"}
    assert run.info.artifact_uri.startswith((tmp_path / "run" / "mlartifacts").as_uri())
    with open(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))) as f:
        config = yaml.safe_load(f)
    assert config == yaml.safe_load(trainer.cfg.dump()) and len(config["TRAIN"]["DATASETS"]) == 40


def _break_wandb_from_step(monkeypatch, first_failing_step: int) -> None:
    import wandb

    log = wandb.Run.log

    def failing_log(self, data, step=None, **kwargs):
        if step is not None and step >= first_failing_step:
            raise ConnectionError("tracker went away")
        return log(self, data, step=step, **kwargs)

    monkeypatch.setattr(wandb.Run, "log", failing_log)


def _break_mlflow_from_step(monkeypatch, first_failing_step: int) -> None:
    from mlflow.tracking import MlflowClient

    log_batch = MlflowClient.log_batch

    def failing_log_batch(self, run_id, metrics=(), **kwargs):
        if any(m.step >= first_failing_step for m in metrics):
            raise ConnectionError("tracker went away")
        return log_batch(self, run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", failing_log_batch)


@pytest.mark.parametrize("writer", ["WandbWriter", "MLflowWriter"])
def test_a_tracker_failing_mid_run_is_logged_once_and_training_finishes(make_cfg, monkeypatch, caplog, mlflow_spec,
                                                                         writer):
    if writer == "WandbWriter":
        _break_wandb_from_step(monkeypatch, 8)
        spec = {"type": writer}
    else:
        _break_mlflow_from_step(monkeypatch, 8)
        spec = mlflow_spec
    with caplog.at_level("INFO", logger="pet.engine.experiment_trackers"):
        trainer = _train(_cfg(make_cfg, spec))

    written = _metrics_json(trainer.output_dir)
    assert trainer.iter == 10 and [i for i, _ in written["total_loss"]] == [4, 8, 10]
    (error,) = _tracker_errors(caplog)
    assert error.getMessage().startswith(f"{writer} failed while logging") and "tracker went away" in error.exc_text
    # What was logged before the failure is kept: the losses of step 4 and the AP of step 5.
    expected = {name: [(i, v) for i, v in points if i < 8] for name, points in written.items()}
    if writer == "WandbWriter":
        assert _wandb_history(_wandb_records(_wandb_file(trainer.output_dir))) == expected
    else:
        client, run = _mlflow_run(trainer.output_dir, mlflow_spec["tracking_uri"])
        assert _mlflow_history(client, run, _in_mlflow_names(expected)) == _in_mlflow_names(expected)
        assert run.info.status == "FINISHED"  # the run is still ended


@pytest.mark.parametrize("writer, in_the_way", [("WandbWriter", "wandb"), ("MLflowWriter", "mlartifacts")])
def test_a_tracker_that_cannot_write_its_files_does_not_stop_training(make_cfg, tmp_path, caplog, empty_mlflow_db,
                                                                      writer, in_the_way):
    """A file where the tracker's directory under CKPT goes: the W&B run directory, MLflow's artifacts."""
    os.makedirs(tmp_path / "run")
    (tmp_path / "run" / in_the_way).write_text("")
    if writer == "MLflowWriter":
        shutil.copy(empty_mlflow_db, tmp_path / "run" / "mlflow.db")  # skips making the tables; changes nothing else
    with caplog.at_level("INFO", logger="pet.engine.experiment_trackers"):
        trainer = _train(_cfg(make_cfg, {"type": writer}))

    assert trainer.iter == 10 and _metrics_json(trainer.output_dir)["bbox/AP"] == [(5, 0.05), (10, 0.1)]
    (error,) = _tracker_errors(caplog)
    assert error.getMessage().startswith(f"{writer} failed while logging")
    if writer == "MLflowWriter":  # the run was made before its first artifact failed, and it is still ended
        assert _mlflow_run(trainer.output_dir)[1].info.status == "FINISHED"


@pytest.mark.parametrize("writer", ["WandbWriter", "MLflowWriter"])
def test_a_failed_training_ends_the_run_as_failed_with_its_last_state(make_cfg, mlflow_spec, writer):
    """The trainer closes the writers while it handles the error, and writes the last completed step first."""
    cfg = _cfg(make_cfg, mlflow_spec if writer == "MLflowWriter" else {"type": writer})
    with pytest.raises(RuntimeError, match="step failed"):
        _train(cfg, model=FailingModel(fail_at=7))
    expected = _metrics_json(cfg.CKPT)
    assert [i for i, _ in expected["total_loss"]] == [4, 6]

    if writer == "WandbWriter":
        path = _wandb_file(cfg.CKPT)
        records = _wandb_records(path)
        assert _wandb_history(records) == expected
        assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [1]
    else:
        client, run = _mlflow_run(cfg.CKPT, mlflow_spec["tracking_uri"])
        assert _mlflow_history(client, run, _in_mlflow_names(expected)) == _in_mlflow_names(expected)
        assert run.info.status == "FAILED"


@pytest.mark.parametrize("writer, module, extra", [
    ("WandbWriter", "wandb", "wandb"),
    ("MLflowWriter", "mlflow.tracking", "mlflow"),
    ("MLflowWriter", "sqlalchemy", "mlflow"),  # mlflow-skinny alone cannot open the default SQLite store
])
def test_a_missing_tracker_package_is_a_config_error_naming_the_extra(make_cfg, monkeypatch, writer, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like to import
    cfg = _cfg(make_cfg, {"type": writer})
    cfg.TRAIN.SAVE_AS_JSON = False  # no file to open: only the terminal printer is built before it
    with pytest.raises(ConfigError, match=rf"{writer}.*pip install -e \"\.\[{extra}\]\""):
        build_writers(cfg, max_iter=10)


def test_wandb_logs_offline_unless_credentials_or_a_mode_are_found(make_cfg, tmp_path, monkeypatch):
    def mode(**kwargs) -> str | None:
        cfg = _cfg(make_cfg, {"type": "WandbWriter", **kwargs})
        cfg.TRAIN.SAVE_AS_JSON = False
        return build_writers(cfg, max_iter=10)[-1].init_kwargs["mode"]

    assert mode() == "offline"
    assert mode(mode="disabled") == "disabled"
    (tmp_path / "no-netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    assert mode() is None  # W&B decides: online, with the key `wandb login` saved
    (tmp_path / "no-netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert mode() is None  # W&B reads WANDB_MODE itself
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    assert mode() is None
