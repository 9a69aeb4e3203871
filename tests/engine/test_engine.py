"""The train loop and the Pet four hooks, on a toy model (no detector, no data set)."""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import time

import pytest
import torch

from pet.engine.events import EventStorage, EventWriter, read_metrics
from pet.engine.hooks import (
    MOUNT_POINTS,
    HookList,
    IterationTimer,
    LRScheduler,
    PeriodicWriter,
    PreciseBN,
    Priority,
    TrainHook,
    get_priority,
)
from pet.engine.loops import EpochLoop, IterationLoop
from pet.engine.trainer import Trainer
from pet.utils.errors import ConfigError
from support.toys import FakeClock, InfiniteToyLoader, ToyLoader, ToyModel


def make_trainer(cfg, default_hooks=True, loader=None, model=None):
    torch.manual_seed(0)
    return Trainer(cfg, model=model or ToyModel(), data_loader=loader or InfiniteToyLoader(),
                   default_hooks=default_hooks)


class Recorder(TrainHook):
    """Records (name, point, kwargs names) of every call."""

    def __init__(self, name, log, priority=None):
        self.name = name
        self.log = log
        if priority is not None:
            self.priority = priority

    def __repr__(self):
        return self.name


for _point in MOUNT_POINTS:
    def _make(point):
        def method(self, **kwargs):
            self.log.append((self.name, point, tuple(sorted(kwargs)), kwargs.get("epoch")))
        return method
    setattr(Recorder, _point, _make(_point))


def test_priority_values_and_lookup():
    assert get_priority("very_high") == 10
    assert get_priority(Priority.LOWEST) == 100
    assert get_priority(42) == 42
    with pytest.raises(ConfigError, match="Unknown hook priority"):
        get_priority("URGENT")
    with pytest.raises(ConfigError, match="between 0 and 100"):
        get_priority(101)


def test_hooks_run_by_priority_with_fifo_ties(make_cfg):
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 1), default_hooks=False)
    log = []
    trainer.register_hooks([
        Recorder("normal_a", log),
        Recorder("low", log, Priority.LOW),
        Recorder("normal_b", log),
        Recorder("highest", log, "HIGHEST"),
    ])
    trainer.register_hook(Recorder("override", log, Priority.LOWEST), priority="VERY_HIGH")
    trainer.register_hook(Recorder("normal_c", log))
    trainer.train()
    order = [name for name, point, _, _ in log if point == "before_step"]
    assert order == ["highest", "override", "normal_a", "normal_b", "normal_c", "low"]


def test_mount_points_and_kwargs_iteration_mode(make_cfg):
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 3), default_hooks=False)
    log = []
    trainer.register_hook(Recorder("r", log))
    trainer.train()
    points = [point for _, point, _, _ in log]
    assert points == ["before_train", "before_epoch"] + ["before_step", "after_step"] * 3 + [
        "after_epoch", "after_train"]
    assert all(kwargs == ("storage", "trainer") for _, _, kwargs, _ in log)
    assert trainer.iter == 3


def test_mount_points_and_kwargs_epoch_mode(make_cfg):
    cfg = make_cfg("SOLVER.MAX_EPOCHS", 2)
    trainer = make_trainer(cfg, default_hooks=False, loader=ToyLoader(num_batches=3))
    log = []
    trainer.register_hook(Recorder("r", log))
    trainer.train()
    assert trainer.max_iter == 6
    epochs = [(point, epoch) for _, point, _, epoch in log if point.endswith("epoch")]
    assert epochs == [("before_epoch", 0), ("after_epoch", 0), ("before_epoch", 1), ("after_epoch", 1)]
    assert sum(1 for _, point, _, _ in log if point == "after_step") == 6
    assert all(kwargs == ("epoch", "max_epochs", "storage", "trainer") for _, _, kwargs, _ in log)


def test_one_iteration_goes_one_way_trainer_then_loop_then_hooks(make_cfg):
    """Trainer.train hands the run to its loop, which steps and calls the hooks: no frame between the hook and
    Trainer.train is the trainer's (the loop does not call back into it), in both modes."""

    class Trace(TrainHook):
        def __init__(self):
            self.frames = {}

        def _record(self, point):
            stack = [(os.path.basename(f.filename), f.function) for f in inspect.stack()[2:]]
            self.frames.setdefault(point, stack[:stack.index(("trainer.py", "train")) + 1])

        def before_step(self, **kwargs):
            self._record("before_step")

        def after_step(self, **kwargs):
            self._record("after_step")

    for opts in (("SOLVER.MAX_ITER", 2), ("SOLVER.MAX_EPOCHS", 1)):
        trace = Trace()
        trainer = make_trainer(make_cfg(*opts), default_hooks=False, loader=ToyLoader(2))
        trainer.register_hook(trace)
        trainer.train()
        for point in ("before_step", "after_step"):
            assert trace.frames[point] == [("base.py", "__call__"), ("loops.py", "call_hooks"),
                                           ("loops.py", "_run_step"), ("loops.py", "_run_steps"),
                                           ("loops.py", "_run_epochs"), ("loops.py", "run"),
                                           ("trainer.py", "train")], (opts, point)


def test_after_train_runs_when_a_step_fails(make_cfg):
    trainer = make_trainer(make_cfg(), default_hooks=False)
    log = []

    class Boom(TrainHook):
        def after_step(self, trainer, **kwargs):
            if trainer.iter == 3:
                raise RuntimeError("boom")

    trainer.register_hooks([Boom(), Recorder("r", log)])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert log[-1][1] == "after_train"


def test_stop_training_flag_ends_the_run(make_cfg):
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 50), default_hooks=False)

    class StopAt(TrainHook):
        def after_step(self, trainer, **kwargs):
            if trainer.iter == 7:
                trainer.stop_training = True

    trainer.register_hook(StopAt())
    trainer.train()
    assert trainer.iter == 7


def test_periodic_writer_iterations(make_cfg, tmp_path):
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 50, "DISPLAY_ITER", 20))
    trainer.train()
    records = read_metrics(os.path.join(trainer.output_dir, "metrics.json"))
    assert [r["iteration"] for r in records] == [20, 40, 50]
    assert {"total_loss", "loss_mse", "loss_l1", "lr", "time", "data_time"} <= set(records[-1])


class CountingWriter(EventWriter):
    def __init__(self):
        self.iterations = []
        self.closed = False

    def write(self, storage, **kwargs):
        self.iterations.append(storage.iter)

    def close(self):
        self.closed = True


def test_periodic_writer_closes_writers_and_writes_last_state_on_early_stop(make_cfg):
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 50), default_hooks=False)
    writer = CountingWriter()
    trainer.register_hook(PeriodicWriter([writer], period=20))

    class StopAt(TrainHook):
        def after_step(self, trainer, **kwargs):
            trainer.stop_training = trainer.iter == 25

    trainer.register_hook(StopAt())
    trainer.train()
    assert writer.iterations == [20, 25]
    assert writer.closed


def test_iteration_timer_excludes_warmup_and_hook_time(make_cfg, caplog, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)  # the trainer's and the hooks' time source

    class SlowHook(TrainHook):
        def after_step(self, **kwargs):
            clock.advance(50.0)

    class SlowModel(ToyModel):
        def forward(self, x, y):
            clock.advance(10.0)
            return super().forward(x, y)

    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 8), default_hooks=False, model=SlowModel())
    trainer.register_hooks([IterationTimer(warmup_iter=3), SlowHook()])
    with caplog.at_level(logging.INFO, logger="pet"):
        trainer.train()
    times = [value for value, _ in trainer.storage.history("time").values()]
    assert times == [10.0] * 5  # 8 steps minus 3 warm-up; the 50 s hook is not in the step time
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "Overall training speed: 5 iterations in 0:00:50 (10.0000 s / it)" in messages
    assert "Total training time: 0:08:00 (0:06:40 on hooks)" in messages  # 8 x (10 + 50) s, 8 x 50 s of it in hooks


def test_lr_scheduler_logs_then_steps(make_cfg):
    cfg = make_cfg("SOLVER.MAX_ITER", 10, "SOLVER.LR_POLICY", "step", "SOLVER.STEPS", "(4, 8)",
                   "SOLVER.GAMMA", 0.1, "SOLVER.BASE_LR", 1.0)
    trainer = make_trainer(cfg, default_hooks=False)
    trainer.register_hook(LRScheduler())
    trainer.train()
    lrs = [round(v, 6) for v, _ in trainer.storage.history("lr").values()]
    assert lrs == [1.0] * 4 + [0.1] * 4 + [0.01] * 2
    assert not trainer.storage.smoothing_hints()["lr"]


def test_flat_cosine_holds_the_rate_then_decays_to_its_end_factor(make_cfg):
    cfg = make_cfg("SOLVER.MAX_ITER", 10, "SOLVER.LR_POLICY", "flat_cosine", "SOLVER.FLAT_ITERS", 6,
                   "SOLVER.COSINE_END_FACTOR", 0.5, "SOLVER.BASE_LR", 1.0)
    trainer = make_trainer(cfg, default_hooks=False)
    trainer.register_hook(LRScheduler())
    trainer.train()
    lrs = [round(v, 6) for v, _ in trainer.storage.history("lr").values()]
    # Iterations 0-6 at the full rate, then half a cosine over the last 4 from 1.0 towards 0.5.
    expected = [0.5 + 0.25 * (1 + math.cos(math.pi * k / 4)) for k in range(1, 4)]
    assert lrs == [1.0] * 7 + [round(v, 6) for v in expected]


def test_warmup_rises_linearly(make_cfg):
    cfg = make_cfg("SOLVER.MAX_ITER", 10, "SOLVER.WARMUP_ITERS", 4, "SOLVER.WARMUP_FACTOR", 0.2,
                   "SOLVER.LR_POLICY", "step", "SOLVER.STEPS", "()", "SOLVER.BASE_LR", 1.0)
    trainer = make_trainer(cfg, default_hooks=False)
    trainer.register_hook(LRScheduler())
    trainer.train()
    lrs = [round(v, 6) for v, _ in trainer.storage.history("lr").values()]
    assert lrs[:5] == [0.2, 0.4, 0.6, 0.8, 1.0]


@pytest.mark.numeric
def test_precise_bn_recomputes_population_statistics(make_cfg):
    model = ToyModel(with_bn=True)
    loader = ToyLoader(num_batches=4, batch_size=64, offset=5.0)
    cfg = make_cfg("SOLVER.MAX_ITER", 2, "SOLVER.BASE_LR", 1e-6)
    trainer = make_trainer(cfg, default_hooks=False, loader=InfiniteToyLoader(offset=5.0), model=model)
    trainer.register_hook(PreciseBN(period=0, num_iter=4, data_loader_fn=lambda: loader))
    trainer.train()
    data = torch.cat([x for x, _ in loader])
    torch.testing.assert_close(model.bn.running_mean, data.mean(dim=0), rtol=0, atol=1e-4)
    # Per-batch unbiased variances make it differ from the pooled variance by ~1/64 at most;
    # the momentum-0.1 running average after 2 steps would still be ~80% the initial 1.0.
    torch.testing.assert_close(model.bn.running_var, data.var(dim=0), rtol=2e-2, atol=0)


def test_precise_bn_disables_itself_without_bn(make_cfg, caplog):
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 2), default_hooks=False)
    trainer.register_hook(PreciseBN(num_iter=2))
    with caplog.at_level(logging.INFO, logger="pet"):
        trainer.train()
    assert any("PreciseBN is disabled" in r.getMessage() for r in caplog.records)


def test_event_storage_smoothing_and_history():
    with EventStorage() as storage:
        for i, value in enumerate([1.0, 100.0, 2.0, 3.0, 4.0]):
            storage.iter = i + 1
            storage.put_scalar("loss", value)
            storage.put_scalar("lr", value, smoothing_hint=False)
        smoothed = storage.latest_with_smoothing_hint(window_size=3)
        assert smoothed["loss"] == (3.0, 5)  # median of 2, 3, 4
        assert smoothed["lr"] == (4.0, 5)
        assert storage.history("loss").global_avg() == pytest.approx(22.0)
        with pytest.raises(ValueError, match="smoothing_hint"):
            storage.put_scalar("lr", 1.0)


def test_custom_writer_and_hook_from_yaml(tmp_path, monkeypatch):
    plugin = tmp_path / "my_plugins.py"
    plugin.write_text(
        "import csv, os\n"
        "from pet.engine.events import EventWriter\n"
        "from pet.engine.hooks import TrainHook\n"
        "class CSVWriter(EventWriter):\n"
        "    def __init__(self, filename, output_dir):\n"
        "        self.path = os.path.join(output_dir, filename)\n"
        "    def write(self, storage, **kwargs):\n"
        "        with open(self.path, 'a') as f:\n"
        "            f.write(f\"{storage.iter},{storage.latest()['total_loss'][0]}\\n\")\n"
        "class StepCounter(TrainHook):\n"
        "    calls = 0\n"
        "    def __init__(self, tag):\n"
        "        self.tag = tag\n"
        "    def after_step(self, storage, **kwargs):\n"
        "        type(self).calls += 1\n"
        "        storage.put_scalar('counter_' + self.tag, type(self).calls, smoothing_hint=False)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg_file = tmp_path / "custom.yaml"
    cfg_file.write_text(
        "TRAIN:\n"
        "  WRITERS:\n"
        "    - {type: my_plugins.CSVWriter, filename: losses.csv}\n"
        "HOOKS:\n"
        "  CUSTOM:\n"
        "    - {type: my_plugins.StepCounter, priority: HIGHEST, tag: a}\n"
        "SOLVER:\n"
        "  MAX_ITER: 10\n"
    )
    from pet.config import load_cfg

    cfg = load_cfg(str(cfg_file), ["CKPT", str(tmp_path / "run"), "DEVICE", "cpu", "DISPLAY_ITER", "5",
                                   "TRAIN.AUTO_RESUME", "False"])
    trainer = make_trainer(cfg)
    hook = next(h for h in trainer.hooks if type(h).__name__ == "StepCounter")
    assert hook.priority == 0 and trainer.hooks[0] is hook
    trainer.train()
    rows = (tmp_path / "run" / "losses.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in rows] == ["5", "10"]
    records = read_metrics(str(tmp_path / "run" / "metrics.json"))
    assert records[-1]["counter_a"] == 10


def test_unknown_hook_type_is_a_clear_error(make_cfg):
    cfg = make_cfg(freeze=False)
    cfg.HOOKS.CUSTOM = [{"type": "CheckpointHoook"}]
    with pytest.raises(ConfigError, match="Unknown hook 'CheckpointHoook'.*Did you mean 'CheckpointHook'"):
        make_trainer(cfg)


def test_hook_cost_table_is_logged(make_cfg, caplog):
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 5))
    with caplog.at_level(logging.INFO, logger="pet"):
        trainer.train()
    table = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Time spent in hooks"))
    row = next(line for line in table.splitlines() if "LRScheduler" in line and "after_step" in line)
    assert row.split("|")[3].strip() == "5"  # calls


def test_hook_cost_excludes_the_nested_dispatches_a_hook_triggers(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)

    class Validating(TrainHook):  # like EvalHook: its after_step calls before_val on every hook
        def after_step(self, dispatch, **kwargs):
            clock.advance(0.03)
            dispatch("before_val", dispatch=dispatch)

    class Slow(TrainHook):
        def before_val(self, **kwargs):
            clock.advance(0.2)

    outer, inner = Validating(), Slow()
    dispatch = HookList([outer, inner])
    dispatch("after_step", dispatch=dispatch)
    costs = {(hook, point): (calls, seconds) for hook, point, calls, seconds in dispatch.costs()}
    # Each hook is charged its own time only: the 0.2 s of the nested before_val is not Validating's.
    assert costs == {(outer, "after_step"): (1, pytest.approx(0.03)), (inner, "before_val"): (1, pytest.approx(0.2))}
    assert dispatch.total_seconds() == pytest.approx(0.23)  # each second counted once
    rows = {cells[1]: cells[2:] for cells in ([c.strip() for c in line.split("|")]
                                              for line in dispatch.cost_table().splitlines()[2:])}
    assert rows == {"Validating": ["after_step", "1", "30.0", "30.000", ""],
                    "Slow": ["before_val", "1", "200.0", "200.000", ""]}


def test_metrics_json_iteration_counts_completed_iterations(make_cfg):
    trainer = make_trainer(make_cfg("SOLVER.MAX_ITER", 5, "DISPLAY_ITER", 1))
    trainer.train()
    with open(os.path.join(trainer.output_dir, "metrics.json")) as f:
        iterations = [json.loads(line)["iteration"] for line in f]
    assert iterations == [1, 2, 3, 4, 5]


def test_one_rule_for_periods_in_either_unit_and_from_any_start():
    """TrainLoop.ends_period is what every hook asks: in the mode's unit by default, in iterations or epochs when
    the hook counts those (PeriodicWriter, CheckpointHook BY_EPOCH), from a first period's end (SAVE_BEGIN)."""
    epochs = EpochLoop([0] * 4, accum_steps=1, max_epochs=6)  # 4 iterations per epoch
    assert [i for i in range(1, 25) if epochs.ends_period(i, 2)] == [8, 16, 24]
    assert [i for i in range(1, 13) if epochs.ends_period(i, 5, "iter")] == [5, 10]
    assert [i for i in range(1, 25) if epochs.ends_period(i, 2, "epoch", start=1)] == [4, 12, 20]
    assert (epochs.completed(12), epochs.completed(13, "iter")) == (3, 13)
    iterations = IterationLoop([0], accum_steps=1, max_iter=10)
    assert [i for i in range(1, 11) if iterations.ends_period(i, 3, start=2)] == [2, 5, 8]
    assert not any(iterations.ends_period(i, 0) for i in range(1, 11))
    with pytest.raises(ConfigError, match="epoch mode"):
        iterations.ends_period(4, 1, "epoch")
