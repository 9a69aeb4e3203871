"""train_net.py and test_net.py as a user runs them, on a tiny generated shapes set."""
from __future__ import annotations

import json
import logging
import os

import cv2
import numpy as np
import pytest
import torch
from pycocotools.coco import COCO

from pet.engine.events import read_metrics
from support.helpers import DEMO_CFG, run_tool, run_tool_in_process, tiny_set_opts


@pytest.fixture(scope="module")
def end_to_end_set(shapes_set):
    """24 training and 8 validation images: 4 test iterations of 2 images, 3 timed after the warm-up one."""
    return shapes_set(num_train=24, num_val=8)


def _opts(root: str, ckpt: str) -> list[str]:
    """6 iterations, a checkpoint at 4, and TensorBoard on: its event files are among what a run must (not) write."""
    return [*tiny_set_opts(root, ckpt), "TRAIN.USE_TENSORBOARD", "True"]


@pytest.mark.slow
def test_train_then_test_writes_every_promised_file(end_to_end_set, tmp_path, monkeypatch, capsys):
    """Both tools in this process: what they write is the point here; the tests below, and those of two processes
    (test_distributed.py, test_multinode.py, test_worker_death.py), run them as a user's shell starts them."""
    ckpt = str(tmp_path / "run")
    # Training's precision is not measured (seconds): this test checks the test's, and test_distributed.py a
    # training's (every rank follows rank 0's measurement).
    train = run_tool_in_process(monkeypatch, capsys, "train_net.py", "--cfg", DEMO_CFG, *_opts(end_to_end_set, ckpt),
                                "SOLVER.AMP.ENABLED", "False")
    assert train.returncode == 0, train.stderr[-3000:]
    assert "Overall training speed" in train.stdout
    assert "M parameters" in train.stdout and "GFLOPs on a 256x256 image" in train.stdout
    for name in ("config.yaml", "log.txt", "metrics.json", "last_checkpoint", "model_iter4.pth", "model_final.pth"):
        assert os.path.isfile(os.path.join(ckpt, name)), name
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(ckpt))
    assert [r["iteration"] for r in read_metrics(os.path.join(ckpt, "metrics.json"))] == [3, 6]
    with open(os.path.join(ckpt, "curves.png"), "rb") as f:
        png = f.read()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

    # Six iterations learn little, so no score threshold: every proposal the model keeps is a detection,
    # and bbox.json, the COCO evaluation and the pictures are exercised on real model output, never on nothing.
    test = run_tool_in_process(monkeypatch, capsys, "test_net.py", "--cfg", DEMO_CFG, "--vis", "3",
                               *_opts(end_to_end_set, ckpt), "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0")
    assert test.returncode == 0, test.stderr[-3000:]
    assert "[Testing][range:1-8 of 8]" in test.stdout
    assert "GFLOPs" in test.stdout
    gt = COCO(os.path.join(end_to_end_set, "annotations", "val.json"))
    with open(os.path.join(ckpt, "test", "bbox.json")) as f:
        detections = json.load(f)
    per_image = {image_id: [d for d in detections if d["image_id"] == image_id] for image_id in gt.getImgIds()}
    assert all(0 < len(found) <= 100 for found in per_image.values()), {k: len(v) for k, v in per_image.items()}
    assert len(detections) == sum(map(len, per_image.values()))  # no detection on an image the set lacks
    for d in detections:
        info = gt.imgs[d["image_id"]]
        x, y, w, h = d["bbox"]
        assert d["category_id"] in gt.cats and 0 < d["score"] <= 1, d
        assert w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= info["width"] + 0.01 and \
            y + h <= info["height"] + 0.01, (d, info)
    dt = gt.loadRes(os.path.join(ckpt, "test", "bbox.json"))
    assert sorted(dt.getImgIds()) == sorted(gt.getImgIds())
    with open(os.path.join(ckpt, "test", "metrics.json")) as f:
        report = json.load(f)
    assert 0 <= report["metrics"]["bbox/AP"] <= report["metrics"]["bbox/AP50"] <= 100  # scored, not NaN
    assert report["speed"]["timed_iters"] == 3 and report["speed"]["iter"]["mean_ms"] > 0
    # the precision recorded is the one the run logged (TEST.AMP auto: measured or cached on this machine)
    logged = {"float32": "Test precision: float32 (no autocast)", "bfloat16": "Test precision: bfloat16 autocast"}
    assert report["backend"] == "pytorch" and logged[report["precision"]] in test.stdout
    assert report["precision_reason"].startswith("TEST.AMP.ENABLED auto")

    vis_dir = os.path.join(ckpt, "test", "vis")
    first_images = sorted(gt.loadImgs(gt.getImgIds()), key=lambda info: info["id"])[:3]
    assert sorted(os.listdir(vis_dir)) == sorted(os.path.splitext(i["file_name"])[0] + ".png" for i in first_images)
    for info in first_images:
        path = os.path.join(vis_dir, os.path.splitext(info["file_name"])[0] + ".png")
        picture = cv2.imread(path)
        assert picture is not None and picture.shape[:2] == (info["height"], info["width"])
        assert os.path.getsize(path) > 5_000
        original = cv2.imread(os.path.join(end_to_end_set, "val", info["file_name"]))
        assert not np.array_equal(picture, original)  # drawn on

    rescore = run_tool_in_process(monkeypatch, capsys, "test_net.py", "--cfg", DEMO_CFG, "--eval-only-results",
                                  os.path.join(ckpt, "test", "bbox.json"), *_opts(end_to_end_set, ckpt))
    assert rescore.returncode == 0, rescore.stderr
    assert "Per-category bbox AP" in rescore.stdout and "[Testing]" not in rescore.stdout
    with open(os.path.join(ckpt, "test", "metrics_rescored.json")) as f:
        rescored = json.load(f)["metrics"]
    assert rescored == pytest.approx(report["metrics"], nan_ok=True)


@pytest.mark.slow
def test_cli_rejects_an_unknown_key_with_one_line_and_creates_nothing(tmp_path):
    ckpt = tmp_path / "never"
    proc = run_tool("train_net.py", "--cfg", DEMO_CFG, "CKPT", str(ckpt), "SOLVER.BASE_RL", "0.1", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "Error: Unknown config key 'SOLVER.BASE_RL' in command line. Did you mean 'SOLVER.BASE_LR'?"]
    assert not ckpt.exists()


# The tests below run a case of each tool and of each stage an error can stop it at (reading the config, building
# the trainer) as a user's shell sees it (a fresh interpreter: nothing else on stderr, the exit status) and the others
# in this process: the same code, without a start-up of seconds each.
@pytest.mark.slow
def test_cli_missing_config_file_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys):
    missing, ckpt = tmp_path / "missing.yaml", tmp_path / "never"
    for tool in ("test_net.py", "train_net.py"):
        args = ("--cfg", str(missing), "CKPT", str(ckpt))
        proc = run_tool(tool, *args, check=False) if tool == "test_net.py" else \
            run_tool_in_process(monkeypatch, capsys, tool, *args)
        assert proc.returncode == 2, tool
        assert proc.stderr.strip().splitlines() == [
            f"Error: Config file not found: {missing} (pass an existing YAML file to --cfg)"], tool
        assert not ckpt.exists(), tool


def test_cli_refuses_a_yaml_tag_that_would_run_code_with_one_line_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """Both in this process: the config is read where the tests above show each tool's one line to a shell."""
    marker, ckpt = tmp_path / "marker", tmp_path / "never"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"_BASE_: {DEMO_CFG}\nSOLVER:\n  BASE_LR: !!python/object/apply:os.system ['touch {marker}']\n")
    for tool in ("train_net.py", "test_net.py"):
        proc = run_tool_in_process(monkeypatch, capsys, tool, "--cfg", str(evil), "CKPT", str(ckpt))
        assert proc.returncode == 2, tool
        assert proc.stderr.strip().splitlines() == [
            f"Error: Unsafe YAML tag !!python/object/apply:os.system in {evil}:3:12: configs are read with "
            "yaml.safe_load, which never builds Python objects or runs code; write a plain value (number, string, "
            "list or mapping) instead"], tool
        assert not marker.exists() and not ckpt.exists(), tool


def test_test_net_without_weights_says_what_to_do(end_to_end_set, tmp_path, monkeypatch, capsys):
    """In this process: the tests above show test_net's exit status and one line as a shell sees them."""
    proc = run_tool_in_process(monkeypatch, capsys, "test_net.py", "--cfg", DEMO_CFG,
                               *_opts(end_to_end_set, str(tmp_path / "empty")))
    assert proc.returncode == 2
    assert "Weights file not found" in proc.stderr and "train first" in proc.stderr


def test_a_tool_run_in_process_leaves_this_process_as_it_found_it(end_to_end_set, tmp_path, monkeypatch, capsys):
    """The in-process runs above share the test process: the threads and seeds test_net's set-up chooses and the
    log file it opens must not reach the tests after them."""
    pet_logger = logging.getLogger("pet")
    before = torch.get_num_threads(), torch.get_rng_state(), pet_logger.handlers[:], pet_logger.propagate
    proc = run_tool_in_process(monkeypatch, capsys, "test_net.py", "--cfg", DEMO_CFG,
                               *_opts(end_to_end_set, str(tmp_path / "empty")), "NUM_THREADS", before[0] + 1)
    assert proc.returncode == 2 and (tmp_path / "empty" / "log.txt").exists()  # it got past the set-up
    assert torch.get_num_threads() == before[0] and torch.equal(torch.get_rng_state(), before[1])
    assert pet_logger.handlers == before[2] and pet_logger.propagate == before[3]


BAD_HOOKS_AND_WRITERS = {  # case: (key, value, the start of the one line)
    "unknown-hook": ("HOOKS.CUSTOM", "[{'type': 'EarlyStopingHook'}]",
                     "Error: Unknown hook 'EarlyStopingHook'. Did you mean 'EarlyStoppingHook'? Registered: "),
    "hook-path-does-not-import": (
        "HOOKS.CUSTOM", "[{'type': 'no_such_package.hooks.MyHook'}]",
        "Error: Cannot import 'no_such_package.hooks.MyHook': ModuleNotFoundError: No module named 'no_such_package'"),
    "unknown-writer": ("TRAIN.WRITERS", "[{'type': 'JSONWritter'}]",
                       "Error: Unknown event writer 'JSONWritter'. Did you mean 'JSONWriter'? Registered: "),
    "writer-path-does-not-import": (
        "TRAIN.WRITERS", "[{'type': 'pet.engine.events.CSVWriter'}]",
        "Error: Cannot import 'pet.engine.events.CSVWriter': module 'pet.engine.events' has no 'CSVWriter'"),
}


@pytest.mark.slow
def test_a_bad_hook_or_writer_fails_before_anything_but_the_log_is_written(end_to_end_set, tmp_path, monkeypatch,
                                                                           capsys):
    for i, (case, (key, value, error)) in enumerate(BAD_HOOKS_AND_WRITERS.items()):
        ckpt = tmp_path / case
        # No precision to measure (seconds, before the hooks are built): the hooks and writers are what is tested.
        args = ("--cfg", DEMO_CFG, *_opts(end_to_end_set, str(ckpt)), "SOLVER.AMP.ENABLED", "False", key, value)
        proc = run_tool("train_net.py", *args, check=False) if i == 0 else \
            run_tool_in_process(monkeypatch, capsys, "train_net.py", *args)
        assert proc.returncode == 2, case
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(error), (case, proc.stderr)
        assert sorted(os.listdir(ckpt)) == ["log.txt"], case
