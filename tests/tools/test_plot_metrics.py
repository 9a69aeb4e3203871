"""tools/plot_metrics.py as a user runs it: several metrics.json files overlaid in one PNG, clear errors."""
from __future__ import annotations

import json
import math
import os

import pytest

from support.helpers import run_tool, run_tool_in_process

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(path, scale: float) -> str:
    """Training records every 10 iterations, validation AP at 50 and 100 (separate records, as EvalHook writes)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for it in range(10, 101, 10):
            cls, box = scale * math.exp(-it / 40), scale * 0.5 * math.exp(-it / 60)
            record = {"iteration": it, "total_loss": cls + box, "loss_cls": cls, "loss_box_reg": box,
                      "lr": 0.02 * 0.5 * (1 + math.cos(math.pi * it / 100)), "time": 0.1, "data_time": 0.01}
            if it in (50, 100):
                record.update({"bbox/AP": 30.0 * it / 100 / scale, "bbox/AP50": 60.0 * it / 100 / scale})
            f.write(json.dumps(record) + "\n")
    return str(path)


def test_two_runs_overlaid_in_a_valid_png(tmp_path, monkeypatch, capsys):
    first = _write_metrics(tmp_path / "run_a" / "metrics.json", 1.0)
    second = _write_metrics(tmp_path / "run_b" / "metrics.json", 1.5)
    out = tmp_path / "compare" / "curves.png"
    proc = run_tool_in_process(monkeypatch, capsys, "plot_metrics.py", first, second, "--out", out,
                               "--labels", "a", "b")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 20_000  # four panels of curves, not an empty canvas


def test_default_output_is_next_to_the_first_file(tmp_path, monkeypatch, capsys):
    metrics = _write_metrics(tmp_path / "run" / "metrics.json", 1.0)
    assert run_tool_in_process(monkeypatch, capsys, "plot_metrics.py", metrics).returncode == 0
    assert (tmp_path / "run" / "curves.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.slow
def test_missing_or_empty_file_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """The first case as a user's shell sees it (a fresh interpreter), the others in this process (the same code)."""
    good = _write_metrics(tmp_path / "run" / "metrics.json", 1.0)
    missing = str(tmp_path / "nope" / "metrics.json")
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    out = ("--out", str(tmp_path / "out.png"))
    proc = run_tool("plot_metrics.py", good, missing, *out, check=False)
    assert proc.returncode != 0 and proc.stderr.strip() == f"Error: metrics file not found: {missing}"
    for args, message in [
        ((str(empty),), f"Error: no metrics records (JSON lines) in {empty}"),
        ((good, "--labels", "a", "b"), "Error: give one --labels entry per metrics file"),
    ]:
        proc = run_tool_in_process(monkeypatch, capsys, "plot_metrics.py", *args, *out)
        assert proc.returncode != 0
        assert proc.stderr.strip() == message
    assert not (tmp_path / "out.png").exists()
