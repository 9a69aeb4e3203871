"""Class imbalance: LVIS' repeat factors, the repeat-factor samplers (seeded, sharded, resumable), the start-up
table."""
from __future__ import annotations

import itertools
import logging
import math
import uuid

import numpy as np
import pytest

from pet.config import load_cfg
from pet.data import build_train_loader, register_dataset
from pet.data.balance import repeat_factors
from pet.data.samplers import BatchSampler, RepeatFactorEpochSampler, RepeatFactorTrainingSampler
from pet.utils.errors import ConfigError
from support.format_sets import CLASSES, RARE, write_all_formats

# 20 images: class 1 in all but two, class 2 (rare) in one, two background images.
LABELS = [np.array([1, 2])] + [np.array([1, 1])] * 17 + [np.array([], np.int64)] * 2


def test_repeat_factors_follow_the_lvis_formula():
    threshold = 0.2
    factors = repeat_factors(LABELS, 2, threshold)
    f_rare, f_common = 1 / 20, 18 / 20
    assert factors[0] == pytest.approx(math.sqrt(threshold / f_rare))  # 2.0: its rarest class decides
    assert factors[0] == pytest.approx(max(1.0, math.sqrt(threshold / f_common), math.sqrt(threshold / f_rare)))
    assert (factors[1:18] == 1.0).all()  # sqrt(0.2 / 0.9) < 1: never below one
    assert (factors[18:] == 1.0).all()  # background images: no class, factor 1
    assert (repeat_factors(LABELS, 2, 0.0) == 1.0).all()


def test_over_many_passes_the_rare_image_is_drawn_as_often_as_its_factor_says():
    factors = repeat_factors(LABELS, 2, 0.3125)  # sqrt(0.3125 / 0.05) = 2.5: two copies, a third half the time
    assert factors[0] == pytest.approx(2.5)
    sampler = RepeatFactorTrainingSampler(factors, seed=7, rank=0, world_size=1)
    draws = [index for index, _ in itertools.islice(sampler, 200_000)]
    passes = len(draws) / factors.sum()  # a pass is sum(r_i) = 21.5 images in expectation
    counts = np.bincount(draws, minlength=len(factors))
    assert counts[0] / passes == pytest.approx(2.5, abs=0.03)  # ~6 standard deviations of the mean of ~9300 passes
    assert counts[1:].mean() / passes == pytest.approx(1.0, abs=0.01)
    # Each copy has its own transform seed, so a repeated image is augmented differently.
    rare_seeds = [seed for index, seed in itertools.islice(sampler, 1000) if index == 0]
    assert len(set(rare_seeds)) == len(rare_seeds) > 50


def test_the_stream_is_fixed_by_the_seed_and_ranks_share_it_without_overlap():
    factors = repeat_factors(LABELS, 2, 0.3125)
    whole = list(itertools.islice(RepeatFactorTrainingSampler(factors, seed=3, rank=0, world_size=1), 300))
    assert whole == list(itertools.islice(RepeatFactorTrainingSampler(factors, seed=3, rank=0, world_size=1), 300))
    assert whole != list(itertools.islice(RepeatFactorTrainingSampler(factors, seed=4, rank=0, world_size=1), 300))
    shards = [list(itertools.islice(RepeatFactorTrainingSampler(factors, seed=3, rank=r, world_size=3), 100))
              for r in range(3)]
    assert [item for row in zip(*shards) for item in row] == whole  # disjoint, and together the whole stream


def test_an_epoch_has_a_fixed_length_padded_for_the_ranks_and_reshuffles():
    factors = repeat_factors(LABELS, 2, 0.3125)  # sum 21.5 -> 22 items an epoch
    shards = [RepeatFactorEpochSampler(factors, seed=1, rank=r, world_size=4) for r in range(4)]
    assert all(len(s) == 6 for s in shards)  # ceil(22 / 4): the last two items repeat the epoch's start
    epoch0 = [list(s) for s in shards]
    whole = RepeatFactorEpochSampler(factors, seed=1, rank=0, world_size=1)
    assert len(whole) == 22
    drawn = list(whole)
    padded = (drawn * 2)[:24]
    assert [item for row in zip(*epoch0) for item in row] == padded  # disjoint shards covering the padded epoch
    for s in (*shards, whole):
        s.set_epoch(1)
    assert [list(s) for s in shards] != epoch0
    whole.set_epoch(0)
    assert list(whole) == drawn


def test_resuming_mid_epoch_gives_the_same_remaining_batches():
    factors = repeat_factors(LABELS, 2, 0.3125)
    uninterrupted = list(itertools.islice(BatchSampler(RepeatFactorTrainingSampler(factors, 5, rank=0, world_size=1),
                                                       4, drop_last=True), 30))
    resumed = BatchSampler(RepeatFactorTrainingSampler(factors, 5, rank=0, world_size=1), 4, drop_last=True)
    resumed.set_start_iter(17)  # mid-pass: a pass is ~5 batches of 4
    assert list(itertools.islice(resumed, 13)) == uninterrupted[17:]
    epoch = BatchSampler(RepeatFactorEpochSampler(factors, 5, rank=0, world_size=1), 4, drop_last=True)
    epoch.set_epoch(2)
    full = list(epoch)
    epoch.set_start_iter(3)
    assert list(epoch) == full[3:]


def test_the_training_loader_repeats_the_rare_class_and_logs_effective_frequencies(tmp_path, caplog):
    spec = write_all_formats(tmp_path)["voc"]
    name = f"voc_{uuid.uuid4().hex[:8]}"
    register_dataset(name, spec["path"], format="voc", split="train")
    cfg = load_cfg(None, ["DEVICE", "cpu", "MODEL.NUM_CLASSES", len(CLASSES), "TRAIN.DATASETS", f"('{name}',)",
                          "DATA.SAMPLER", "RepeatFactorTrainingSampler", "DATA.REPEAT_THRESHOLD", 0.5,
                          "DATA.FILTER_EMPTY", False, "DATA.NUM_WORKERS", 0, "SOLVER.IMS_PER_BATCH", 2])
    with caplog.at_level(logging.INFO, logger="pet.data.balance"):
        loader = build_train_loader(cfg)
    sampler = loader.batch_sampler.sampler
    assert isinstance(sampler, RepeatFactorTrainingSampler)
    rare = [i for i in range(len(loader.dataset)) if (loader.dataset.record(i)["labels"] == 3).any()]
    assert len(rare) == 1 and sampler.repeat_factors[rare[0]] == pytest.approx(math.sqrt(0.5 / (1 / 12)))
    table = next(r.getMessage() for r in caplog.records if "Repeat-factor sampling" in r.getMessage())
    row = next(line for line in table.splitlines() if f"| {RARE} " in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["1", f"{1 / 12:.4f}", f"{math.sqrt(6):.2f}"]  # images, f_c, r_c
    assert "(background)" in table
    cfg.defrost()
    cfg.DATA.SAMPLER = "RepeatFactor"
    with pytest.raises(ConfigError, match=r"DATA.SAMPLER must be one of \['TrainingSampler', "
                                          r"'RepeatFactorTrainingSampler'\], got 'RepeatFactor'"):
        build_train_loader(cfg)
