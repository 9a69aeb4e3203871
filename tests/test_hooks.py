"""CheckpointHook, resume, EvalHook, EMA, early stopping and the utility hooks, on a toy model."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import IndexedToyLoader, ToyLoader, ToyModel, run_two_ranks

from pet.config import load_cfg
from pet.engine.checkpoint import read_last_checkpoint
from pet.engine.events import read_metrics
from pet.engine.hooks import (
    CheckpointHook,
    EarlyStoppingHook,
    EMAHook,
    EmptyCacheHook,
    EvalHook,
    Priority,
    ProfilerHook,
    SyncBuffersHook,
    TrainHook,
    build_train_hooks,
    metric_rule,
)
from pet.engine.trainer import Trainer
from pet.utils.errors import ConfigError
from pet.utils.weights import load_weights


def make_trainer(cfg, *hooks, loader=None, seed=0):
    torch.manual_seed(seed)
    trainer = Trainer(cfg, model=ToyModel(), data_loader=loader if loader is not None else IndexedToyLoader())
    trainer.register_hooks(hooks)
    return trainer


def hook_of(trainer, cls):
    return next(h for h in trainer.hooks if isinstance(h, cls))


def regular_iters(directory):
    return sorted(int(f[len("model_iter"):-4]) for f in os.listdir(directory) if f.startswith("model_iter"))


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def scripted_eval(table, calls=None):
    """An eval function returning ``table[iterations completed]`` (a dict of metrics)."""

    def evaluate(trainer):
        if calls is not None:
            calls.append(trainer.completed_iters)
        return table[trainer.completed_iters]

    return evaluate


def record_saves(trainer):
    saves = []
    original = trainer.save_checkpoint

    def spy(filename, **kwargs):
        saves.append((filename, trainer.completed_iters))
        return original(filename, **kwargs)

    trainer.save_checkpoint = spy
    return saves


@pytest.fixture
def cfg_for(make_cfg):
    """Toy config with JSON metrics and curves off (fast); ``cfg_for(KEY, VALUE, ...)``."""
    return lambda *opts: make_cfg("TRAIN.SAVE_AS_JSON", False, "DISPLAY_ITER", 100, *opts)


# ---------------------------------------------------------------------------------------- CheckpointHook
def test_interval_saves_and_last(cfg_for):
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 11, "HOOKS.CHECKPOINT.INTERVAL", 2))
    saves = record_saves(trainer)
    trainer.train()
    assert regular_iters(trainer.output_dir) == [2, 4, 6, 8, 10, 11]
    assert [name for name, _ in saves] == [f"model_iter{n}.pth" for n in (2, 4, 6, 8, 10, 11)]
    assert open(os.path.join(trainer.output_dir, "last_checkpoint")).read() == "model_iter11.pth"
    final = os.path.join(trainer.output_dir, "model_final.pth")
    assert load(final)["iter"] == 11
    assert os.path.samefile(final, os.path.join(trainer.output_dir, "model_iter11.pth"))  # a link, no extra disk


def test_max_keep_leaves_the_newest(cfg_for):
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 11, "HOOKS.CHECKPOINT.INTERVAL", 1,
                                   "HOOKS.CHECKPOINT.MAX_KEEP", 3))
    trainer.train()
    assert regular_iters(trainer.output_dir) == [9, 10, 11]
    assert hook_of(trainer, CheckpointHook).kept == ["model_iter9.pth", "model_iter10.pth", "model_iter11.pth"]
    assert load(os.path.join(trainer.output_dir, "model_final.pth"))["iter"] == 11


@pytest.mark.parametrize("begin, interval, expected", [(5, 2, [5, 7, 9, 11]), (0, 0, [11]), (0, 4, [4, 8, 11])])
def test_save_begin_and_interval(cfg_for, begin, interval, expected):
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 11, "HOOKS.CHECKPOINT.INTERVAL", interval,
                                   "HOOKS.CHECKPOINT.SAVE_BEGIN", begin))
    trainer.train()
    assert regular_iters(trainer.output_dir) == expected


def test_last_checkpoint_always_names_a_complete_file(cfg_for):
    seen = []

    class Reader(TrainHook):
        priority = Priority.LOWEST

        def after_step(self, trainer, **kwargs):
            path = read_last_checkpoint(trainer.output_dir)
            seen.append(load(path)["iter"] if path else None)
            assert not [f for f in os.listdir(trainer.output_dir) if ".tmp" in f]

    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 8, "HOOKS.CHECKPOINT.INTERVAL", 3,
                                   "HOOKS.CHECKPOINT.MAX_KEEP", 1), Reader())
    trainer.train()
    assert seen == [None, None, 3, 3, 3, 6, 6, 6]
    assert load(read_last_checkpoint(trainer.output_dir))["iter"] == 8
    assert regular_iters(trainer.output_dir) == [8]


def test_best_checkpoints_only_on_strict_improvement(cfg_for):
    acc = [0.1, 0.3, 0.3, 0.2, 0.5, 0.5, 0.4, 0.6]
    loss = [1.0, 0.8, 0.9, 0.7, 0.7, 0.75, 0.65, 0.65]
    table = {i + 1: {"val/acc": a, "val/loss": b} for i, (a, b) in enumerate(zip(acc, loss))}
    cfg = cfg_for("SOLVER.MAX_ITER", 8, "HOOKS.CHECKPOINT.INTERVAL", 0,
                  "HOOKS.CHECKPOINT.SAVE_BEST", "['val/acc', 'val/loss']")
    trainer = make_trainer(cfg, EvalHook(1, scripted_eval(table)))
    saves = record_saves(trainer)
    trainer.train()
    assert [n for f, n in saves if f == "model_best_val_acc.pth"] == [1, 2, 5, 8]
    assert [n for f, n in saves if f == "model_best_val_loss.pth"] == [1, 2, 4, 7]
    best_files = sorted(f for f in os.listdir(trainer.output_dir) if f.startswith("model_best"))
    assert best_files == ["model_best_val_acc.pth", "model_best_val_loss.pth"]
    best = load(os.path.join(trainer.output_dir, "model_best_val_loss.pth"))
    assert best["best"] == {"metric": "val/loss", "value": 0.65, "iter": 7} and best["iter"] == 7
    hook = hook_of(trainer, CheckpointHook)
    assert hook.best == {"val/acc": 0.6, "val/loss": 0.65}
    assert open(os.path.join(trainer.output_dir, "last_checkpoint")).read() == "model_iter8.pth"


def test_save_best_auto_takes_the_first_metric(cfg_for):
    table = {n: {"bbox/AP": n % 3, "bbox/AP50": 1.0} for n in range(1, 7)}
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.SAVE_BEST", "auto"),
                           EvalHook(2, scripted_eval(table)))
    trainer.train()
    hook = hook_of(trainer, CheckpointHook)
    assert hook.save_best == ["bbox/AP"] and hook.best == {"bbox/AP": 2.0} and hook.best_iter == {"bbox/AP": 2}
    assert [f for f in os.listdir(trainer.output_dir) if f.startswith("model_best")] == ["model_best_bbox_AP.pth"]


def test_rule_inference_and_its_error():
    assert metric_rule("bbox/AP") == metric_rule("segm/AP50") == metric_rule("bbox/AR@100") == "greater"
    assert metric_rule("val/top1") == metric_rule("accuracy") == metric_rule("mAP") == "greater"
    assert metric_rule("total_loss") == metric_rule("val/loss_cls") == "less"
    assert metric_rule("val/score", "less") == "less"
    with pytest.raises(ConfigError, match="Cannot tell whether a larger or a smaller 'val/score'.*HOOKS.CHECKPOINT"):
        CheckpointHook(save_best="val/score")
    with pytest.raises(ConfigError, match="HOOKS.EARLY_STOPPING.RULE must be 'greater', 'less'"):
        EarlyStoppingHook(monitor="bbox/AP", rule="bigger")
    assert CheckpointHook(save_best="val/score", rule="greater").save_best == ["val/score"]


def test_published_keys_write_a_slim_file_named_by_its_hash(cfg_for):
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.PUBLISHED_KEYS", "['model']"))
    trainer.train()
    published = [f for f in os.listdir(trainer.output_dir) if f.startswith("model_final-")]
    assert len(published) == 1
    path = os.path.join(trainer.output_dir, published[0])
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert published[0] == f"model_final-{digest[:8]}.pth"
    slim, final = load(path), load(os.path.join(trainer.output_dir, "model_final.pth"))
    assert set(slim) == {"model"} and {"optimizer", "scheduler", "hooks"} <= set(final)
    assert all(torch.equal(v, final["model"][k]) for k, v in slim["model"].items())


def test_optimizer_and_scheduler_can_be_left_out(cfg_for):
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 2, "HOOKS.CHECKPOINT.SAVE_OPTIMIZER", False,
                                   "HOOKS.CHECKPOINT.SAVE_SCHEDULER", False))
    trainer.train()
    final = load(os.path.join(trainer.output_dir, "model_final.pth"))
    assert "optimizer" not in final and "scheduler" not in final and "model" in final


def test_by_epoch_checkpoints(cfg_for):
    cfg = cfg_for("SOLVER.MAX_EPOCHS", 3, "HOOKS.CHECKPOINT.BY_EPOCH", True, "HOOKS.CHECKPOINT.INTERVAL", 2)
    trainer = make_trainer(cfg, loader=IndexedToyLoader(num_batches=2))
    trainer.train()
    files = sorted(f for f in os.listdir(trainer.output_dir) if f.startswith("model_"))
    assert files == ["model_epoch2.pth", "model_epoch3.pth", "model_final.pth"]
    assert open(os.path.join(trainer.output_dir, "last_checkpoint")).read() == "model_epoch3.pth"
    with pytest.raises(ConfigError, match="BY_EPOCH needs epoch mode"):
        make_trainer(cfg_for("HOOKS.CHECKPOINT.BY_EPOCH", True)).train()


def test_out_dir_and_resume_from_it(cfg_for, tmp_path):
    out = tmp_path / "elsewhere"
    cfg = cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.INTERVAL", 2, "HOOKS.CHECKPOINT.OUT_DIR", str(out))
    trainer = make_trainer(cfg)
    trainer.train()
    assert regular_iters(out) == [2, 4] and not regular_iters(trainer.output_dir)
    assert read_last_checkpoint(trainer.output_dir) == str(out / "model_iter4.pth")
    cfg = cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.INTERVAL", 2, "HOOKS.CHECKPOINT.OUT_DIR", str(out))
    resumed = make_trainer(cfg)
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == 4
    resumed.train()
    assert regular_iters(out) == [2, 4, 6]


# ---------------------------------------------------------------------------------------- resume
class CrashAt(TrainHook):
    """Raises before iteration ``at`` (0-based), like a process killed there."""

    priority = Priority.HIGHEST

    def __init__(self, at):
        self.at = at

    def before_step(self, trainer, **kwargs):
        if trainer.iter == self.at:
            raise RuntimeError("simulated crash")


def _resume_cfg(cfg_for, ckpt):
    return cfg_for(
        "CKPT", ckpt, "SOLVER.MAX_ITER", 12, "SOLVER.WARMUP_ITERS", 3, "SOLVER.OPTIMIZER", "AdamW",
        "HOOKS.CHECKPOINT.INTERVAL", 2, "HOOKS.CHECKPOINT.MAX_KEEP", 3, "HOOKS.CHECKPOINT.SAVE_BEST", "val/acc",
        "HOOKS.EMA.ENABLED", True, "HOOKS.EMA.MOMENTUM", 0.3, "HOOKS.EMA.BEGIN_ITER", 3, "HOOKS.EMA.ANNEAL_ITERS", 4,
        "HOOKS.EARLY_STOPPING.ENABLED", True, "HOOKS.EARLY_STOPPING.MONITOR", "val/acc",
        "HOOKS.EARLY_STOPPING.PATIENCE", 100,
    )


_RESUME_TABLE = {3: {"val/acc": 0.2}, 6: {"val/acc": 0.5}, 9: {"val/acc": 0.4}, 12: {"val/acc": 0.6}}


def _lrs(trainer):
    return [v for v, _ in trainer.storage.history("lr").values()]


def test_resume_after_a_crash_ends_bit_identical(cfg_for, tmp_path):
    reference = make_trainer(_resume_cfg(cfg_for, str(tmp_path / "a")), EvalHook(3, scripted_eval(_RESUME_TABLE)))
    reference.train()

    crashed = make_trainer(_resume_cfg(cfg_for, str(tmp_path / "b")), EvalHook(3, scripted_eval(_RESUME_TABLE)),
                           CrashAt(7))
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.train()
    assert crashed.iter == 7  # iterations 1-7 ran; the state after 7 was never saved

    loader = IndexedToyLoader()
    calls = []
    resumed = make_trainer(_resume_cfg(cfg_for, str(tmp_path / "b")),
                           EvalHook(3, scripted_eval(_RESUME_TABLE, calls)), loader=loader, seed=123)
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == 6
    resumed.train()

    assert loader.start_iters == [6]  # the loader was told where to continue
    assert calls == [9, 12]
    assert resumed.iter == reference.iter == 12
    assert _lrs(crashed)[:6] + _lrs(resumed) == _lrs(reference)
    ref_ckpt, res_ckpt = hook_of(reference, CheckpointHook), hook_of(resumed, CheckpointHook)
    assert res_ckpt.kept == ref_ckpt.kept == ["model_iter8.pth", "model_iter10.pth", "model_iter12.pth"]
    assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b"))
    assert res_ckpt.best == ref_ckpt.best == {"val/acc": 0.6}
    ref_es, res_es = hook_of(reference, EarlyStoppingHook), hook_of(resumed, EarlyStoppingHook)
    assert (res_es.best, res_es.wait) == (ref_es.best, ref_es.wait) == (0.6, 0)
    assert hook_of(resumed, EMAHook).steps == hook_of(reference, EMAHook).steps == 10
    ref_final, res_final = load(tmp_path / "a" / "model_final.pth"), load(tmp_path / "b" / "model_final.pth")
    for key in ("model", "model_raw"):
        for name, value in ref_final[key].items():
            assert torch.equal(value, res_final[key][name]), (key, name)
    for name, value in hook_of(reference, EMAHook).averaged_state().items():
        assert torch.equal(value, hook_of(resumed, EMAHook).averaged_state()[name])


def test_resume_with_a_larger_max_iter_continues_to_the_new_end(cfg_for):
    first = make_trainer(cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.INTERVAL", 4))
    first.train()
    calls = []
    table = {n: {"val/acc": n / 10} for n in range(1, 11)}
    resumed = make_trainer(cfg_for("SOLVER.MAX_ITER", 10, "HOOKS.CHECKPOINT.INTERVAL", 4),
                           EvalHook(0, scripted_eval(table, calls)))
    resumed.resume_or_load(resume=True)
    resumed.train()
    assert (resumed.start_iter, resumed.iter, calls) == (6, 10, [10])
    assert regular_iters(resumed.output_dir) == [4, 6, 8, 10]
    assert load(os.path.join(resumed.output_dir, "model_final.pth"))["iter"] == 10
    assert resumed.scheduler.last_epoch == 10

    again = make_trainer(cfg_for("SOLVER.MAX_ITER", 10, "HOOKS.CHECKPOINT.INTERVAL", 4),
                         EvalHook(0, scripted_eval(table, calls)))
    again.resume_or_load(resume=True)
    again.train()  # nothing left to do: no step, no validation, no new checkpoint
    assert again.iter == 10 and calls == [10] and regular_iters(again.output_dir) == [4, 6, 8, 10]


class Tally(TrainHook):
    """Adds ``by`` at every step; the total is hook state that must survive a resume."""

    def __init__(self, by):
        self.by = by
        self.total = 0

    def after_step(self, **kwargs):
        self.total += self.by

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = state["total"]


def test_two_hooks_of_one_class_keep_their_own_state_across_a_resume(cfg_for):
    first, second = Tally(1), Tally(10)
    second.priority = Priority.HIGH  # runs before `first` but was registered after it: keys follow registration
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.INTERVAL", 2), first, second)
    trainer.train()
    hooks_state = load(os.path.join(trainer.output_dir, "model_iter4.pth"))["hooks"]
    assert hooks_state["Tally"] == {"total": 4} and hooks_state["Tally.1"] == {"total": 40}

    first, second = Tally(1), Tally(10)
    second.priority = Priority.HIGH
    resumed = make_trainer(cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.INTERVAL", 2), first, second)
    resumed.resume_or_load(resume=True)
    assert (first.total, second.total) == (4, 40)
    resumed.train()
    assert (first.total, second.total) == (6, 60)


def test_a_checkpoint_with_one_hook_per_class_loads_into_the_first_of_that_class(cfg_for):
    make_trainer(cfg_for("SOLVER.MAX_ITER", 2, "HOOKS.CHECKPOINT.INTERVAL", 2), Tally(1)).train()
    first, second = Tally(1), Tally(10)
    resumed = make_trainer(cfg_for("SOLVER.MAX_ITER", 4), first, second)
    resumed.resume_or_load(resume=True)
    assert (resumed.start_iter, first.total, second.total) == (2, 2, 0)


# ---------------------------------------------------------------------------------------- EvalHook
class ValRecorder(TrainHook):
    def __init__(self):
        self.calls = []

    def before_val(self, trainer, **kwargs):
        self.calls.append(("before_val", trainer.completed_iters))

    def after_val(self, trainer, metrics, **kwargs):
        self.calls.append(("after_val", trainer.completed_iters, dict(metrics)))


@pytest.mark.parametrize("max_iter, period, expected", [(30, 15, [15, 30]), (31, 15, [15, 30, 31]), (20, 0, [20])])
def test_eval_hook_call_counts(cfg_for, max_iter, period, expected):
    calls = []
    table = {n: {"val/acc": n / 100} for n in range(1, max_iter + 1)}
    recorder = ValRecorder()
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", max_iter, "HOOKS.CHECKPOINT.INTERVAL", 0),
                           EvalHook(period, scripted_eval(table, calls)), recorder)
    trainer.train()
    assert calls == expected
    assert recorder.calls == [c for n in expected for c in (("before_val", n), ("after_val", n, table[n]))]
    assert [it for _, it in trainer.storage.history("val/acc").values()] == expected
    assert trainer.storage.smoothing_hints()["val/acc"] is False


def test_eval_metrics_reach_writers_and_best_in_the_same_step(make_cfg):
    table = {n: {"bbox/AP": n / 10, "bbox": {"AP50": 0.5}} for n in range(1, 11)}
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 10, "DISPLAY_ITER", 5, "HOOKS.CHECKPOINT.INTERVAL", 0,
                                    "HOOKS.CHECKPOINT.SAVE_BEST", "bbox/AP"), EvalHook(5, scripted_eval(table)))
    trainer.train()
    records = read_metrics(os.path.join(trainer.output_dir, "metrics.json"))
    assert [(r["iteration"], r["bbox/AP"], r["bbox/AP50"]) for r in records] == [(5, 0.5, 0.5), (10, 1.0, 0.5)]
    assert load(os.path.join(trainer.output_dir, "model_best_bbox_AP.pth"))["best"]["iter"] == 10


def test_eval_hook_in_epoch_mode_counts_epochs(cfg_for):
    calls = []
    table = {n: {"val/acc": 0.0} for n in range(1, 11)}
    trainer = make_trainer(cfg_for("SOLVER.MAX_EPOCHS", 5), EvalHook(2, scripted_eval(table, calls)),
                           loader=IndexedToyLoader(num_batches=2))
    trainer.train()
    assert calls == [4, 8, 10]  # epochs 2, 4 and the last one


def test_eval_hook_validates_a_stopped_run_but_not_a_failed_one(cfg_for):
    calls = []
    table = {n: {"val/acc": 0.0} for n in range(1, 21)}

    class StopAt(TrainHook):
        priority = Priority.LOWEST  # after EvalHook: the validation comes from after_train

        def after_step(self, trainer, **kwargs):
            trainer.stop_training = trainer.iter + 1 == 7

    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 20), EvalHook(5, scripted_eval(table, calls)), StopAt())
    trainer.train()
    assert calls == [5, 7] and trainer.iter == 7
    assert load(os.path.join(trainer.output_dir, "model_final.pth"))["iter"] == 7

    calls.clear()
    failed = make_trainer(cfg_for("SOLVER.MAX_ITER", 20, "CKPT", trainer.output_dir + "_failed"),
                          EvalHook(5, scripted_eval(table, calls)), CrashAt(8))
    with pytest.raises(RuntimeError):
        failed.train()
    assert calls == [5]
    assert not os.path.exists(os.path.join(failed.output_dir, "model_final.pth"))


def test_eval_function_must_return_numbers(cfg_for):
    trainer = make_trainer(cfg_for("SOLVER.MAX_ITER", 1), EvalHook(0, lambda t: {"bbox/AP": "high"}))
    with pytest.raises(Exception, match="Metric 'bbox/AP' of the eval function is a str"):
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
            after_train.append(trainer.completed_iters)

    trainer = make_trainer(cfg_for(*opts), EvalHook(1, scripted_eval(table)), AfterTrain(),
                           loader=IndexedToyLoader(num_batches=2))
    trainer.train()
    return trainer, after_train


def test_early_stopping_stops_at_the_documented_epoch(cfg_for):
    # Best 0.6 at epoch 2; epochs 3, 4, 5 do not beat it (0.6 is not > 0.6): the 3rd such epoch stops.
    trainer, after_train = _early_stopping_run(cfg_for, patience=3)
    assert trainer.epoch == 5 and trainer.iter == 10 and after_train == [10]
    assert load(os.path.join(trainer.output_dir, "model_final.pth"))["iter"] == 10
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
    trainer = SimpleNamespace(stop_training=False, completed_iters=3)
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
    resumed = make_trainer(trainer.cfg, EvalHook(1, scripted_eval({})), loader=IndexedToyLoader(num_batches=2))
    resumed.resume_or_load(resume=True)
    resumed.train()
    assert resumed.iter == 10
    cfg = trainer.cfg.clone()
    cfg.defrost()
    cfg.HOOKS.EARLY_STOPPING.PATIENCE = 10
    table = {2 * (e + 1): {"val/acc": acc} for e, acc in enumerate(_EPOCH_ACC)}
    longer = make_trainer(cfg, EvalHook(1, scripted_eval(table)), loader=IndexedToyLoader(num_batches=2))
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
    trainer = make_trainer(cfg, Compare(), EvalHook(4, eval_function))
    trainer.train()
    assert same == [True, True, False, False, False, False]
    assert during_val == [True, True]  # the averaged weights are in the model while validating
    final = load(os.path.join(trainer.output_dir, "model_final.pth"))
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
    make_trainer(cfg, Compare(), loader=IndexedToyLoader(num_batches=2)).train()
    assert same == [True, False, False]


# ---------------------------------------------------------------------------------------- the rest
def test_default_hook_order(make_cfg):
    cfg = make_cfg("TEST.EVAL_PERIOD", 5, "HOOKS.EMA.ENABLED", True, "HOOKS.EARLY_STOPPING.ENABLED", True,
                   "HOOKS.EMPTY_CACHE.ENABLED", True, "HOOKS.PROFILER.ENABLED", True, "TEST.PRECISE_BN.ENABLED", True)
    trainer = make_trainer(cfg)
    assert [type(h).__name__ for h in trainer.hooks] == [
        "ProfilerHook", "IterationTimer", "LRScheduler", "PreciseBN", "EMAHook", "EmptyCacheHook", "EvalHook",
        "EarlyStoppingHook", "PeriodicWriter", "CheckpointHook", "TrainingCurves"]
    assert not any(isinstance(h, SyncBuffersHook) for h in build_train_hooks(cfg, trainer))  # one process
    assert not any(isinstance(h, EvalHook) for h in make_trainer(make_cfg()).hooks)  # EVAL_PERIOD 0


def test_profiler_writes_a_table_and_empty_cache_is_harmless_on_cpu(cfg_for, caplog):
    cfg = cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.PROFILER.ENABLED", True, "HOOKS.PROFILER.START_ITER", 1,
                  "HOOKS.PROFILER.END_ITER", 3, "HOOKS.EMPTY_CACHE.ENABLED", True,
                  "HOOKS.EMPTY_CACHE.AFTER_ITER", True)
    trainer = make_trainer(cfg)
    with caplog.at_level(logging.INFO, logger="pet"):
        trainer.train()
    text = open(os.path.join(trainer.output_dir, "profiler.txt")).read()
    assert text.startswith("Iterations [1, 3)") and "Self CPU" in text
    cost = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Time spent in hooks"))
    assert "ProfilerHook" in cost and "EmptyCacheHook" in cost
    assert isinstance(hook_of(trainer, EmptyCacheHook), EmptyCacheHook)
    with pytest.raises(ConfigError, match="START_ITER < END_ITER"):
        ProfilerHook(5, 5)


def _sync_worker(rank, init_file, queue):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = torch.nn.BatchNorm1d(3)
    model.running_mean.fill_(float(rank))
    model.running_var.fill_(1.0 + 2 * rank)
    model.num_batches_tracked.fill_(rank)
    SyncBuffersHook().before_val(trainer=SimpleNamespace(model=model))
    queue.put((rank, model.running_mean.tolist(), model.running_var.tolist(), int(model.num_batches_tracked)))
    dist.destroy_process_group()


def test_sync_buffers_averages_float_buffers_across_processes(tmp_path):
    results = run_two_ranks(_sync_worker, tmp_path / "init", timeout=60)
    for rank, mean, var, tracked in results:
        assert mean == [0.5] * 3 and var == [2.0] * 3 and tracked == rank  # integer buffers untouched


def test_toy_loader_still_skips_without_set_start_iter(cfg_for):
    # A loader without set_start_iter has its first batches drawn and dropped on resume.
    first = make_trainer(cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.INTERVAL", 2), loader=ToyLoader(20))
    first.train()
    resumed = make_trainer(cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.INTERVAL", 2), loader=ToyLoader(20))
    resumed.resume_or_load(resume=True)
    resumed.train()
    assert resumed.iter == 6


# ---------------------------------------------------------------------------------------- README
DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def _doc_blocks(language):
    with open(DOC, encoding="utf-8") as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), flags=re.S)


def test_doc_yaml_examples_are_valid_configs(tmp_path):
    blocks = [b for b in _doc_blocks("yaml") if "_BASE_" not in b]  # _BASE_ examples need their file tree
    assert len(blocks) >= 6
    for i, block in enumerate(blocks):
        (tmp_path / f"{i}.yaml").write_text(block)
        load_cfg(str(tmp_path / f"{i}.yaml"), ["CKPT", str(tmp_path / "run")])


def test_doc_after_val_hook_example_runs_and_resumes(cfg_for, tmp_path, monkeypatch):
    code = next(b for b in _doc_blocks("python") if "class BestMetricLogger" in b)
    (tmp_path / "pet_doc_example.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pet_doc_example", raising=False)
    spec = next(b for b in _doc_blocks("yaml") if "BestMetricLogger" in b)
    (tmp_path / "run.yaml").write_text(spec.replace("my_project.hooks.", "pet_doc_example."))
    table = {n: {"bbox/AP": [0.2, 0.5, 0.3, 0.4][n // 2 - 1]} for n in (2, 4, 6, 8)}
    cfg = load_cfg(str(tmp_path / "run.yaml"), ["CKPT", str(tmp_path / "out"), "DEVICE", "cpu", "TEST.EVAL_PERIOD",
                                                0, "SOLVER.MAX_ITER", 8, "TRAIN.SAVE_AS_JSON", False])
    trainer = make_trainer(cfg, EvalHook(2, scripted_eval(table)))
    trainer.train()
    assert [v for v, _ in trainer.storage.history("best_bbox/AP").values()] == [0.2, 0.5, 0.5, 0.5]
    assert load(os.path.join(trainer.output_dir, "model_final.pth"))["hooks"]["BestMetricLogger"] == {"best": 0.5}
