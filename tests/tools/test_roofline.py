"""tools/benchmark.py roofline counts FLOPs right and puts them where they ran.

The counts are checked against hand formulas (2 FLOPs per multiply-add): a sparse RoIAlign product does
2 x nnz x channels forward and again backward, not the dense product's count; convolutions and linear layers
count forward, and backward only the gradients autograd computes. Attribution: each module's FLOPs, forward
and backward, land in its stage. Nothing here is timed.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch
from torch import nn

from pet.config import load_cfg
from pet.modeling import build_model
from pet.modeling.poolers import roi_align_sparse
from support.helpers import CFGS, DEMO_CFG, ROOT
from tools.benchmarks.roofline import build_workload, profile_steps
from tools.benchmarks.stage_profile import OUTSIDE, StageProfiler, detector_stage, named_losses


class SparsePool(nn.Module):
    """Pet's training RoIAlign of one level, as a module: 3 x 3 bins, ``ratio`` x ``ratio`` samples each."""

    def __init__(self, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio

    def forward(self, features: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:
        return roi_align_sparse(features, rois, (3, 3), 0.5, self.ratio)


def test_a_sparse_roi_align_counts_two_flops_per_stored_entry_and_channel_forward_and_backward():
    batch, channels, height, width, ratio = 2, 8, 16, 16, 2
    features = torch.randn(batch, channels, height, width).to(memory_format=torch.channels_last).requires_grad_()
    rois = torch.tensor([[0, 2.0, 2, 20, 20], [1, 4, 4, 24, 28], [0, 0, 0, 31, 31]])
    model = nn.ModuleDict({"pool": SparsePool(ratio)})
    with StageProfiler(model) as profiler:
        model["pool"](features, rois).sum().backward()
    # Each of the R x 3 x 3 output rows stores ratio^2 samples x 4 bilinear corners (uncoalesced: every one is
    # multiplied), and each entry meets every channel: forward S @ X, backward S^T @ dY.
    nnz = len(rois) * 3 * 3 * ratio**2 * 4
    assert profiler.tallies[("pool", "forward")].flops == 2 * nnz * channels
    assert profiler.tallies[("pool", "backward")].flops == 2 * nnz * channels
    assert profiler.total().flops == profiler.sparse_flops == 4 * nnz * channels
    dense = 2 * 2 * (len(rois) * 3 * 3) * (batch * height * width) * channels  # what a dense count says
    assert profiler.sparse_dense_equivalent == dense
    assert dense > 20 * profiler.sparse_flops


class TinyNet(nn.Module):
    """A detector in miniature: a backbone (body, fpn) and a head, with Pet's module names."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(OrderedDict(body=nn.Conv2d(3, 4, 3, padding=1), fpn=nn.Conv2d(4, 4, 1)))
        self.head = nn.Linear(4 * 5 * 5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).flatten(1))


# Forward FLOPs of TinyNet on a [2, 3, 5, 5] batch: convolutions 2 x images x out x in x kernel area x output pixels,
# the linear layer 2 x rows x in x out.
BODY, FPN, HEAD = 2 * 2 * 4 * 3 * 9 * 25, 2 * 2 * 4 * 4 * 1 * 25, 2 * 2 * 100 * 6


def test_convolutions_and_linear_layers_count_the_hand_formula_in_their_own_stage():
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with StageProfiler(model, optimizer) as profiler:
        model(torch.randn(2, 3, 5, 5)).square().mean().backward()
        optimizer.step()
    stages = profiler.by_stage()
    # Backward: the body's input needs no gradient (weight gradient only); fpn and head compute both.
    assert stages["backbone"].flops == 2 * BODY
    assert stages["fpn"].flops == 3 * FPN
    assert stages["head"].flops == 3 * HEAD
    assert profiler.tallies[("backbone.body", "forward")].flops == BODY
    assert profiler.tallies[("head", "backward")].flops == 2 * HEAD
    # The loss outside any module and the optimizer step: time, no dense arithmetic.
    assert stages["other"].calls > 0 and stages["other"].flops == 0
    assert stages["optimizer"].calls > 0 and stages["optimizer"].flops == 0
    assert profiler.total().flops == 2 * BODY + 3 * FPN + 3 * HEAD


def test_inference_mode_counts_the_composite_layers_it_does_not_decompose():
    """Under inference_mode conv2d and linear reach the mode whole; they are decomposed and counted."""
    model = TinyNet()
    with torch.inference_mode(), StageProfiler(model) as profiler:
        model(torch.randn(2, 3, 5, 5))
    flops = {stage: tally.flops for stage, tally in profiler.by_stage().items() if tally.flops}
    assert flops == {"backbone": BODY, "fpn": FPN, "head": HEAD}


class WithLoss(nn.Module):
    """A model that computes its loss in a ``compute_loss`` method, as torchvision's RPN does."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 4)
        self.target = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compute_loss(self.head(x))

    def compute_loss(self, y: torch.Tensor) -> torch.Tensor:
        return (y @ self.target).sum()


def test_a_loss_method_is_its_own_stage_forward_and_backward():
    model = WithLoss()
    with StageProfiler(model) as profiler, named_losses(profiler, model):
        model(torch.randn(2, 5)).backward()
    product = 2 * 2 * 4 * 3  # [2, 4] @ [4, 3]
    assert profiler.tallies[("[loss] model.compute_loss", "forward")].flops == product
    assert profiler.tallies[("[loss] model.compute_loss", "backward")].flops == 2 * product
    assert profiler.by_stage()["loss"].flops == 3 * product
    assert "compute_loss" not in vars(model)  # the method is the class's again


def test_the_stages_of_pet_detectors_follow_their_module_names():
    keypoint = build_model(load_cfg(os.path.join(CFGS, "shapes", "keypoint_rcnn_R-10-FPN.yaml")))
    assert {detector_stage(path) for path, _ in keypoint.named_modules() if path} == {
        "preprocess", "backbone", "fpn", "rpn", "roi heads", "box head", "keypoint head"}
    rtdetr = build_model(load_cfg(os.path.join(CFGS, "shapes", "rtdetr_R-18.yaml")))
    assert {detector_stage(path) for path, _ in rtdetr.named_modules() if path} == {
        "preprocess", "backbone", "encoder", "decoder", "matcher", "loss"}
    assert detector_stage(OUTSIDE) == "other" and detector_stage("[loss] fastrcnn_loss") == "loss"


def test_the_demo_training_step_counts_its_sparse_roi_align_as_sparse(monkeypatch):
    """The demo's real step (one small image): the RoIAlign's products are found and counted sparse, every FLOP
    is in a stage, and the losses and optimizer have stages of their own."""
    monkeypatch.chdir(ROOT)
    workload = build_workload(DEMO_CFG, ["MODEL.FLOPS_INPUT_SIZE", "(64, 64)", "SOLVER.IMS_PER_BATCH", "1"], "train",
                              "float32")
    profiler, _ = profile_steps(workload, 1)
    stages = profiler.by_stage()
    assert {"backbone", "fpn", "rpn", "box head", "loss", "optimizer"} <= set(stages)
    pool = profiler.by_place()["roi_heads.box_roi_pool"]
    assert pool.flops == profiler.sparse_flops > 0
    assert profiler.sparse_dense_equivalent > 30 * profiler.sparse_flops
    assert sum(t.flops for t in stages.values()) == profiler.total().flops
