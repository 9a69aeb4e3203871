"""TestHook timers and the inference loop, with a model whose costs are known steps of a fake clock."""
from __future__ import annotations

import logging
import re
import time

import pytest
import torch

from pet.engine.hooks import TestHook
from pet.engine.inference import inference_on_dataset
from pet.utils.timers import activate, timed
from support.toys import FakeClock

# What each stage costs, in seconds of the fake clock: any values work, the timers must report them exactly.
DATA_S, INFER_S, POST_S, RPN_S = 0.004, 0.012, 0.006, 0.003


class SleepyLoader:
    """Yields ``num_batches`` batches, taking DATA_S of ``clock`` before each (no clock: no time)."""

    def __init__(self, num_batches: int, batch_size: int = 2, clock: FakeClock | None = None) -> None:
        self.num_batches = num_batches
        self.batch_size = batch_size
        self.dataset = list(range(num_batches * batch_size))
        self.clock = clock or FakeClock()

    def __iter__(self):
        self.started = self.clock()
        for i in range(self.num_batches):
            self.clock.advance(DATA_S)
            yield (torch.full((self.batch_size, 1), float(i)),)


class SleepyModel(torch.nn.Module):
    """Takes INFER_S of ``clock`` per batch, RPN_S of it inside ``timed("rpn")``."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.clock = clock or FakeClock()

    def forward(self, x):
        with timed("rpn"):
            self.clock.advance(RPN_S)
        self.clock.advance(INFER_S - RPN_S)
        return x * self.weight


class SleepyEvaluator:
    """Takes POST_S of ``clock`` per batch."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.seen = []
        self.predictions = self.seen
        self.clock = clock or FakeClock()

    def reset(self):
        self.seen.clear()

    def process(self, inputs, outputs):
        self.clock.advance(POST_S)
        self.seen.append(outputs)

    def evaluate(self):
        self.called = self.clock()
        return {"bbox": {"AP": 50.0}}


def _timed_run(num_batches: int, batch_size: int = 2, **hook_kwargs):
    """A hook, loader, model and evaluator sharing one fake clock: each stage costs exactly its constant."""
    clock = FakeClock(start=100.0)
    hook = TestHook(clock=clock, **hook_kwargs)
    return (hook, SleepyLoader(num_batches, batch_size, clock), SleepyModel(clock), SleepyEvaluator(clock))


def test_reported_split_matches_what_each_stage_took_and_the_whole_loop():
    hook, loader, model, evaluator = _timed_run(20, num_warmup=0, logperiod=5)
    metrics = inference_on_dataset(model, loader, evaluator, hook)
    loop = evaluator.called - loader.started  # the inference loop, from its first batch to evaluation
    assert metrics == {"bbox": {"AP": 50.0}}
    summary = hook.speed_summary()
    per_image = {name: summary[name]["mean_ms"] / 1000 for name in ("data", "infer", "post", "rpn", "iter")}
    # Each stage is charged exactly its own cost, per image (batches of 2): nothing leaks between timers.
    assert per_image == pytest.approx({"data": DATA_S / 2, "infer": INFER_S / 2, "post": POST_S / 2,
                                       "rpn": RPN_S / 2, "iter": (DATA_S + INFER_S + POST_S) / 2})
    assert per_image["iter"] * 40 == pytest.approx(loop)  # iter time x images accounts for the whole loop
    assert summary["ims_per_batch"] == 2 and summary["timed_iters"] == 20
    assert summary["images_per_second"] == pytest.approx(2 / (DATA_S + INFER_S + POST_S))


def test_warmup_iterations_are_excluded_from_every_timer():
    hook = TestHook(num_warmup=3)  # the real clock
    assert hook.clock is time.perf_counter
    inference_on_dataset(SleepyModel(), SleepyLoader(num_batches=8), SleepyEvaluator(), hook)
    assert {name: len(t.durations) for name, t in hook.timers.items()} == {
        "iter": 5, "data": 5, "infer": 5, "post": 5, "rpn": 5}
    # On any machine: the stages of an iteration happen inside it, so they never add up to more than it.
    stages = zip(*(hook.timers[name].durations for name in ("iter", "data", "infer", "post")))
    assert all(0 < data + infer + post <= total for total, data, infer, post in stages)


def test_tic_toc_shortcuts_reset_and_custom_timers():
    clock = FakeClock()
    hook = TestHook(num_warmup=0, clock=clock)
    hook.add_timer("nms")
    hook.nms_tic()
    clock.advance(0.002)
    assert hook.nms_toc() == pytest.approx(0.002)
    assert len(hook.timers["nms"].durations) == 1
    hook.reset_timer("nms")
    assert hook.timers["nms"].durations == []
    hook.iter_tic()
    hook.iter_toc()
    hook.reset_timer()
    assert hook.num_iters_done == 0 and all(not t.durations for t in hook.timers.values())
    with pytest.raises(AttributeError):
        hook.not_a_timer_method()  # noqa: B018


class FastModel(SleepyModel):
    """SleepyModel without user timers."""

    def forward(self, x):
        return x * self.weight


def _testing_lines(caplog, model_class):
    hook, loader, model, evaluator = _timed_run(4, batch_size=1, num_warmup=0, logperiod=2)
    with caplog.at_level(logging.INFO, logger="pet"):
        inference_on_dataset(model_class(model.clock), loader, evaluator, hook)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("[Testing]")]


_SECONDS = r"\d+\.\d{3}s"
_ETA = r"\[eta: \d+:\d\d:\d\d\]"


def test_log_stats_line_format_shows_extra_timers(caplog):
    lines = _testing_lines(caplog, SleepyModel)  # times "rpn" from inside the model
    assert len(lines) == 2
    for i, line in enumerate(lines, 1):
        assert re.fullmatch(rf"\[Testing\]\[range:1-4 of 4\]\[{2 * i}/4\]"
                            rf"\[{_SECONDS} = {_SECONDS} \+ {_SECONDS} \+ {_SECONDS}\]\[rpn: {_SECONDS}\]{_ETA}",
                            line), line
    # Per image (batch 1), with 3 decimals; the ETA is the 2 images left at 22 ms each.
    total = DATA_S + INFER_S + POST_S
    assert lines[0].endswith(f"[{total:.3f}s = {DATA_S:.3f}s + {INFER_S:.3f}s + {POST_S:.3f}s]"
                             f"[rpn: {RPN_S:.3f}s][eta: 0:00:00]"), lines[0]


def test_log_stats_line_without_extra_timers_has_only_the_default_split(caplog):
    lines = _testing_lines(caplog, FastModel)
    assert len(lines) == 2
    assert re.fullmatch(rf"\[Testing\]\[range:1-4 of 4\]\[4/4\]\[{_SECONDS} = {_SECONDS} \+ {_SECONDS} \+ "
                        rf"{_SECONDS}\]{_ETA}", lines[-1]), lines[-1]


class FakeOwner:
    """Records the calls ``timed`` makes on the active timer owner."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def wait(self) -> None:
        self.calls.append("wait")

    def tic(self, name: str) -> None:
        self.calls.append(f"tic {name}")

    def toc(self, name: str) -> None:
        self.calls.append(f"toc {name}")


def test_timed_waits_for_the_device_before_tic_and_before_toc():
    calls: list[str] = []
    with activate(FakeOwner(calls)):
        with timed("rpn"):
            calls.append("body")
        with pytest.raises(ValueError), timed("roi_heads"):  # a failing block still stops its timer
            calls.append("body")
            raise ValueError
    assert calls == ["wait", "tic rpn", "body", "wait", "toc rpn",
                     "wait", "tic roi_heads", "body", "wait", "toc roi_heads"]
    with timed("rpn"):  # no active owner: nothing to call
        pass
    assert len(calls) == 10


def test_wait_synchronises_only_for_a_cuda_model(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(True))
    hook = TestHook()
    inference_on_dataset(FastModel(), SleepyLoader(num_batches=2), SleepyEvaluator(), hook)
    hook.wait()
    assert not hook.cuda_sync and synced == []
    hook.cuda_sync = True  # what inference_on_dataset sets for a model on CUDA
    hook.wait()
    assert synced == [True]


def test_callbacks_receive_inputs_outputs_results_and_metrics():
    calls = []

    class DumpHook(TestHook):
        def before_test(self, model, data_loader, **kwargs):
            calls.append(("before_test", len(data_loader.dataset)))

        def after_test_iter(self, inputs, outputs, **kwargs):
            calls.append(("after_test_iter", float(outputs[0, 0])))

        def after_test(self, results, metrics, **kwargs):
            calls.append(("after_test", len(results), metrics["bbox"]["AP"]))

    inference_on_dataset(SleepyModel(), SleepyLoader(num_batches=3), SleepyEvaluator(), TestHook(), [DumpHook()])
    assert calls == [("before_test", 6), ("after_test_iter", 0.0), ("after_test_iter", 1.0),
                     ("after_test_iter", 2.0), ("after_test", 3, 50.0)]
