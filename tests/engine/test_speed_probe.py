"""``auto`` precision where the CPU has bfloat16 instructions: measured on the model, cached per machine and model.

The decision rule is tested with the two precisions' timings faked (a clock that moves by what each step "costs"),
so it holds on any machine; the real CPU is checked against a direct measurement of its own, natively and as an
AVX-512 BF16 CPU without AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, the class where bfloat16 was slower).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from pet.engine import speed_probe
from pet.engine.events import get_event_storage
from pet.engine.precision import choose_precision
from pet.engine.speed_probe import MARGIN, DecisionCache, SpeedProbe, model_probe
from pet.engine.trainer import Trainer
from pet.utils import cpu as cpu_module
from support.helpers import ROOT
from support.processes import run_two_ranks
from support.toys import FakeClock, InfiniteToyLoader, ToyModel


class CostedProbe:
    """A probe whose step advances ``clock`` by ``float32_s`` or ``low_s``, by the autocast it runs under (and, when
    given, by 0, 1 or 2 times ``jitter`` of it more, round after round); counts its steps."""

    def __init__(self, clock: FakeClock, float32_s: float, low_s: float, *, signature: str = "model-a",
                 jitter: float = 0.0) -> None:
        self.clock, self.costs, self.signature, self.jitter = clock, (float32_s, low_s), signature, jitter
        self.steps = 0

    def __call__(self) -> SpeedProbe:
        return SpeedProbe(self.step, self.signature)

    def step(self, autocast) -> None:
        with autocast:
            low = torch.is_autocast_enabled("cpu")
        self.steps += 1
        self.clock.advance(self.costs[low] * (1 + self.jitter * ((self.steps - 1) // 2 % 3)))


@pytest.fixture
def bf16_cpu(monkeypatch, tmp_path):
    """A CPU with AVX512_BF16 (no cap in force), a fresh decision cache and a fake clock; returns the clock."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_module, "_cpu_flags", lambda: {"avx2": True, "avx512f": True, "avx512_bf16": True})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("PET_CACHE_DIR", str(tmp_path / "cache"))
    clock = FakeClock()
    monkeypatch.setattr(speed_probe, "time", types.SimpleNamespace(perf_counter=clock, strftime=lambda fmt: "now"))
    return clock


class DropoutToy(ToyModel):
    """A toy model that draws from torch's generator in training, as a detector's samplers do."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return super().forward(torch.nn.functional.dropout(x, 0.5, self.training), y)


def auto(probe) -> torch.dtype | None:
    return choose_precision("auto", "auto", "cpu", training=True, probe=probe)


@pytest.mark.parametrize("float32_s, low_s, expected, says", [
    (1.0, 0.6, torch.bfloat16, "1.67x, at least 1.15x, so bfloat16"),    # AMD Zen 4 on the demo
    (0.386, 0.541, None, "0.71x, below the 1.15x needed, so float32"),   # Intel AVX-512 BF16 without AMX
    (1.0, 0.9, None, "1.11x, below the 1.15x needed, so float32"),       # within the margin: noise could flip it
    (1.15, 1.0, torch.bfloat16, "1.15x, at least"),                       # the margin itself is enough
])
def test_auto_takes_bfloat16_only_where_it_is_measured_clearly_faster(bf16_cpu, float32_s, low_s, expected, says):
    probe = CostedProbe(bf16_cpu, float32_s, low_s)
    chosen = auto(probe)
    assert chosen.dtype == expected, chosen.reason
    assert says in chosen.reason
    assert f"float32 {float32_s * 1000:.1f} ms/step, bfloat16 {low_s * 1000:.1f} ms/step" in chosen.reason
    assert "measured on this model" in chosen.reason and "ENABLED True or False to force one" in chosen.reason
    # one warm-up step each, then alternating rounds until the budget is spent, at least MIN_ROUNDS
    rounds = max(speed_probe.MIN_ROUNDS, min(speed_probe.MAX_ROUNDS, int(speed_probe.BUDGET_S // (float32_s + low_s))
                                                + 1))
    assert probe.steps == 2 + 2 * rounds


def test_a_second_run_reuses_the_decision_and_says_so(bf16_cpu):
    first = auto(CostedProbe(bf16_cpu, 1.0, 0.5))
    reversed_timings = CostedProbe(bf16_cpu, 0.5, 1.0)  # would now decide the other way, if it were asked
    second = auto(reversed_timings)
    assert first.dtype == second.dtype == torch.bfloat16
    assert reversed_timings.steps == 0
    cache_file = os.path.join(os.environ["PET_CACHE_DIR"], "precision.json")
    assert f"reused from {cache_file}" in second.reason and "2.00x" in second.reason
    (entry,) = json.load(open(cache_file)).values()
    assert entry["signature"] == "model-a" and entry["machine"]["flags"] == ["avx2", "avx512_bf16", "avx512f"]
    assert entry["machine"]["threads"] == torch.get_num_threads()


def test_another_model_or_machine_is_measured_anew(bf16_cpu, monkeypatch):
    auto(CostedProbe(bf16_cpu, 1.0, 0.5))
    other_model = CostedProbe(bf16_cpu, 0.5, 1.0, signature="model-b")
    assert auto(other_model).dtype is None and other_model.steps > 0
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)  # threads are part of the machine
    more_threads = CostedProbe(bf16_cpu, 0.5, 1.0)
    assert auto(more_threads).dtype is None and more_threads.steps > 0
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # so is an instruction-set cap
    capped = CostedProbe(bf16_cpu, 0.5, 1.0)
    assert auto(capped).dtype is None and capped.steps > 0
    assert len(json.load(open(os.path.join(os.environ["PET_CACHE_DIR"], "precision.json")))) == 4


def test_unsteady_timings_are_kept_all_the_same_and_the_log_says_how_to_measure_again(bf16_cpu):
    noisy = CostedProbe(bf16_cpu, 1.0, 0.5, jitter=0.3)  # rounds 0%, 30%, 60% slower: 23% from the median
    chosen = auto(noisy)
    cache_file = os.path.join(os.environ["PET_CACHE_DIR"], "precision.json")
    assert chosen.dtype == torch.bfloat16
    assert f"(were other processes busy?): to measure again on a quiet machine, delete {cache_file}" in chosen.reason
    steady = CostedProbe(bf16_cpu, 0.5, 1.0)
    assert auto(steady).dtype == torch.bfloat16 and steady.steps == 0  # the same machine keeps its decision


@pytest.mark.parametrize("env", [{"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"},
                                 {"ATEN_CPU_CAPABILITY": "avx2"}])
def test_without_bfloat16_instructions_nothing_is_measured(bf16_cpu, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "ATEN_CPU_CAPABILITY" in env:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")

    def no_probe() -> SpeedProbe:
        raise AssertionError("a CPU without bfloat16 instructions must not be measured")

    chosen = auto(no_probe)
    assert chosen.dtype is None and "so bfloat16 would be emulated" in chosen.reason


def test_without_a_model_to_measure_auto_is_float32_and_says_why(bf16_cpu):
    chosen = choose_precision("auto", "auto", "cpu", training=False, key="TEST.AMP")
    assert chosen.dtype is None and "there was no model and batch to measure whether bfloat16" in chosen.reason


class LoggingFailingToy(ToyModel):
    """Logs a scalar each call, as a detector may, and fails on its ``fail_at``-th call."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        get_event_storage().put_scalar("calls", self.calls)
        if self.calls == self.fail_at:
            raise RuntimeError("step failed")
        return super().forward(x, y)


def test_a_model_that_fails_while_timed_trains_in_float32_and_fails_in_its_own_place(bf16_cpu, make_cfg, caplog):
    """The probe runs a copy of the model (here logging into a storage of the probe's own), so a model that
    raises there raises again where training runs it, with the loop's handling; meanwhile float32, and why."""
    cfg = make_cfg("SOLVER.MAX_ITER", 10)
    with caplog.at_level("WARNING", logger="pet.engine.precision"):
        trainer = Trainer(cfg, model=LoggingFailingToy(fail_at=3), data_loader=InfiniteToyLoader())
    assert trainer.train_step.precision.dtype is None
    assert "timing the model failed (RuntimeError: step failed)" in trainer.train_step.precision.reason
    assert [r.getMessage() for r in caplog.records] == [
        "Could not time the model to choose its precision (RuntimeError: step failed); using float32"]
    with pytest.raises(RuntimeError, match="step failed"):
        trainer.train()
    assert trainer.iter == 2  # the real model failed at its own third call: two iterations completed


def test_measuring_leaves_the_model_and_the_random_generators_as_they_were():
    model = DropoutToy(with_bn=True).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    probe = model_probe(model, next(iter(InfiniteToyLoader())), training=True)
    speed_probe.time_probe(probe, torch.bfloat16)
    assert torch.equal(torch.rand(4), expected)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_the_signature_follows_what_the_time_depends_on():
    batch = next(iter(InfiniteToyLoader()))
    model = ToyModel()
    base = model_probe(model, batch, training=True).signature
    assert model_probe(ToyModel(), batch, training=True).signature == base  # other weights, same step
    assert model_probe(model, batch, training=False).signature != base
    assert model_probe(ToyModel(with_bn=True), batch, training=True).signature != base
    assert model_probe(model, (batch[0][:4], batch[1][:4]), training=True).signature != base
    model.linear.weight.requires_grad_(False)  # a frozen layer has no weight gradient to compute
    assert model_probe(model, batch, training=True).signature != base


def test_a_run_that_measured_and_one_that_reused_the_decision_train_the_same_weights(bf16_cpu, make_cfg, tmp_path,
                                                                                   monkeypatch):
    timed = []

    def time_for_real_then_say_twice_as_fast(probe, dtype):  # the real steps run; the verdict is fixed
        timed.append(real_time_probe(probe, dtype))
        return speed_probe.Measurement("bfloat16", 1.0, 0.5, rounds=3)

    real_time_probe = speed_probe.time_probe
    monkeypatch.setattr(speed_probe, "time_probe", time_for_real_then_say_twice_as_fast)
    weights = []
    for run in ("measures", "reuses"):
        cfg = make_cfg("CKPT", str(tmp_path / run), "SOLVER.MAX_ITER", 3, "HOOKS.CHECKPOINT.PERIOD", 0)
        torch.manual_seed(0)
        model = DropoutToy(with_bn=True)
        trainer = Trainer(cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                          data_loader=InfiniteToyLoader())
        assert trainer.train_step.precision.dtype == torch.bfloat16
        trainer.train()
        weights.append(model.state_dict())
    assert len(timed) == 1  # the first run measured (on the real model), the second reused its decision
    final = torch.load(tmp_path / "reuses" / "model_final.pth", weights_only=True)
    assert final["precision"] == "bfloat16"  # the checkpoint says what the weights were trained in
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


class RankCostedProbe:
    """Rank 0's probe finds bfloat16 faster, rank 1's slower: only rank 0's may decide."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __call__(self) -> SpeedProbe:
        return SpeedProbe(lambda autocast: None, f"rank{self.rank}")


def _decide_on_each_rank(rank: int, init_file, cache_dir: str) -> tuple[int, str]:
    os.environ["PET_CACHE_DIR"] = cache_dir
    speedups = {0: (1.0, 0.5), 1: (0.5, 1.0)}[rank]
    speed_probe.time_probe = lambda probe, dtype: speed_probe.Measurement("bfloat16", *speedups, rounds=3)
    cpu_module._cpu_flags = lambda: {"avx512_bf16": True}
    torch.backends.cpu.get_cpu_capability = lambda: "AVX512"
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        os.environ.pop(name, None)
    chosen = choose_precision("auto", "auto", "cpu", training=True, probe=RankCostedProbe(rank))
    return rank, chosen.name


@pytest.mark.slow
def test_in_a_distributed_run_rank_0_decides_for_every_rank(tmp_path):
    results = run_two_ranks(_decide_on_each_rank, tmp_path / "init", str(tmp_path / "cache"))
    assert results == [(0, "bfloat16"), (1, "bfloat16")]
    assert [entry["signature"] for entry in json.load(open(tmp_path / "cache" / "precision.json")).values()] == [
        "rank0"]


AGREEMENT = r"""
import json, statistics, time, torch
from pet.engine.precision import choose_precision
from pet.engine.speed_probe import model_probe
torch.manual_seed(0)
# A small convolutional detector body: what the demo spends its step on.
layers = [torch.nn.Conv2d(3, 32, 3, 2, 1), torch.nn.ReLU()]
for _ in range(4):
    layers += [torch.nn.Conv2d(32, 32, 3, 1, 1), torch.nn.BatchNorm2d(32), torch.nn.ReLU()]
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*layers).to(memory_format=torch.channels_last)
    def forward(self, x):
        return {"loss": self.body(x).float().square().mean()}
net = Net()
batch = {"x": torch.randn(8, 3, 128, 128).contiguous(memory_format=torch.channels_last)}
chosen = choose_precision("auto", "auto", "cpu", training=True, probe=lambda: model_probe(net, batch, training=True))
def step(low):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
        loss = net(**batch)["loss"]
    loss.backward()
times = {False: [], True: []}
for low in (False, True):
    step(low)
for _ in range(7):
    for low in (False, True):
        start = time.perf_counter(); step(low); times[low].append(time.perf_counter() - start)
print(json.dumps({"chosen": chosen.name, "reason": chosen.reason,
                  "speedup": statistics.median(times[False]) / statistics.median(times[True])}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("caps", [{}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}], ids=["native", "no-AMX"])
def test_on_this_cpu_auto_agrees_with_a_direct_measurement(tmp_path, caps):
    """Natively and with AMX held down (on an AMX machine: the class whose bfloat16 is slower than float32), the
    decision matches the ratio the test measures itself, wherever that ratio is far from the margin; a CPU without
    bfloat16 instructions gets float32 without a probe."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                           "DNNL_MAX_CPU_ISA")}
    env.update(caps, PET_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", AGREEMENT], env=env, capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if "would be emulated" in result["reason"]:
        assert result["chosen"] == "float32" and not os.path.exists(tmp_path / "precision.json")
        return
    assert "measured on this model" in result["reason"]
    if result["speedup"] >= MARGIN * 1.3:
        assert result["chosen"] == "bfloat16", result
    elif result["speedup"] <= 1 / 1.1:
        assert result["chosen"] == "float32", result
    else:
        pytest.skip(f"bfloat16 measured {result['speedup']:.2f}x float32 here: too near the {MARGIN}x margin to judge")


def test_the_cache_survives_a_damaged_file(tmp_path):
    cache = DecisionCache(str(tmp_path))
    os.makedirs(tmp_path, exist_ok=True)
    (tmp_path / "precision.json").write_text("{not json")
    assert cache.get("key") is None
    cache.put("key", speed_probe.Measurement("bfloat16", 1.0, 0.5, 3), {"signature": "s"})
    assert cache.get("key").speedup == 2.0
