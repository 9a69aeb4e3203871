"""CheckpointHook, resume, EvalHook, EMA, early stopping and the utility hooks, on a toy model."""
from __future__ import annotations

import logging
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from pet.checkpoint import load_checkpoint, load_weights
from pet.config import load_cfg
from pet.engine.build import build_train_hooks
from pet.engine.events import read_metrics
from pet.engine.hooks import (
    HOOKS,
    EarlyStoppingHook,
    EMAHook,
    EvalHook,
    Priority,
    ProfilerHook,
    SyncBuffersHook,
    TrainHook,
)
from pet.engine.hooks import system as system_hooks
from pet.utils.errors import ConfigError
from support.helpers import doc_blocks
from support.processes import run_two_ranks
from support.toys import CrashAt, IndexedToyLoader, ToyLoader, ToyModel, hook_of, scripted_eval, toy_trainer


# ---------------------------------------------------------------------------------------- EvalHook
class ValRecorder(TrainHook):
    def __init__(self):
        self.calls = []

    def before_val(self, trainer, **kwargs):
        self.calls.append(("before_val", trainer.iter))

    def after_val(self, trainer, metrics, **kwargs):
        self.calls.append(("after_val", trainer.iter, dict(metrics)))


@pytest.mark.parametrize("max_iter, period, expected", [(30, 15, [15, 30]), (31, 15, [15, 30, 31]), (20, 0, [20])])
def test_eval_hook_call_counts(cfg_for, max_iter, period, expected):
    calls = []
    table = {n: {"val/acc": n / 100} for n in range(1, max_iter + 1)}
    recorder = ValRecorder()
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", max_iter, "HOOKS.CHECKPOINT.PERIOD", 0),
                         EvalHook(period, scripted_eval(table, calls)), recorder)
    trainer.train()
    assert calls == expected
    assert recorder.calls == [c for n in expected for c in (("before_val", n), ("after_val", n, table[n]))]
    assert [it for _, it in trainer.storage.history("val/acc").values()] == expected
    assert trainer.storage.smoothing_hints()["val/acc"] is False


def test_eval_metrics_reach_writers_and_best_in_the_same_step(make_cfg):
    table = {n: {"bbox/AP": n / 10, "bbox": {"AP50": 0.5}} for n in range(1, 11)}
    trainer = toy_trainer(make_cfg("SOLVER.MAX_ITER", 10, "DISPLAY_ITER", 5, "HOOKS.CHECKPOINT.PERIOD", 0,
                                   "HOOKS.CHECKPOINT.SAVE_BEST", "bbox/AP"), EvalHook(5, scripted_eval(table)))
    trainer.train()
    records = read_metrics(os.path.join(trainer.output_dir, "metrics.json"))
    assert [(r["iteration"], r["bbox/AP"], r["bbox/AP50"]) for r in records] == [(5, 0.5, 0.5), (10, 1.0, 0.5)]
    assert load_checkpoint(os.path.join(trainer.output_dir, "model_best_bbox_AP.pth"))["best"]["iter"] == 10


def test_eval_hook_in_epoch_mode_counts_epochs(cfg_for):
    calls = []
    table = {n: {"val/acc": 0.0} for n in range(1, 11)}
    trainer = toy_trainer(cfg_for("SOLVER.MAX_EPOCHS", 5), EvalHook(2, scripted_eval(table, calls)),
                         loader=IndexedToyLoader(num_batches=2))
    trainer.train()
    assert calls == [4, 8, 10]  # epochs 2, 4 and the last one


def test_eval_hook_validates_a_stopped_run_but_not_a_failed_one(cfg_for):
    calls = []
    table = {n: {"val/acc": 0.0} for n in range(1, 21)}

    class StopAt(TrainHook):
        priority = Priority.LOWEST  # after EvalHook: the validation comes from after_train

        def after_step(self, trainer, **kwargs):
            trainer.stop_training = trainer.iter == 7

    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 20), EvalHook(5, scripted_eval(table, calls)), StopAt())
    trainer.train()
    assert calls == [5, 7] and trainer.iter == 7
    assert load_checkpoint(os.path.join(trainer.output_dir, "model_final.pth"))["iter"] == 7

    calls.clear()
    failed = toy_trainer(cfg_for("SOLVER.MAX_ITER", 20, "CKPT", trainer.output_dir + "_failed"),
                        EvalHook(5, scripted_eval(table, calls)), CrashAt(8))
    with pytest.raises(RuntimeError):
        failed.train()
    assert calls == [5]
    assert not os.path.exists(os.path.join(failed.output_dir, "model_final.pth"))


def test_eval_function_must_return_numbers(cfg_for):
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 1), EvalHook(0, lambda t: {"bbox/AP": "high"}))
    with pytest.raises(Exception, match="Metric 'bbox/AP' is a str"):
        trainer.train()


# ---------------------------------------------------------------------------------------- early stopping
_EPOCH_ACC = [0.5, 0.6, 0.55, 0.6, 0.58, 0.7, 0.5, 0.5]


def _early_stopping_run(cfg_for, patience, **extra):
    table = {2 * (e + 1): {"val/acc": acc} for e, acc in enumerate(_EPOCH_ACC)}
    opts = ["SOLVER.MAX_EPOCHS", 8, "HOOKS.EARLY_STOPPING.ENABLED", True, "HOOKS.EARLY_STOPPING.MONITOR", "val/acc",
            "HOOKS.EARLY_STOPPING.PATIENCE", patience]
    for key, value in extra.items():
        opts += [f"HOOKS.EARLY_STOPPING.{key}", value]
    after_train = []

    class AfterTrain(TrainHook):
        def after_train(self, trainer, **kwargs):
            after_train.append(trainer.iter)

    trainer = toy_trainer(cfg_for(*opts), EvalHook(1, scripted_eval(table)), AfterTrain(),
                         loader=IndexedToyLoader(num_batches=2))
    trainer.train()
    return trainer, after_train


def test_early_stopping_stops_at_the_documented_epoch(cfg_for):
    # Best 0.6 at epoch 2; epochs 3, 4, 5 do not beat it (0.6 is not > 0.6): the 3rd such epoch stops.
    trainer, after_train = _early_stopping_run(cfg_for, patience=3)
    assert trainer.epoch == 5 and trainer.iter == 10 and after_train == [10]
    assert load_checkpoint(os.path.join(trainer.output_dir, "model_final.pth"))["iter"] == 10
    assert hook_of(trainer, EarlyStoppingHook).stop_reason == "patience"


def test_early_stopping_not_with_a_larger_patience(cfg_for):
    trainer, _ = _early_stopping_run(cfg_for, patience=4)  # epoch 6 (0.7) improves in time
    assert trainer.epoch == 8 and trainer.iter == 16
    assert hook_of(trainer, EarlyStoppingHook).best == 0.7


def test_early_stopping_min_delta_and_threshold(cfg_for):
    trainer, _ = _early_stopping_run(cfg_for, patience=2, MIN_DELTA=0.15)  # only 0.7 (+0.2) counts as better
    assert trainer.epoch == 3
    trainer, _ = _early_stopping_run(cfg_for, patience=100, STOPPING_THRESHOLD=0.58)
    assert trainer.epoch == 2


def test_early_stopping_missing_and_nonfinite_metrics(caplog):
    trainer = SimpleNamespace(stop_training=False, iter=3)
    hook = EarlyStoppingHook(monitor="bbox/AP", patience=2)
    with caplog.at_level(logging.WARNING, logger="pet"):
        hook.after_val(trainer=trainer, metrics={"segm/AP": 0.1})
    assert "'bbox/AP' is not among the validation metrics (segm/AP)" in caplog.text and not trainer.stop_training
    with pytest.raises(ConfigError, match="set HOOKS.EARLY_STOPPING.MONITOR"):
        EarlyStoppingHook(monitor="bbox/AP", strict=True).after_val(trainer=trainer, metrics={"segm/AP": 0.1})
    hook.after_val(trainer=trainer, metrics={"bbox/AP": math.nan})
    assert trainer.stop_training and hook.stop_reason == "nonfinite"
    trainer.stop_training = False
    EarlyStoppingHook(monitor="bbox/AP", check_finite=False).after_val(trainer=trainer, metrics={"bbox/AP": math.inf})
    assert not trainer.stop_training


def test_a_resumed_early_stopped_run_stays_stopped_unless_patience_grows(cfg_for):
    trainer, _ = _early_stopping_run(cfg_for, patience=3)
    resumed = toy_trainer(trainer.cfg, EvalHook(1, scripted_eval({})), loader=IndexedToyLoader(num_batches=2))
    resumed.resume_or_load(resume=True)
    resumed.train()
    assert resumed.iter == 10
    cfg = trainer.cfg.clone()
    cfg.defrost()
    cfg.HOOKS.EARLY_STOPPING.PATIENCE = 10
    table = {2 * (e + 1): {"val/acc": acc} for e, acc in enumerate(_EPOCH_ACC)}
    longer = toy_trainer(cfg, EvalHook(1, scripted_eval(table)), loader=IndexedToyLoader(num_batches=2))
    longer.resume_or_load(resume=True)
    longer.train()
    assert longer.iter == 16


# ---------------------------------------------------------------------------------------- EMA
def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_ema_equals_the_weights_before_the_begin_step_and_differs_after(cfg_for):
    same = []
    during_val = []

    class Compare(TrainHook):
        priority = Priority.LOWEST

        def after_step(self, trainer, **kwargs):
            ema = hook_of(trainer, EMAHook).averaged_state()
            same.append(all(torch.equal(ema[n], p) for n, p in _params(trainer).items()))

    def eval_function(trainer):
        ema = hook_of(trainer, EMAHook).averaged_state()
        during_val.append(all(torch.equal(ema[n], p) for n, p in _params(trainer).items()))
        return {"val/acc": 0.0}

    cfg = cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.EMA.ENABLED", True, "HOOKS.EMA.MOMENTUM", 0.5,
                  "HOOKS.EMA.BEGIN_ITER", 3)
    trainer = toy_trainer(cfg, Compare(), EvalHook(4, eval_function))
    trainer.train()
    assert same == [True, True, False, False, False, False]
    assert during_val == [True, True]  # the averaged weights are in the model while validating
    final = load_checkpoint(os.path.join(trainer.output_dir, "model_final.pth"))
    ema = hook_of(trainer, EMAHook).averaged_state()
    for name, param in _params(trainer).items():  # raw weights are back after validation
        assert torch.equal(final["model_raw"][name], param) and torch.equal(final["model"][name], ema[name])
        assert not torch.equal(param, ema[name])
    model = ToyModel()
    load_weights(model, os.path.join(trainer.output_dir, "model_final.pth"))  # what test_net.py does
    assert all(torch.equal(p, ema[n]) for n, p in model.named_parameters())


def test_ema_momentum_anneals_towards_its_value():
    hook = EMAHook(momentum=0.001, anneal_iters=100)
    values = [hook.momentum_at(t) for t in (0, 100, 1000, 10000)]
    assert values[0] > 0.98 and values == sorted(values, reverse=True) and values[-1] == pytest.approx(0.001)
    assert EMAHook(momentum=0.001).momentum_at(0) == 0.001
    with pytest.raises(ConfigError, match="MOMENTUM must be in"):
        EMAHook(momentum=0.0)


def test_ema_begin_epoch(cfg_for):
    same = []

    class Compare(TrainHook):
        priority = Priority.LOWEST

        def after_epoch(self, trainer, **kwargs):
            ema = hook_of(trainer, EMAHook).averaged_state()
            same.append(all(torch.equal(ema[n], p) for n, p in _params(trainer).items()))

    cfg = cfg_for("SOLVER.MAX_EPOCHS", 3, "HOOKS.EMA.ENABLED", True, "HOOKS.EMA.MOMENTUM", 0.5,
                  "HOOKS.EMA.BEGIN_EPOCH", 2)
    toy_trainer(cfg, Compare(), loader=IndexedToyLoader(num_batches=2)).train()
    assert same == [True, False, False]


# ---------------------------------------------------------------------------------------- the rest
def test_default_hook_order(make_cfg):
    cfg = make_cfg("HOOKS.EVAL.PERIOD", 5, "HOOKS.EMA.ENABLED", True, "HOOKS.EARLY_STOPPING.ENABLED", True,
                   "HOOKS.EMPTY_CACHE.ENABLED", True, "HOOKS.PROFILER.ENABLED", True, "HOOKS.PRECISE_BN.ENABLED", True)
    trainer = toy_trainer(cfg)
    assert [type(h).__name__ for h in trainer.hooks] == [
        "ProfilerHook", "IterationTimer", "LRScheduler", "PreciseBN", "EMAHook", "EmptyCacheHook", "EvalHook",
        "EarlyStoppingHook", "PeriodicWriter", "CheckpointHook"]
    assert not any(isinstance(h, SyncBuffersHook) for h in build_train_hooks(cfg, trainer))  # one process
    assert not any(isinstance(h, EvalHook) for h in toy_trainer(make_cfg()).hooks)  # HOOKS.EVAL.PERIOD 0


def test_every_built_in_hook_is_named_hook_but_the_four_pet_users_know():
    """Hook classes end in ``Hook``; IterationTimer, LRScheduler, PeriodicWriter and PreciseBN keep Pet's and
    detectron2's names. Checked over the registry (train and test hooks), so a new hook cannot slip by."""
    import pet.engine.hooks as hooks
    import pet.evaluation  # noqa: F401 - registers its test hook

    bases = (TrainHook, hooks.TestCallback)
    exported = {name for name in hooks.__all__ if isinstance(getattr(hooks, name), type)
                and issubclass(getattr(hooks, name), bases) and getattr(hooks, name) not in bases}
    names = exported | {name for name, _ in HOOKS}
    assert {"CheckpointHook", "TestHook", "VisualizationHook"} <= names
    assert {name for name in names if not name.endswith("Hook")} == {
        "IterationTimer", "LRScheduler", "PeriodicWriter", "PreciseBN"}


def test_profiler_writes_a_table_and_empty_cache_is_harmless_on_cpu(cfg_for, caplog, monkeypatch):
    cfg = cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.PROFILER.ENABLED", True, "HOOKS.PROFILER.START_ITER", 1,
                  "HOOKS.PROFILER.END_ITER", 3, "HOOKS.EMPTY_CACHE.ENABLED", True,
                  "HOOKS.EMPTY_CACHE.AFTER_ITER", True)
    emptied = []
    empty_cache = system_hooks._empty_cuda_cache
    monkeypatch.setattr(system_hooks, "_empty_cuda_cache", lambda: emptied.append(1) or empty_cache())
    trainer = toy_trainer(cfg)
    with caplog.at_level(logging.INFO, logger="pet"):
        trainer.train()
    text = open(os.path.join(trainer.output_dir, "profiler.txt")).read()
    assert text.startswith("Iterations 2-3") and "Self CPU" in text
    cost = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Time spent in hooks"))
    assert "ProfilerHook" in cost and "EmptyCacheHook" in cost
    assert len(emptied) == 4 + 1  # after each iteration (AFTER_ITER) and after the run's one epoch (AFTER_EPOCH)
    with pytest.raises(ConfigError, match="START_ITER < END_ITER"):
        ProfilerHook(5, 5)


def _sync_worker(rank, init_file):
    model = torch.nn.BatchNorm1d(3)
    model.running_mean.fill_(float(rank))
    model.running_var.fill_(1.0 + 2 * rank)
    model.num_batches_tracked.fill_(rank)
    SyncBuffersHook().before_val(trainer=SimpleNamespace(model=model))
    return rank, model.running_mean.tolist(), model.running_var.tolist(), int(model.num_batches_tracked)


@pytest.mark.slow
def test_sync_buffers_averages_float_buffers_across_processes(tmp_path):
    results = run_two_ranks(_sync_worker, tmp_path / "init")
    for rank, mean, var, tracked in results:
        assert mean == [0.5] * 3 and var == [2.0] * 3 and tracked == rank  # integer buffers untouched


def test_toy_loader_still_skips_without_set_start_iter(cfg_for, tmp_path):
    """A loader without set_start_iter has the batches already consumed drawn and dropped on resume: a run
    crashed after 4 iterations (checkpoint at 4) and resumed ends with the weights of an uninterrupted one.
    Its passes are 3 batches long, so the resume starts 1 batch into the second pass."""
    reference = toy_trainer(cfg_for("SOLVER.MAX_ITER", 6, "CKPT", tmp_path / "reference"), loader=ToyLoader(3))
    reference.train()
    cfg = cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.PERIOD", 2)
    with pytest.raises(RuntimeError, match="simulated crash"):
        toy_trainer(cfg, CrashAt(4), loader=ToyLoader(3)).train()
    resumed = toy_trainer(cfg, loader=ToyLoader(3), seed=123)
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == 4
    resumed.train()
    assert resumed.iter == 6
    expected = _params(reference)
    assert all(torch.equal(p, expected[n]) for n, p in _params(resumed).items())


# ---------------------------------------------------------------------------------------- docs
def test_doc_yaml_examples_are_valid_configs(tmp_path, monkeypatch):
    blocks = [b for b in doc_blocks("yaml") if "_BASE_" not in b]  # _BASE_ examples need their file tree
    assert len(blocks) >= 6
    # The plugin head example is the module its YAML example names.
    (plugin,) = [b for b in doc_blocks("python") if "def add_config" in b]
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "__init__.py").write_text("")
    (tmp_path / "my_project" / "heads.py").write_text(plugin)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("my_project", "my_project.heads"):  # another test's my_project may be imported already
        monkeypatch.delitem(sys.modules, name, raising=False)
    for i, block in enumerate(blocks):
        (tmp_path / f"{i}.yaml").write_text(block)
        load_cfg(str(tmp_path / f"{i}.yaml"), ["CKPT", str(tmp_path / "run")])


def test_doc_after_val_hook_example_runs_and_resumes(cfg_for, tmp_path, monkeypatch):
    code = next(b for b in doc_blocks("python") if "class BestMetricLogger" in b)
    (tmp_path / "pet_doc_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pet_doc_example", raising=False)
    spec = next(b for b in doc_blocks("yaml") if "BestMetricLogger" in b)
    (tmp_path / "run.yaml").write_text(spec.replace("my_project.hooks.", "pet_doc_example."))
    table = {n: {"bbox/AP": [0.2, 0.5, 0.3, 0.4][n // 2 - 1]} for n in (2, 4, 6, 8)}
    cfg = load_cfg(str(tmp_path / "run.yaml"), ["CKPT", str(tmp_path / "out"), "DEVICE", "cpu", "HOOKS.EVAL.PERIOD",
                                                0, "SOLVER.MAX_ITER", 8, "TRAIN.SAVE_AS_JSON", False])
    trainer = toy_trainer(cfg, EvalHook(2, scripted_eval(table)))
    trainer.train()
    assert [v for v, _ in trainer.storage.history("best_bbox/AP").values()] == [0.2, 0.5, 0.5, 0.5]
    final = load_checkpoint(os.path.join(trainer.output_dir, "model_final.pth"))
    assert final["hooks"]["BestMetricLogger"] == {"best": 0.5}
