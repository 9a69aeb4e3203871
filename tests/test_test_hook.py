"""TestHook timers and the inference loop, with a model whose costs are known sleeps."""
from __future__ import annotations

import logging
import re
import time

import pytest
import torch

from pet.engine.hooks import TestHook
from pet.engine.inference import inference_on_dataset
from pet.utils.timers import activate, timed

DATA_S, INFER_S, POST_S, RPN_S = 0.004, 0.012, 0.006, 0.003


class SleepyLoader:
    """Yields ``num_batches`` batches, sleeping DATA_S before each."""

    def __init__(self, num_batches: int, batch_size: int = 2) -> None:
        self.num_batches = num_batches
        self.batch_size = batch_size
        self.dataset = list(range(num_batches * batch_size))

    def __iter__(self):
        self.started = time.perf_counter()
        for i in range(self.num_batches):
            time.sleep(DATA_S)
            yield (torch.full((self.batch_size, 1), float(i)),)


class SleepyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        with timed("rpn"):
            time.sleep(RPN_S)
        time.sleep(INFER_S - RPN_S)
        return x * self.weight


class SleepyEvaluator:
    def __init__(self) -> None:
        self.seen = []
        self.predictions = self.seen

    def reset(self):
        self.seen.clear()

    def process(self, inputs, outputs):
        time.sleep(POST_S)
        self.seen.append(outputs)

    def evaluate(self):
        self.called = time.perf_counter()
        return {"bbox": {"AP": 50.0}}


def test_reported_split_matches_the_sleeps_and_wall_time():
    hook = TestHook(num_warmup=0, logperiod=5)
    loader, evaluator = SleepyLoader(num_batches=20), SleepyEvaluator()
    metrics = inference_on_dataset(SleepyModel(), loader, evaluator, hook)
    loop_wall = evaluator.called - loader.started  # the inference loop, from its first batch to evaluation
    assert metrics == {"bbox": {"AP": 50.0}}
    summary = hook.speed_summary()
    per_image = {name: summary[name]["mean_ms"] / 1000 for name in ("data", "infer", "post", "rpn", "iter")}
    # Sleeps are lower bounds; the scheduler may add a little on a busy machine.
    for name, expected in [("data", DATA_S), ("infer", INFER_S), ("post", POST_S), ("rpn", RPN_S)]:
        assert expected / 2 <= per_image[name] <= expected / 2 * 1.5 + 0.002, (name, per_image)
    assert per_image["iter"] == pytest.approx(per_image["data"] + per_image["infer"] + per_image["post"], rel=0.05)
    # iter time x images accounts for the whole loop.
    assert per_image["iter"] * 40 == pytest.approx(loop_wall, rel=0.05)
    assert summary["ims_per_batch"] == 2 and summary["timed_iters"] == 20


def test_warmup_iterations_are_excluded_from_every_timer():
    hook = TestHook(num_warmup=3)
    inference_on_dataset(SleepyModel(), SleepyLoader(num_batches=8), SleepyEvaluator(), hook)
    assert {name: len(t.durations) for name, t in hook.timers.items()} == {
        "iter": 5, "data": 5, "infer": 5, "post": 5, "rpn": 5}


def test_tic_toc_shortcuts_reset_and_custom_timers():
    hook = TestHook(num_warmup=0)
    hook.add_timer("nms")
    hook.nms_tic()
    time.sleep(0.002)
    assert hook.nms_toc() >= 0.002
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


def _testing_lines(caplog, model):
    hook = TestHook(num_warmup=0, logperiod=2)
    with caplog.at_level(logging.INFO, logger="pet"):
        inference_on_dataset(model, SleepyLoader(num_batches=4, batch_size=1), SleepyEvaluator(), hook)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("[Testing]")]


_SECONDS = r"\d+\.\d{3}s"
_ETA = r"\[eta: \d+:\d\d:\d\d\]"


def test_log_stats_line_format_shows_extra_timers(caplog):
    lines = _testing_lines(caplog, SleepyModel())  # times "rpn" from inside the model
    assert len(lines) == 2
    for i, line in enumerate(lines, 1):
        assert re.fullmatch(rf"\[Testing\]\[range:1-4 of 4\]\[{2 * i}/4\]"
                            rf"\[{_SECONDS} = {_SECONDS} \+ {_SECONDS} \+ {_SECONDS}\]\[rpn: {_SECONDS}\]{_ETA}",
                            line), line
    rpn = float(re.search(r"\[rpn: (\S+)s\]", lines[-1]).group(1))
    assert rpn >= RPN_S - 0.0005  # per image (batch 1), as printed with 3 decimals


def test_log_stats_line_without_extra_timers_has_only_the_default_split(caplog):
    lines = _testing_lines(caplog, FastModel())
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
