"""TestHook timers and the inference loop, with a model whose costs are known sleeps."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from pet.engine.hooks import TestHook
from pet.engine.inference import inference_on_dataset
from pet.utils.timers import timed

DATA_S, INFER_S, POST_S, RPN_S = 0.004, 0.012, 0.006, 0.003


class SleepyLoader:
    """Yields ``num_batches`` batches, sleeping DATA_S before each."""

    def __init__(self, num_batches: int, batch_size: int = 2) -> None:
        self.num_batches = num_batches
        self.batch_size = batch_size
        self.dataset = list(range(num_batches * batch_size))

    def __iter__(self):
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
        return {"bbox": {"AP": 50.0}}


def test_reported_split_matches_the_sleeps_and_wall_time():
    hook = TestHook(num_warmup=0, logperiod=5)
    loader = SleepyLoader(num_batches=20)
    start = time.perf_counter()
    metrics = inference_on_dataset(SleepyModel(), loader, SleepyEvaluator(), hook)
    wall = time.perf_counter() - start
    assert metrics == {"bbox": {"AP": 50.0}}
    summary = hook.speed_summary()
    per_image = {name: summary[name]["mean_ms"] / 1000 for name in ("data", "infer", "post", "rpn", "iter")}
    # Sleeps are lower bounds; the scheduler may add a little on a busy machine.
    for name, expected in [("data", DATA_S), ("infer", INFER_S), ("post", POST_S), ("rpn", RPN_S)]:
        assert expected / 2 <= per_image[name] <= expected / 2 * 1.5 + 0.002, (name, per_image)
    assert per_image["iter"] == pytest.approx(per_image["data"] + per_image["infer"] + per_image["post"], rel=0.05)
    # iter time x images accounts for the whole loop (wall also covers evaluate() and set-up).
    assert per_image["iter"] * 40 == pytest.approx(wall, rel=0.05)
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


def test_log_stats_line_format(caplog):
    hook = TestHook(num_warmup=0, logperiod=2)
    with caplog.at_level(logging.INFO, logger="pet"):
        inference_on_dataset(SleepyModel(), SleepyLoader(num_batches=4, batch_size=1), SleepyEvaluator(), hook)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[Testing]")]
    assert len(lines) == 2
    assert lines[0].startswith("[Testing][range:1-4 of 4][2/4][")
    assert "s = " in lines[0] and "[eta: " in lines[0]


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
