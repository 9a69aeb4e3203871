"""tools/benchmark.py times Pet's detectors against torchvision's holding the same weights: every pair it
compares must be built, with Pet's shipped configs, so that both sides hold exactly those weights."""
from __future__ import annotations

import os

import pytest
import torch

from support.helpers import ROOT
from tools.benchmarks.detectors import ARCHS, _model_pair
from tools.benchmarks.rtdetr import _pair, _scene


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_benchmark_pair_holds_the_same_weights(arch, monkeypatch):
    monkeypatch.chdir(ROOT)  # the benchmark reads cfgs/ from the repository root, as it is run
    pet_model, reference = _model_pair(arch, (256, 256), "channels_last")
    theirs = reference.state_dict()
    ours = pet_model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.numeric
@pytest.mark.parametrize("model", ["rtdetr-r18", "dfine-l"])
def test_the_rtdetr_pair_holds_the_same_weights(model):
    """tools/benchmark.py rtdetr: Pet's RT-DETR (D-FINE) and transformers' give the same top scores on the same
    pixels."""
    pytest.importorskip("transformers")
    pet_model, reference, processor = _pair("contiguous", model, os.path.join(ROOT, "cfgs"))
    images, targets, _ = _scene(1, 160)
    with torch.no_grad():
        ours = pet_model.eval()(images, targets)[0]
        theirs = processor.post_process_object_detection(reference.eval()(pixel_values=images.float() / 255),
                                                          threshold=0.0, target_sizes=[(160, 160)])[0]
    torch.testing.assert_close(ours["scores"], theirs["scores"], atol=1e-4, rtol=0)
