"""CheckpointHook, BestCheckpointHook and exact resume, on a toy model."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

from pet.checkpoint import load_checkpoint, read_last_checkpoint
from pet.engine.hooks import (
    BestCheckpointHook,
    CheckpointHook,
    EarlyStoppingHook,
    EMAHook,
    EvalHook,
    Priority,
    TrainHook,
)
from pet.engine.metrics import metric_rule
from pet.utils.errors import ConfigError
from support.toys import CrashAt, IndexedToyLoader, hook_of, record_saves, regular_iters, scripted_eval, toy_trainer


# ---------------------------------------------------------------------------------------- CheckpointHook
def test_period_saves_and_last(cfg_for):
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 11, "HOOKS.CHECKPOINT.PERIOD", 2))
    saves = record_saves(trainer)
    trainer.train()
    assert regular_iters(trainer.output_dir) == [2, 4, 6, 8, 10, 11]
    assert [name for name, _ in saves] == [f"model_iter{n}.pth" for n in (2, 4, 6, 8, 10, 11)]
    assert open(os.path.join(trainer.output_dir, "last_checkpoint")).read() == "model_iter11.pth"
    final = os.path.join(trainer.output_dir, "model_final.pth")
    assert load_checkpoint(final)["iter"] == 11
    assert os.path.samefile(final, os.path.join(trainer.output_dir, "model_iter11.pth"))  # a link, no extra disk


def test_max_keep_leaves_the_newest(cfg_for):
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 11, "HOOKS.CHECKPOINT.PERIOD", 1,
                                  "HOOKS.CHECKPOINT.MAX_KEEP", 3))
    trainer.train()
    assert regular_iters(trainer.output_dir) == [9, 10, 11]
    assert hook_of(trainer, CheckpointHook).kept == ["model_iter9.pth", "model_iter10.pth", "model_iter11.pth"]
    assert load_checkpoint(os.path.join(trainer.output_dir, "model_final.pth"))["iter"] == 11


@pytest.mark.parametrize("begin, period, expected", [(5, 2, [5, 7, 9, 11]), (0, 0, [11]), (0, 4, [4, 8, 11])])
def test_save_begin_and_period(cfg_for, begin, period, expected):
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 11, "HOOKS.CHECKPOINT.PERIOD", period,
                                  "HOOKS.CHECKPOINT.SAVE_BEGIN", begin))
    trainer.train()
    assert regular_iters(trainer.output_dir) == expected


def test_last_checkpoint_always_names_a_complete_file(cfg_for):
    seen = []

    class Reader(TrainHook):
        priority = Priority.LOWEST

        def after_step(self, trainer, **kwargs):
            # Listed before read_last_checkpoint, which removes leftover temporary files.
            assert not [f for f in os.listdir(trainer.output_dir) if ".tmp" in f]
            path = read_last_checkpoint(trainer.output_dir)
            seen.append(load_checkpoint(path)["iter"] if path else None)

    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 8, "HOOKS.CHECKPOINT.PERIOD", 3,
                                  "HOOKS.CHECKPOINT.MAX_KEEP", 1), Reader())
    trainer.train()
    assert seen == [None, None, 3, 3, 3, 6, 6, 6]
    assert load_checkpoint(read_last_checkpoint(trainer.output_dir))["iter"] == 8
    assert regular_iters(trainer.output_dir) == [8]


def test_best_checkpoints_only_on_strict_improvement(cfg_for):
    acc = [0.1, 0.3, 0.3, 0.2, 0.5, 0.5, 0.4, 0.6]
    loss = [1.0, 0.8, 0.9, 0.7, 0.7, 0.75, 0.65, 0.65]
    table = {i + 1: {"val/acc": a, "val/loss": b} for i, (a, b) in enumerate(zip(acc, loss))}
    cfg = cfg_for("SOLVER.MAX_ITER", 8, "HOOKS.CHECKPOINT.PERIOD", 0,
                  "HOOKS.CHECKPOINT.SAVE_BEST", "['val/acc', 'val/loss']")
    trainer = toy_trainer(cfg, EvalHook(1, scripted_eval(table)))
    saves = record_saves(trainer)
    trainer.train()
    assert [n for f, n in saves if f == "model_best_val_acc.pth"] == [1, 2, 5, 8]
    assert [n for f, n in saves if f == "model_best_val_loss.pth"] == [1, 2, 4, 7]
    best_files = sorted(f for f in os.listdir(trainer.output_dir) if f.startswith("model_best"))
    assert best_files == ["model_best_val_acc.pth", "model_best_val_loss.pth"]
    best = load_checkpoint(os.path.join(trainer.output_dir, "model_best_val_loss.pth"))
    assert best["best"] == {"metric": "val/loss", "value": 0.65, "iter": 7} and best["iter"] == 7
    hook = hook_of(trainer, BestCheckpointHook)
    assert hook.best == {"val/acc": 0.6, "val/loss": 0.65}
    assert open(os.path.join(trainer.output_dir, "last_checkpoint")).read() == "model_iter8.pth"


def test_save_best_auto_takes_the_first_metric(cfg_for):
    table = {n: {"bbox/AP": n % 3, "bbox/AP50": 1.0} for n in range(1, 7)}
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.SAVE_BEST", "auto"),
                         EvalHook(2, scripted_eval(table)))
    trainer.train()
    hook = hook_of(trainer, BestCheckpointHook)
    assert hook.metrics == ["bbox/AP"] and hook.best == {"bbox/AP": 2.0} and hook.best_iter == {"bbox/AP": 2}
    assert [f for f in os.listdir(trainer.output_dir) if f.startswith("model_best")] == ["model_best_bbox_AP.pth"]


def test_rule_inference_and_its_error():
    assert metric_rule("bbox/AP") == metric_rule("segm/AP50") == metric_rule("bbox/AR@100") == "greater"
    assert metric_rule("val/top1") == metric_rule("accuracy") == metric_rule("mAP") == "greater"
    assert metric_rule("total_loss") == metric_rule("val/loss_cls") == "less"
    assert metric_rule("val/score", "less") == "less"
    with pytest.raises(ConfigError, match="Cannot tell whether a larger or a smaller 'val/score'.*HOOKS.CHECKPOINT"):
        BestCheckpointHook("val/score")
    with pytest.raises(ConfigError, match="HOOKS.EARLY_STOPPING.RULE must be 'greater', 'less'"):
        EarlyStoppingHook(monitor="bbox/AP", rule="bigger")
    assert BestCheckpointHook("val/score", rule="greater").metrics == ["val/score"]


def test_published_keys_write_a_slim_file_named_by_its_hash(cfg_for):
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.PUBLISHED_KEYS", "['model']"))
    trainer.train()
    published = [f for f in os.listdir(trainer.output_dir) if f.startswith("model_final-")]
    assert len(published) == 1
    path = os.path.join(trainer.output_dir, published[0])
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert published[0] == f"model_final-{digest[:8]}.pth"
    slim, final = load_checkpoint(path), load_checkpoint(os.path.join(trainer.output_dir, "model_final.pth"))
    assert set(slim) == {"model"} and {"optimizer", "scheduler", "hooks"} <= set(final)
    assert all(torch.equal(v, final["model"][k]) for k, v in slim["model"].items())


def test_optimizer_and_scheduler_can_be_left_out(cfg_for):
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 2, "HOOKS.CHECKPOINT.SAVE_OPTIMIZER", False,
                                  "HOOKS.CHECKPOINT.SAVE_SCHEDULER", False))
    trainer.train()
    final = load_checkpoint(os.path.join(trainer.output_dir, "model_final.pth"))
    assert "optimizer" not in final and "scheduler" not in final and "model" in final


def test_by_epoch_checkpoints(cfg_for):
    cfg = cfg_for("SOLVER.MAX_EPOCHS", 3, "HOOKS.CHECKPOINT.BY_EPOCH", True, "HOOKS.CHECKPOINT.PERIOD", 2)
    trainer = toy_trainer(cfg, loader=IndexedToyLoader(num_batches=2))
    trainer.train()
    files = sorted(f for f in os.listdir(trainer.output_dir) if f.startswith("model_"))
    assert files == ["model_epoch2.pth", "model_epoch3.pth", "model_final.pth"]
    assert open(os.path.join(trainer.output_dir, "last_checkpoint")).read() == "model_epoch3.pth"
    with pytest.raises(ConfigError, match="BY_EPOCH needs epoch mode"):
        toy_trainer(cfg_for("HOOKS.CHECKPOINT.BY_EPOCH", True)).train()


def test_out_dir_and_resume_from_it(cfg_for, tmp_path):
    out = tmp_path / "elsewhere"
    cfg = cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.PERIOD", 2, "HOOKS.CHECKPOINT.OUT_DIR", str(out))
    trainer = toy_trainer(cfg)
    trainer.train()
    assert regular_iters(out) == [2, 4] and not regular_iters(trainer.output_dir)
    assert read_last_checkpoint(trainer.output_dir) == str(out / "model_iter4.pth")
    cfg = cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.PERIOD", 2, "HOOKS.CHECKPOINT.OUT_DIR", str(out))
    resumed = toy_trainer(cfg)
    resumed.resume_or_load(resume=True)
    assert resumed.start_iter == 4
    resumed.train()
    assert regular_iters(out) == [2, 4, 6]


# ---------------------------------------------------------------------------------------- resume
def _resume_cfg(cfg_for, ckpt):
    return cfg_for(
        "CKPT", ckpt, "SOLVER.MAX_ITER", 12, "SOLVER.WARMUP_ITERS", 3, "SOLVER.OPTIMIZER", "AdamW",
        "HOOKS.CHECKPOINT.PERIOD", 2, "HOOKS.CHECKPOINT.MAX_KEEP", 3, "HOOKS.CHECKPOINT.SAVE_BEST", "val/acc",
        "HOOKS.EMA.ENABLED", True, "HOOKS.EMA.MOMENTUM", 0.3, "HOOKS.EMA.BEGIN_ITER", 3, "HOOKS.EMA.ANNEAL_ITERS", 4,
        "HOOKS.EARLY_STOPPING.ENABLED", True, "HOOKS.EARLY_STOPPING.MONITOR", "val/acc",
        "HOOKS.EARLY_STOPPING.PATIENCE", 100,
    )


_RESUME_TABLE = {3: {"val/acc": 0.2}, 6: {"val/acc": 0.5}, 9: {"val/acc": 0.4}, 12: {"val/acc": 0.6}}


def _lrs(trainer):
    return [v for v, _ in trainer.storage.history("lr").values()]


def test_resume_after_a_crash_ends_bit_identical(cfg_for, tmp_path):
    reference = toy_trainer(_resume_cfg(cfg_for, str(tmp_path / "a")), EvalHook(3, scripted_eval(_RESUME_TABLE)))
    reference.train()

    crashed = toy_trainer(_resume_cfg(cfg_for, str(tmp_path / "b")), EvalHook(3, scripted_eval(_RESUME_TABLE)),
                         CrashAt(7))
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.train()
    assert crashed.iter == 7  # iterations 1-7 ran; the state after 7 was never saved

    loader = IndexedToyLoader()
    calls = []
    resumed = toy_trainer(_resume_cfg(cfg_for, str(tmp_path / "b")),
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
    ref_best, res_best = hook_of(reference, BestCheckpointHook), hook_of(resumed, BestCheckpointHook)
    assert res_best.best == ref_best.best == {"val/acc": 0.6}
    ref_es, res_es = hook_of(reference, EarlyStoppingHook), hook_of(resumed, EarlyStoppingHook)
    assert (res_es.best, res_es.wait) == (ref_es.best, ref_es.wait) == (0.6, 0)
    assert hook_of(resumed, EMAHook).steps == hook_of(reference, EMAHook).steps == 10
    ref_final = load_checkpoint(tmp_path / "a" / "model_final.pth")
    res_final = load_checkpoint(tmp_path / "b" / "model_final.pth")
    for key in ("model", "model_raw"):
        for name, value in ref_final[key].items():
            assert torch.equal(value, res_final[key][name]), (key, name)
    for name, value in hook_of(reference, EMAHook).averaged_state().items():
        assert torch.equal(value, hook_of(resumed, EMAHook).averaged_state()[name])


def test_resume_with_a_larger_max_iter_continues_to_the_new_end(cfg_for):
    first = toy_trainer(cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.PERIOD", 4))
    first.train()
    calls = []
    table = {n: {"val/acc": n / 10} for n in range(1, 11)}
    resumed = toy_trainer(cfg_for("SOLVER.MAX_ITER", 10, "HOOKS.CHECKPOINT.PERIOD", 4),
                         EvalHook(0, scripted_eval(table, calls)))
    resumed.resume_or_load(resume=True)
    resumed.train()
    assert (resumed.start_iter, resumed.iter, calls) == (6, 10, [10])
    assert regular_iters(resumed.output_dir) == [4, 6, 8, 10]
    assert load_checkpoint(os.path.join(resumed.output_dir, "model_final.pth"))["iter"] == 10
    assert resumed.scheduler.last_epoch == 10

    again = toy_trainer(cfg_for("SOLVER.MAX_ITER", 10, "HOOKS.CHECKPOINT.PERIOD", 4),
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
    trainer = toy_trainer(cfg_for("SOLVER.MAX_ITER", 4, "HOOKS.CHECKPOINT.PERIOD", 2), first, second)
    trainer.train()
    hooks_state = load_checkpoint(os.path.join(trainer.output_dir, "model_iter4.pth"))["hooks"]
    assert hooks_state["Tally"] == {"total": 4} and hooks_state["Tally.1"] == {"total": 40}

    first, second = Tally(1), Tally(10)
    second.priority = Priority.HIGH
    resumed = toy_trainer(cfg_for("SOLVER.MAX_ITER", 6, "HOOKS.CHECKPOINT.PERIOD", 2), first, second)
    resumed.resume_or_load(resume=True)
    assert (first.total, second.total) == (4, 40)
    resumed.train()
    assert (first.total, second.total) == (6, 60)


def test_a_checkpoint_with_one_hook_per_class_loads_into_the_first_of_that_class(cfg_for):
    toy_trainer(cfg_for("SOLVER.MAX_ITER", 2, "HOOKS.CHECKPOINT.PERIOD", 2), Tally(1)).train()
    first, second = Tally(1), Tally(10)
    resumed = toy_trainer(cfg_for("SOLVER.MAX_ITER", 4), first, second)
    resumed.resume_or_load(resume=True)
    assert (resumed.start_iter, first.total, second.total) == (2, 2, 0)


