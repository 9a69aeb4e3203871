"""RT-DETR as a Pet detector: it trains (images without objects included), follows the batch contract at test
time, loads transformers' weights files with readable errors, trains its backbone at BACKBONE_LR_FACTOR, runs
through train_net / test_net / predict with its stage timers, and the documented extension examples work. D-FINE, of
the same family, runs through the tools and resumes bit-identically too, and DEIMv2 resumes so.

Every model here is tiny (8-channel stem, 16-channel encoder and decoder, 2 decoder layers, 20 queries).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from pet.checkpoint import load_weights
from pet.engine.optim import build_optimizer
from pet.modeling import build_model
from pet.modeling.rtdetr import RTDETR_MATCHER_REGISTRY
from pet.utils.errors import ConfigError
from support.helpers import detector_batch, doc_block, run_tool_here, tiny_set_opts
from support.tiny_models import TINY_QUERY_DETECTORS, TINY_TRAINING_DETECTORS, tiny_rtdetr_cfg

LOSS_NAMES = {f"loss_{term}{suffix}" for term in ("vfl", "bbox", "giou")
              for suffix in ("", "_aux_0", "_aux_1", "_dn_0", "_dn_1")}


@pytest.fixture(scope="module")
def tiny_rtdetr():
    torch.manual_seed(0)
    return build_model(tiny_rtdetr_cfg())


def test_trains_on_a_batch_with_an_image_without_objects(tiny_rtdetr):
    images, targets = detector_batch()
    targets[1]["boxes"], targets[1]["labels"] = torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64)
    tiny_rtdetr.train()
    tiny_rtdetr.zero_grad()
    losses = tiny_rtdetr(images, targets)
    assert set(losses) == LOSS_NAMES
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    grads = {n: p.grad for n, p in tiny_rtdetr.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # Every part learns: backbone, encoder, query selection, denoising embedding, every decoder layer.
    for prefix in ("backbone.stem.", "encoder.aifi.", "encoder.pan_blocks.", "decoder.query_selection.",
                   "decoder.denoising.", "decoder.layers.0.", "decoder.layers.1.", "decoder.class_heads.1."):
        assert any(g.abs().sum() > 0 for n, g in grads.items() if n.startswith(prefix)), prefix
    # No object in the whole batch: nothing to denoise, and the matched losses are those of "all background".
    for t in targets:
        t["boxes"], t["labels"] = torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64)
    losses = tiny_rtdetr(images, targets)
    assert not any("_dn_" in k for k in losses) and losses["loss_bbox"] == 0
    assert all(torch.isfinite(v) for v in losses.values())


@pytest.mark.parametrize("divisibility", ["16", "0"])
def test_a_batch_padding_rt_detr_cannot_take_is_a_config_error(divisibility):
    with pytest.raises(ConfigError, match=f"INPUT.SIZE_DIVISIBILITY a multiple of 32, got {divisibility}.*"
                                          "Set INPUT.SIZE_DIVISIBILITY 32"):
        build_model(tiny_rtdetr_cfg("INPUT.SIZE_DIVISIBILITY", divisibility))


def test_detections_follow_the_batch_contract(tiny_rtdetr):
    images, targets = detector_batch()
    tiny_rtdetr.eval()
    with torch.no_grad():
        detections = tiny_rtdetr(images, targets)
    for det, target in zip(detections, targets):
        orig_h, orig_w = target["orig_size"]
        assert len(det["scores"]) == 20  # DETECTIONS_PER_IMAGE (query, class) pairs; no NMS
        assert torch.all(det["scores"][:-1] >= det["scores"][1:])
        assert det["labels"].min() >= 1 and det["labels"].max() <= 3
        boxes = det["boxes"]
        assert boxes.min() >= 0 and boxes[:, 0::2].max() <= orig_w and boxes[:, 1::2].max() <= orig_h
    # Image 0 is a 2x-downscaled original: its boxes are scaled back up (some exceed the 128 px input side).
    assert detections[0]["boxes"].max() > 128


def test_transformers_weights_file_loads_and_a_wrong_one_is_refused_naming_the_keys(tmp_path):
    transformers = pytest.importorskip("transformers")
    backbone = transformers.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 2, 2],
                                               layer_type="basic", out_indices=[2, 3, 4])
    reference = transformers.RTDetrForObjectDetection(transformers.RTDetrConfig(
        num_labels=3, backbone_config=backbone, use_pretrained_backbone=False, encoder_in_channels=[16, 32, 64],
        encoder_hidden_dim=16, d_model=16, decoder_in_channels=[16, 16, 16], encoder_ffn_dim=32, decoder_ffn_dim=32,
        encoder_attention_heads=2, decoder_attention_heads=2, decoder_layers=2, num_queries=20, num_denoising=10))
    cfg = tiny_rtdetr_cfg("MODEL.BACKBONE.NORM", "FrozenBN", "MODEL.RTDETR.CSP_BLOCKS", "3")
    path = str(tmp_path / "hub.pth")
    torch.save(reference.state_dict(), path)
    model = build_model(cfg)
    report = load_weights(model, path, for_inference=True)
    assert report == {"missing": [], "unexpected": [], "mismatched": []}
    for name, value in model.decoder.query_selection.score_head.state_dict().items():
        assert torch.equal(value, reference.state_dict()[f"model.enc_score_head.{name}"])
    broken = {k.replace("enc_output", "encoder_output"): v for k, v in reference.state_dict().items()}
    torch.save(broken, path)
    with pytest.raises(ConfigError, match="query_selection"):
        load_weights(build_model(cfg), path, for_inference=True)


def test_backbone_learns_at_backbone_lr_factor(tiny_rtdetr):
    cfg = tiny_rtdetr_cfg("SOLVER.BACKBONE_LR_FACTOR", "0.1", "SOLVER.BASE_LR", "0.001")
    optimizer = build_optimizer(cfg, tiny_rtdetr)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(lr_of)  # each parameter once
    for name, param in tiny_rtdetr.named_parameters():
        expected = 0.0001 if name.startswith("backbone.") else 0.001
        assert lr_of[id(param)] == pytest.approx(expected), name


def test_documented_matcher_and_loss_examples_train(tiny_rtdetr):
    namespace: dict = {}
    exec(doc_block("python", "class BoxOnlyMatcher"), namespace)
    exec(doc_block("python", "class RTDETRWithCentreLoss"), namespace)
    cfg = tiny_rtdetr_cfg()
    model = namespace["RTDETRWithCentreLoss"](cfg)
    model.matcher = namespace["BoxOnlyMatcher"](cfg)
    model.train()
    losses = model(*detector_batch())
    assert {"loss_centre", "loss_centre_aux_0", "loss_centre_aux_1", "loss_centre_dn_1"} <= set(losses)
    assert losses.keys() - LOSS_NAMES == {f"loss_centre{s}" for s in ("", "_aux_0", "_aux_1", "_dn_0", "_dn_1")}
    sum(losses.values()).backward()


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_QUERY_DETECTORS)
def test_train_and_test_through_the_tools_with_stage_timers(family, tiny_set, tmp_path, monkeypatch, capsys):
    """The engine, test_net and COCO evaluation take RT-DETR (and D-FINE) unchanged; the speed summary has its
    stages."""
    ckpt = str(tmp_path / "run")
    tiny = TINY_QUERY_DETECTORS[family]
    opts = [*tiny_set_opts(tiny_set, ckpt, max_iter=2, checkpoint_period=2), *tiny.opts,
            "SOLVER.AMP.ENABLED", "False", "TEST.AMP.ENABLED", "False"]
    assert run_tool_here(monkeypatch, capsys, "train_net.py", "--cfg", tiny.cfg_file, *opts)[0] == 0
    assert run_tool_here(monkeypatch, capsys, "test_net.py", "--cfg", tiny.cfg_file, *opts)[0] == 0
    with open(os.path.join(ckpt, "test", "metrics.json")) as f:
        report = json.load(f)
    assert 0 <= report["metrics"]["bbox/AP"] <= 100
    assert {"backbone", "encoder", "decoder", "postprocess"} <= set(report["speed"]), report["speed"]


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_TRAINING_DETECTORS)
def test_resume_is_bit_identical_denoising_noise_included(family, tiny_set, tmp_path, monkeypatch, capsys):
    """2 iterations straight, and the same run resumed from its checkpoint after iteration 1, end with the same
    weights: the denoising noise comes from the RNG state the checkpoint restores; the matching is deterministic."""
    ckpt = str(tmp_path / "run")
    tiny = TINY_TRAINING_DETECTORS[family]
    opts = [*tiny_set_opts(tiny_set, ckpt, max_iter=2, checkpoint_period=1), *tiny.opts,
            "SOLVER.AMP.ENABLED", "False", "TRAIN.AUTO_RESUME", "True"]
    assert run_tool_here(monkeypatch, capsys, "train_net.py", "--cfg", tiny.cfg_file, *opts)[0] == 0
    straight = torch.load(os.path.join(ckpt, "model_final.pth"), weights_only=True)["model"]
    os.remove(os.path.join(ckpt, "model_final.pth"))
    with open(os.path.join(ckpt, "last_checkpoint"), "w") as f:
        f.write("model_iter1.pth")
    assert run_tool_here(monkeypatch, capsys, "train_net.py", "--cfg", tiny.cfg_file, *opts)[0] == 0
    with open(os.path.join(ckpt, "log.txt")) as f:
        assert "Starting training from iteration 1 to 2" in f.read()
    resumed = torch.load(os.path.join(ckpt, "model_final.pth"), weights_only=True)["model"]
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_one_argument_matcher_of_pet_0_2_still_builds_with_a_warning(caplog):
    """Matchers are now built as Matcher(cfg, node_name); one written as Matcher(cfg) keeps working until 0.4.0."""
    namespace: dict = {}
    exec("from pet.modeling.rtdetr import HungarianMatcher\n"
         "class OldMatcher(HungarianMatcher):\n"
         "    def __init__(self, cfg):\n"
         "        super().__init__(cfg)\n"
         "        self.built_the_old_way = True\n", namespace)
    RTDETR_MATCHER_REGISTRY.register(namespace["OldMatcher"])
    try:
        with caplog.at_level("WARNING", logger="pet.modeling.rtdetr.matcher"):
            model = build_model(tiny_rtdetr_cfg("MODEL.RTDETR.MATCHER", "OldMatcher"))
    finally:
        RTDETR_MATCHER_REGISTRY._obj_map.pop("OldMatcher")
    assert model.matcher.built_the_old_way
    assert "takes (cfg) alone" in caplog.text and "0.4.0" in caplog.text


@pytest.mark.parametrize("family", sorted(TINY_TRAINING_DETECTORS))
def test_under_bfloat16_autocast_the_losses_take_float32_outputs_outside_autocast(family):
    """Under a bfloat16 training step the decoder runs in bfloat16 but the losses (matching, box distances, the
    distribution losses' softmax over bins) get its outputs in float32 with autocast off, as the authors' training
    loops compute them: in bfloat16, D-FINE's distillation loss, a KL divergence, came out negative."""
    model = build_model(TINY_TRAINING_DETECTORS[family].cfg()).train()
    seen = {}
    criterion = model.criterion.forward

    def spy(outputs, targets, matcher):
        tensors = [outputs["logits"][-1], outputs["boxes"][-1], *outputs.get("corners", [])]
        seen.update(autocast=torch.is_autocast_enabled("cpu"), dtypes={t.dtype for t in tensors})
        return criterion(outputs, targets, matcher)

    model.criterion.forward = spy
    images, targets = detector_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = model(images, targets)
    assert seen == {"autocast": False, "dtypes": {torch.float32}}
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
