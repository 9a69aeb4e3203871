"""tools/benchmark.py gpu, the check to run when a CUDA GPU is lent: without CUDA it says so and reports every
check skipped (exit status 0); a failing check is reported with its reason and fails the command (exit status 1)
without hiding the next one; check 3 pairs detections by label and IoU, never by index. Nothing here needs a GPU
or times anything (the checks themselves ran on the CPU with --device cpu; docs/benchmarks/gpu-check.md)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from support.helpers import run_tool_in_process


@pytest.fixture
def gpu():
    """tools/benchmarks/gpu.py, the module tools/benchmark.py runs here (it imports tools.benchmarks when the
    repository root is on the path, as pytest.ini puts it)."""
    from tools.benchmarks import gpu

    return gpu


def _report(out: str) -> tuple[dict, str]:
    with open(out, encoding="utf-8") as f:
        report = json.load(f)
    with open(os.path.splitext(out)[0] + ".md", encoding="utf-8") as f:
        return report, f.read()


def test_without_cuda_every_check_is_skipped_saying_so(gpu, monkeypatch, capsys, tmp_path):
    """The real command on a machine without CUDA (made so here, also on a GPU machine): one printed line says there
    is no GPU, the JSON and the Markdown list all six checks as skipped for that reason, exit status 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = str(tmp_path / "gpu.json")
    run = run_tool_in_process(monkeypatch, capsys, "benchmark.py", "gpu", "--out", out)
    assert run.returncode == 0, run.stderr
    reason = "no CUDA GPU (torch.cuda.is_available() is False)"
    assert f"No GPU: {reason}" in run.stdout
    report, summary = _report(out)
    assert report["gpu"]["available"] is False and report["gpu"]["reason"] == reason
    assert list(report["checks"]) == ["demo_amp", "test_timing", "torchvision_parity", "architectures", "nccl",
                                      "onnx_cuda"]
    assert all(c["status"] == "skipped" and c["reason"] == reason for c in report["checks"].values())
    assert f"**No GPU**: {reason}" in summary
    for number, check in enumerate(report["checks"].values(), 1):
        assert f"## {number}. {check['title']}\n\n**skipped**" in summary
    assert not os.path.exists(str(tmp_path / "gpu.log"))  # nothing ran, so nothing logged


def test_a_failing_check_fails_the_command_and_hides_no_other(gpu, monkeypatch, capsys, tmp_path):
    """One check raising is reported failed with its error and traceback, the next one still runs and passes, the
    unselected ones say so, and the command exits 1 (the --device cpu dry run, with two checks stood in for)."""
    def broken(ctx):
        raise RuntimeError("boom")

    monkeypatch.setitem(gpu.CHECKS, "demo_amp", gpu.Check("broken", broken))
    monkeypatch.setitem(gpu.CHECKS, "test_timing", gpu.Check("fine", lambda ctx: {"device": ctx.device.type}))
    out = str(tmp_path / "gpu.json")
    run = run_tool_in_process(monkeypatch, capsys, "benchmark.py", "gpu", "--device", "cpu", "--checks", "demo_amp",
                              "test_timing", "--out", out)
    assert run.returncode == 1, run.stderr
    report, summary = _report(out)
    checks = report["checks"]
    assert checks["demo_amp"]["status"] == "failed" and checks["demo_amp"]["reason"] == "RuntimeError: boom"
    assert "raise RuntimeError" in checks["demo_amp"]["traceback"]
    assert checks["test_timing"] == {"title": "fine", "status": "passed", "figures": {"device": "cpu"},
                                     "wall_s": checks["test_timing"]["wall_s"]}
    assert {checks[name]["reason"] for name in ("torchvision_parity", "architectures", "nccl", "onnx_cuda")} == {
        "not selected (--checks)"}
    assert "**failed** (`demo_amp`" in summary and "**Dry run on the CPU**" in summary


def _detections(boxes: list[list[float]], scores: list[float], labels: list[int]) -> dict[str, torch.Tensor]:
    return {"boxes": torch.tensor(boxes), "scores": torch.tensor(scores), "labels": torch.tensor(labels)}


def test_parity_pairs_by_label_and_iou_not_by_index(gpu):
    """torchvision's list in another order pairs one to one; a box moved past the tolerance, a label changed, or a
    detection missing that is no near-tie at a cut-off is a problem."""
    ours = _detections([[10, 10, 50, 50], [60, 60, 90, 100], [10, 10, 50, 50]], [0.9, 0.8, 0.7], [1, 2, 3])
    theirs = _detections([[10, 10, 50, 50], [10, 10, 50, 50], [60, 60, 90, 100]], [0.7, 0.9, 0.8], [3, 1, 2])
    worst = {"box_px": 0.0, "score": 0.0, "pairs": 0, "unpaired": 0, "reordered": 0}
    assert gpu._pair_detections(ours, theirs) == [(0, 1), (1, 2), (2, 0)]
    assert gpu._compare_image(ours, theirs, [0.05], worst) == []
    assert (worst["pairs"], worst["reordered"], worst["unpaired"]) == (3, 3, 0)

    moved = _detections([[10, 10, 50, 50.05], [60, 60, 90, 100], [10, 10, 50, 50]], [0.9, 0.8, 0.7], [1, 2, 3])
    problems = gpu._compare_image(moved, theirs, [0.05], dict(worst))
    assert len(problems) == 1 and "0.05 px" in problems[0]

    relabelled = _detections(ours["boxes"].tolist(), [0.9, 0.8, 0.7], [1, 2, 1])
    problems = gpu._compare_image(relabelled, theirs, [0.05], dict(worst))
    assert len(problems) == 2  # Pet's third and torchvision's first are left without a partner

    near_tie = _detections(ours["boxes"].tolist()[:2], [0.9, 0.8], [1, 2])  # torchvision's 0.7 is no near-tie ...
    assert len(gpu._compare_image(near_tie, theirs, [0.05], dict(worst))) == 1
    assert gpu._compare_image(near_tie, theirs, [0.05, 0.70005], dict(worst)) == []  # ... unless at the cap's cut-off


def test_event_timed_records_one_pair_per_forward(gpu):
    """The wrapper check 2 times the model with: one event pair per call, outputs passed through (CPU clock here)."""
    timed = gpu.EventTimed(torch.nn.Linear(2, 1), torch.device("cpu"))
    outputs = [timed(torch.ones(1, 2)) for _ in range(3)]
    assert all(torch.equal(o, timed.model(torch.ones(1, 2))) for o in outputs)
    elapsed = timed.elapsed_ms()
    assert len(elapsed) == 3 and all(ms >= 0 for ms in elapsed)
